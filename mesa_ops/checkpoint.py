"""Compressed activation checkpointing: a block keeps only a packed copy of its input.

Activation checkpointing keeps a block's input and recomputes the block in backward. Here the
input is kept as an 8- (or 4-) bit copy packed through the Quantizer (the one quantization path
of :mod:`mesa_ops.quant`), and the recomputation starts from its dequantized copy. The forward
itself runs on the exact input (its output is bit-identical to the unwrapped block's); only the
activations regenerated for backward come from the 8-bit input, so the gradients carry the same
kind of error as Mesa's other layers.

It is PyTorch's non-reentrant checkpoint (``torch.utils.checkpoint.checkpoint(...,
use_reentrant=False)``): the autograd graph of the forward is kept and the tensors it saved are
regenerated on first use in backward; gradients flow into the exact input and the block's
parameters as without checkpointing.

Mesa layers inside a checkpointed block store exactly (:func:`exact_inside`), in the forward and
in the recomputation, with either kind of checkpoint: what a checkpointed forward saves is thrown
away, and what the recomputation saves lives only until the block's backward ends (one block at
a time), so quantizing there would cost two quantizations and a dequantization per layer and step
for no memory kept across the step. The only lossy copy is the block input's; the step costs what
plain checkpointing costs plus one quantization and one dequantization of the input, and the
recomputation's transient is one block's exact activations, as with plain checkpointing. (The
running ranges of those layers are not updated while their block is checkpointed.)

Input quantizer: ``range_mode='batch'`` (each step's exact per-group min / max; no range is kept
between steps and no state enters the state dict), stochastic rounding from a stream of each
block's own that advances with every call (:func:`input_quantizer`; it is not resumed from a
checkpoint: after a resume the checkpoint inputs draw other rounding noise than an uninterrupted
run would), groups of
:data:`GROUP_SIZE` channels along the channel dim (the last dim of (B, N, C) tokens, dim 1 of
(B, C, H, W) maps): the residual stream of a Transformer has a few large channels, which a
single range would let dominate.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.utils.checkpoint as tckpt

from .packed import QTensor
from .quant import DIST_SYNC_KEY, QuantMixin, Quantizer, channel_dim

__all__ = ["checkpoint_block", "exact_inside", "input_quantizer", "CheckpointedBlock", "wrap_blocks", "GROUP_SIZE"]
GROUP_SIZE = 32


def input_quantizer(x: torch.Tensor, bits: int, site=None) -> Quantizer:
    """The (batch-range) quantizer for a checkpoint input ``x`` at ``bits`` bits.

    ``site``: the block module a checkpoint call runs. Its quantizer is kept on it (in its
    ``__dict__``, not as a submodule: the state dict does not change) and reused by every later
    call, so that each call site has its own rounding stream (salted by the name of the block,
    from its named Mesa layers, else by the quantizer's construction number) and the stream
    advances with every call; a fresh quantizer would round every block's input, every step,
    with one seed. ``None`` (or a site that is not a module): a new quantizer, with a salt of
    its own."""
    c = x.shape[channel_dim(x.dim())]
    g = c // GROUP_SIZE if c % GROUP_SIZE == 0 and c >= GROUP_SIZE else 1
    keep = isinstance(site, nn.Module)
    old = site.__dict__.get(_SITE_QUANTIZER) if keep else None
    # (the all-reduce of its batch range follows the block's ms.set_dist_sync setting)
    sync = site.__dict__.get(DIST_SYNC_KEY, True) if keep else True
    # (the prefix tokens of the block's input, kept exactly, as its Mesa layers keep theirs)
    prefix = site_prefix(site) if keep else 0
    if old is not None and old.bits == bits and old.quant_groups == g and old.clip_val.device == x.device:
        old.dist_sync = sync
        old.prefix_tokens = prefix
        return old
    q = Quantizer(g, tag="checkpoint", enable=True, bits=bits).to(x.device)
    q.range_mode = "batch"
    q.dist_sync = sync
    q.prefix_tokens = prefix
    q.layer_name = _site_name(site) if keep else None
    if old is not None:  # other bits / groups / device: the stream goes on where it was
        q.iteration.copy_(old.iteration)
    if keep:
        site.__dict__[_SITE_QUANTIZER] = q
    return q


_SITE_QUANTIZER = "_mesa_input_quantizer"


def site_prefix(block: nn.Module) -> int:
    """The ``prefix_tokens`` of the block's first Mesa layer that has any (0 if none does)."""
    for m in block.modules():
        if isinstance(m, QuantMixin) and m.prefix_tokens:
            return m.prefix_tokens
    return 0


def _site_name(block: nn.Module) -> str | None:
    """'checkpoint input of <the common prefix of the block's named Mesa layers>' (e.g.
    'blocks.3'), None when none is named (policy.assign_indices names them)."""
    names = [m.layer_name.split(".") for m in block.modules()
             if isinstance(m, QuantMixin) and m.layer_name]
    if not names:
        return None
    common = []
    for parts in zip(*names):
        if any(p != parts[0] for p in parts):
            break
        common.append(parts[0])
    return f"checkpoint input of {'.'.join(common or names[0])}"


@contextlib.contextmanager
def exact_inside(block: nn.Module):
    """The Mesa layers of ``block`` store their activations exactly for the duration (their
    ``enable`` switched off, and back on after, also on an error): the forward and recomputation
    of a checkpointed block (see the module docstring). The forward output does not change: Mesa
    layers compute the plain layers' forward."""
    on = [m for m in block.modules() if isinstance(m, QuantMixin) and m.enable]
    for m in on:
        m.enable = False
    try:
        yield
    finally:
        for m in on:
            m.enable = True


class _Exact:
    """``block(*args, **kwargs)`` with the Mesa layers of ``owner`` (the module ``block`` runs)
    exact: the function of an ordinary (non-reentrant) checkpoint."""

    def __init__(self, block, owner):
        self.block, self.owner = block, owner

    def __call__(self, *args, **kwargs):
        with exact_inside(self.owner):
            return self.block(*args, **kwargs)


class _Run:
    """The block call for torch's checkpoint: the exact input in forward, the dequantized packed
    copy in the recomputation (the exact input is not referenced after the forward); the block's
    Mesa layers exact in both."""

    def __init__(self, block, owner, x, qt: QTensor, kwargs):
        self.block, self.owner, self.x, self.meta, self.kwargs = block, owner, x, qt.meta(), kwargs
        self.n = len(qt.tensors())  # (3, or 4 with the exact prefix rows)
        self.requires_grad = x.requires_grad

    def __call__(self, *args):
        stored, rest = args[:self.n], args[self.n:]
        x = self.x
        if x is not None:
            self.x = None
        else:
            x = QTensor.restore(stored, self.meta)
            x._mesa_ws = None  # the recomputed graph holds it: never handed back to the workspace
            x.requires_grad_(self.requires_grad)
        with exact_inside(self.owner):
            return self.block(x, *rest, **self.kwargs)


def checkpoint_block(block, *args, bits: int | None = None, owner: nn.Module | None = None, **kwargs):
    """``block(*args, **kwargs)`` under non-reentrant activation checkpointing.

    ``bits=None``: the ordinary checkpoint (the inputs kept as they are). ``bits=8`` / ``4`` /
    ``2``: the first argument (a floating tensor, e.g. tokens (B, N, C)) is kept as a packed
    copy at that many bits and the recomputation starts from its dequantized copy; the other
    arguments (e.g. PVT's H, W; masks) are kept as they are. Outside training / without grad
    the block simply runs. ``owner``: the module a ``block`` that is not one runs (e.g. a
    ``functools.partial`` around a block): its Mesa layers are the ones kept exact
    (:func:`exact_inside`) and it owns the input quantizer's rounding stream; default ``block``.
    """
    return _checkpoint(block, args, bits, kwargs, owner)[0]


def _checkpoint(block, args, bits, kwargs, owner=None):
    """(output, the tensors kept for the recomputation)."""
    owner = block if owner is None else owner
    if not isinstance(owner, nn.Module):
        raise TypeError(f"checkpoint_block: {type(block).__name__} is not a module; pass the module it runs "
                        "as owner=")
    if not (torch.is_grad_enabled() and getattr(owner, "training", True)):
        return block(*args, **kwargs), []
    if bits is None:
        kept = [a for a in args if isinstance(a, torch.Tensor)]
        return tckpt.checkpoint(_Exact(block, owner), *args, use_reentrant=False, **kwargs), kept
    if not args or not isinstance(args[0], torch.Tensor) or not args[0].is_floating_point():
        raise TypeError(f"checkpoint_block(bits={bits}): the first argument must be a floating "
                        f"tensor (the block input), got {type(args[0]).__name__ if args else 'nothing'}")
    x = args[0]
    qt = input_quantizer(x, bits, owner).quantize(x)
    run = _Run(block, owner, x, qt, kwargs)
    del x
    out = tckpt.checkpoint(run, *qt.tensors(), *args[1:], use_reentrant=False)
    return out, list(qt.tensors()) + [a for a in args[1:] if isinstance(a, torch.Tensor)]


class CheckpointedBlock(nn.Module):
    """``block`` under :func:`checkpoint_block` with ``bits`` (None: ordinary checkpoint). The
    block stays a child named ``block``; ``stored_inputs`` lists what the last forward kept."""

    def __init__(self, block: nn.Module, bits: int | None = None):
        super().__init__()
        self.block = block
        self.bits = bits
        self.stored_inputs: list = []

    def forward(self, *args, **kwargs):
        if not (self.training and torch.is_grad_enabled()):
            return self.block(*args, **kwargs)
        out, self.stored_inputs = _checkpoint(self.block, args, self.bits, kwargs)
        return out

    def extra_repr(self) -> str:
        return f"bits={self.bits}"


def find_blocks(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, name, block) of the outermost modules whose class name ends in 'Block', in
    module order (inside a CheckpointedBlock, the block it wraps)."""
    found = []

    def visit(module):
        for name, child in module.named_children():
            if type(child).__name__.endswith("Block") and not isinstance(child, CheckpointedBlock):
                found.append((module, name, child))
            else:
                visit(child)
    visit(model)
    return found


CHECKPOINT_KEYS = ("enable", "bits")


def apply_checkpoint_policy(model: nn.Module, blocks: list, where: str = "policy") -> dict:
    """Apply the blocks of a policy file's ``on checkpoint:`` section to the model's blocks
    (indices: the '*Block' modules in module order, see :func:`find_blocks`). Each policy block
    sets ``enable`` (checkpoint or not) and/or ``bits`` (8/4/2: keep the block's input packed at
    that many bits; absent: ordinary checkpointing); later blocks override earlier ones.

    Models of this repo (DeiT, Swin, PVT) run each block through ``models.timm_api.run_block``,
    which reads the per-block choice (``block.mesa_checkpoint``; the state-dict keys do not
    change); other models get their chosen blocks wrapped in :class:`CheckpointedBlock`.
    Returns {block index: bits or None} of the checkpointed blocks."""
    from .quant import PolicyError

    found = find_blocks(model)
    if not found:
        raise PolicyError(f"{where}: 'on checkpoint:' but {type(model).__name__} has no '*Block' "
                          "modules to checkpoint")
    plan: dict[int, list] = {}
    for blk in blocks:
        settings = {k: v for k, v in blk.settings.items() if k != "_ignored"}
        bad = [k for k in settings if k not in CHECKPOINT_KEYS] + (["by_tag"] if blk.by_tag else [])
        if bad:
            raise PolicyError(f"{where}:{blk.line}: 'on checkpoint:' takes only "
                              f"{', '.join(CHECKPOINT_KEYS)}; got {', '.join(bad)}")
        idx = range(len(found)) if blk.by_index == "all" else blk.by_index
        out = [i for i in idx if i >= len(found)]
        if out:
            raise PolicyError(f"{where}:{blk.line}: checkpoint by_index {out} out of range (the "
                              f"model has {len(found)} blocks)")
        for i in idx:
            cur = plan.setdefault(i, [True, None])
            if "enable" in settings:
                cur[0] = bool(settings["enable"])
            if "bits" in settings:
                cur[1] = int(settings["bits"])
    native = hasattr(model, "set_grad_checkpointing") and hasattr(model, "checkpointed")
    chosen = {}
    for i, (enable, bits) in sorted(plan.items()):
        parent, name, block = found[i]
        if native:
            block.mesa_checkpoint = (enable, bits)
        elif enable:
            if isinstance(parent, CheckpointedBlock):
                parent.bits = bits
            else:
                setattr(parent, name, CheckpointedBlock(block, bits))
        if enable:
            chosen[i] = bits
    return chosen


def wrap_blocks(model: nn.Module, bits: int | None = None, select=None) -> list[CheckpointedBlock]:
    """Wrap the outermost modules whose class name ends in 'Block' (the DeiT, Swin and PVT
    blocks) in :class:`CheckpointedBlock`, in module order; ``select``: indices (in that order)
    of the blocks to wrap (None: all). Returns the wrappers."""
    found = find_blocks(model)
    if not found:
        raise ValueError(f"{type(model).__name__}: no '*Block' modules to checkpoint")
    chosen = range(len(found)) if select is None else list(select)
    bad = [i for i in chosen if not 0 <= i < len(found)]
    if bad:
        raise ValueError(f"wrap_blocks: block indices {bad} out of range (the model has {len(found)})")
    wrapped = []
    for i in chosen:
        parent, name, child = found[i]
        w = CheckpointedBlock(child, bits)
        setattr(parent, name, w)
        wrapped.append(w)
    return wrapped
