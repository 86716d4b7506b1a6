"""Policy files in the original Mesa text format, and model conversion.

A policy file::

    on gelu:                 # layer tag: fc conv gelu bn relu softmax matmul layernorm ...
                             # (normalize scale: cosine attention)
        by_index: all        # 'all' or indices (per tag, in module order)
        enable: True
        level: 256           # 2**bits; or `bits: 8`
        ema_decay: 0.9
        by_index: 1 2        # a later block overrides for its indices
        enable: False

Section ``on checkpoint:`` selects activation checkpointing per Transformer block (by_index over
the '*Block' modules in order; ``enable: True`` checkpoints, ``bits: 8`` keeps the block's input
packed at 8 bits instead of full precision: compressed checkpointing; see
:func:`mesa_ops.checkpoint.apply_checkpoint_policy`).

Numbers after ``on <tag>:`` are trigger epochs for :func:`deploy_on_epoch`. A malformed file
raises :class:`PolicyError` naming the file, the line and what was expected.

Keys: ``enable``, ``level`` (256/16/4), ``bits`` (8/4/2), ``ema_decay``, ``quant_groups``,
``group_size``, ``stochastic``, ``range_mode`` ('ema'/'batch'), ``nonfinite``
('auto'/'raise'/'skip'; ``check_finite`` True/False is the older spelling of raise/skip),
``dist_sync``; ``by_tag``
right after ``by_index`` narrows a block to some tags, or to one quantizer of MatMul/Softmax
(``matmul-1``/``matmul-2``, ``softmax-1``/``softmax-2``). Keys of the original code that do
nothing here (``stable``, ``fp_forward``, ``non_negative_only``, ...) are accepted and ignored.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch.nn as nn

from . import layers as L
from .quant import QuantMixin, set_prefix_tokens, update_quantization_parameter
from .settings import IGNORED_KEYS, KEYS, PolicyError, parse_groups

_log = logging.getLogger("mesa_ops")

TAGS = ("conv", "fc", "eltwise", "shuffle", "concat", "norm", "gelu", "layernorm", "matmul",
        "softmax", "bn", "relu", "attention", "normalize", "scale")  # the original's order of index
# assignment (+ SDPA, and the Normalize / Scale of cosine attention)
CHECKPOINT = "checkpoint"  # section of per-block (compressed) activation checkpointing
SUB_TAGS = ("matmul-1", "matmul-2", "softmax-1", "softmax-2")  # quant1/quant2 of MatMul/Softmax


# the settings' validators and their application to a layer live with the quantizer; the
# names stay importable from here (the original API: ms.policy.update_quantization_parameter)
__all__ = ["PolicyError", "KEYS", "IGNORED_KEYS", "update_quantization_parameter", "parse_policy",
           "read_policy", "deploy_on_init", "deploy_on_epoch", "deploy_on_iteration", "set_mesa",
           "convert_by_num_groups", "convert_by_group_size", "mesa_layers", "assign_indices"]


@dataclass
class Block:
    by_index: object  # 'all' or list[int]
    settings: dict = field(default_factory=dict)
    by_tag: list | None = None
    line: int = 0

    def as_dict(self) -> dict:
        d = {"by_index": self.by_index, **self.settings}
        if self.by_tag is not None:
            d["by_tag"] = self.by_tag
        return d


@dataclass
class Section:
    tag: str
    trigger: list
    blocks: list
    line: int


class PolicyList(list):
    """What :func:`read_policy` returns: the original's list ``[{'trigger': [...]}, block, ...]``
    (equal to a plain list), remembering the section's ``tag`` so that :func:`deploy_on_epoch`
    applies it to that tag's layers only."""

    def __init__(self, items=(), tag: str | None = None, filename: str | None = None):
        super().__init__(items)
        self.tag = tag
        self.filename = filename


def parse_policy(filename: str) -> dict[str, Section]:
    """Parse a policy file into sections by tag; raise PolicyError on any malformed line."""
    filename = os.fspath(filename)
    if not os.path.isfile(filename):
        raise PolicyError(f"policy file not found: {filename}")
    sections: dict[str, Section] = {}
    cur: Section | None = None
    block: Block | None = None

    def fail(lineno, text, what):
        raise PolicyError(f"{filename}:{lineno}: {what} (line: {text.strip()!r})")

    def close_block():
        if block is not None and not block.settings:
            fail(block.line, f"by_index: {block.by_index}", "a 'by_index' block sets nothing; "
                 "expected settings such as 'enable:' after it")

    with open(filename, encoding="utf-8") as f:
        lines = f.readlines()
    for lineno, raw in enumerate(lines, 1):
        text = raw.split("#", 1)[0].strip()
        if not text:
            continue
        if ":" not in text:
            fail(lineno, raw, "expected 'on <tag>:' or '<key>: <value>' (missing ':')")
        key, value = (s.strip() for s in text.split(":", 1))
        words = key.split()
        if words and words[0] == "on":
            if len(words) != 2 or words[1] not in TAGS + (CHECKPOINT,):
                fail(lineno, raw, f"expected 'on <tag>:' with a tag among {', '.join(TAGS)} "
                     f"(or 'on {CHECKPOINT}:')")
            close_block()
            try:
                trigger = [int(t) for t in value.replace(",", " ").split()]
            except ValueError:
                fail(lineno, raw, "expected trigger epochs (integers) after 'on <tag>:'")
            if words[1] in sections:
                fail(lineno, raw, f"section 'on {words[1]}:' appears twice (first at line "
                     f"{sections[words[1]].line})")
            cur = Section(words[1], trigger, [], lineno)
            sections[cur.tag] = cur
            block = None
            continue
        if cur is None:
            fail(lineno, raw, "expected a section header 'on <tag>:' first")
        if len(words) != 1:
            fail(lineno, raw, f"expected one key before ':', got {key!r}")
        if key == "by_index":
            close_block()
            if value == "all":
                idx = "all"
            else:
                try:
                    idx = [int(t) for t in value.replace(",", " ").split()]
                except ValueError:
                    fail(lineno, raw, "expected 'by_index: all' or a list of layer indices")
                if not idx:
                    fail(lineno, raw, "expected 'by_index: all' or a list of layer indices "
                         "(got nothing)")
                if any(i < 0 for i in idx):
                    fail(lineno, raw, "expected non-negative layer indices")
            block = Block(idx, line=lineno)
            cur.blocks.append(block)
            continue
        if block is None:
            fail(lineno, raw, f"expected 'by_index:' before '{key}:' in section 'on {cur.tag}:'")
        if key == "by_tag":
            if block.settings:
                fail(lineno, raw, "expected 'by_tag:' right after 'by_index:', before the "
                     "block's settings")
            tags = value.replace(",", " ").split()
            bad = [t for t in tags if t not in TAGS + SUB_TAGS]
            if not tags or bad:
                fail(lineno, raw, f"expected tags among {', '.join(TAGS + SUB_TAGS)}")
            block.by_tag = tags
        elif key in KEYS:
            try:
                block.settings[key] = KEYS[key](value)
            except ValueError as exc:
                fail(lineno, raw, f"bad value for '{key}': {exc}")
        elif key in IGNORED_KEYS:
            block.settings.setdefault("_ignored", []).append(key)
        else:
            fail(lineno, raw, f"unknown key '{key}'; expected one of by_index, by_tag, "
                 f"{', '.join(KEYS)}")
    close_block()
    return sections


def read_policy(filename: str, section: str = "init", debug: bool = False, verbose=print) -> list:
    """The original's list form of one section: ``[{'trigger': [...]}, block, block, ...]``
    (empty when the file has no such section)."""
    sec = parse_policy(filename).get(section)
    if sec is None:
        return PolicyList([], tag=section, filename=os.fspath(filename))
    out = [{"trigger": sec.trigger}] + [b.as_dict() for b in sec.blocks]
    if debug:
        verbose(out)
    return PolicyList(out, tag=section, filename=os.fspath(filename))


def mesa_layers(model: nn.Module):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, L.MESA_LAYERS)]


def assign_indices(model: nn.Module) -> dict[str, int]:
    """Number Mesa layers per tag in module order (the original's ``index``); name them."""
    counts = {t: 0 for t in TAGS}
    for name, m in mesa_layers(model):
        m.layer_name = name or type(m).__name__
        if m.tag in counts:
            m.index = counts[m.tag]
            counts[m.tag] += 1
    return counts


def _override_verbose(model: nn.Module, verbose) -> None:
    for m in model.modules():
        if isinstance(m, (QuantMixin,) + L.MESA_LAYERS):
            m.verbose = verbose


def deploy_on_init(model: nn.Module, filename: str, verbose=print, override_verbose: bool = False):
    """Index the Mesa layers of ``model`` and apply every section of the policy ``filename``:
    section ``on <tag>:`` to the layers of that tag, its blocks in order (a later block overrides
    an earlier one for its indices). The whole file is checked before anything is changed.
    ``verbose`` gets a summary per section; with ``override_verbose`` it also becomes every
    layer's ``verbose`` (per-setting messages, by default to the ``mesa_ops`` logger)."""
    if not hasattr(model, "modules"):
        return
    sections = parse_policy(filename)
    if override_verbose:
        _override_verbose(model, verbose)
    layers_ = mesa_layers(model)
    counts = assign_indices(model)
    ckpt = sections.pop(CHECKPOINT, None)
    if ckpt is not None:  # checked before any layer is changed
        from .checkpoint import apply_checkpoint_policy

        chosen = apply_checkpoint_policy(model, ckpt.blocks, where=filename)
        verbose(f"mesa policy: checkpoint: {len(chosen)} blocks "
                + ", ".join(f"{i}" + ("" if b is None else f"@{b}bit") for i, b in chosen.items()))
    for tag, sec in sections.items():
        tagged = [m for _, m in layers_ if m.tag == tag]
        for blk in sec.blocks:
            if blk.by_index != "all":
                missing = [i for i in blk.by_index if i >= counts.get(tag, 0)]
                if missing:
                    verbose(f"mesa policy {filename}:{blk.line}: by_index {missing} matches no "
                            f"'{tag}' layer (the model has {counts.get(tag, 0)})")
            for m in tagged:
                update_quantization_parameter(m, **blk.as_dict())
        on = [m for m in tagged if m.enable]
        bits = sorted({m.bits for m in on})
        verbose(f"mesa policy: {tag}: {len(on)}/{len(tagged)} layers enabled"
                + (f" ({'/'.join(map(str, bits))}-bit)" if on else ""))
    report_attention_paths(model, verbose)


_PATHS = {"mesa-sdpa": "fused Mesa SDPA (q, k, v, out packed, no N x N matrix)",
          "mesa-explicit": "explicit q@k / softmax / attn@v (Mesa matmul / softmax)",
          "sdpa": "exact fused SDPA (nothing compressed)",
          "explicit": "exact explicit q@k / softmax / attn@v (nothing compressed)"}


def report_attention_paths(model: nn.Module, verbose=print) -> dict:
    """One ``mesa policy: attention path: ...`` line per path the model's attention modules (any
    module with a ``training_path()`` method, e.g. ``models.layers.AttentionOps``) take in a
    training forward, and a warning line for those that store their N x N softmax output at
    full precision (the explicit path, taken when any matmul / softmax quantizer is on, with
    the softmax quantizer off: at DeiT's N = 197, more bytes than exact fused SDPA).
    Returns {module name: path}."""
    paths, full = {}, []
    for name, m in model.named_modules():
        fn = getattr(m, "training_path", None)
        if callable(fn):
            paths[name], f = fn()
            if f and paths[name] == "mesa-explicit":
                full.append(name)
    for path in _PATHS:
        names = [n for n, p in paths.items() if p == path]
        if names:
            shown = ", ".join(names[:3]) + (f", ... ({len(names)} in all)" if len(names) > 3 else "")
            verbose(f"mesa policy: attention path: {_PATHS[path]}: {shown}")
    if full:
        verbose(f"mesa policy: WARNING: {len(full)} attention module(s) take the explicit path with "
                "the softmax quantizer off and store their N x N softmax output "
                "at full precision (B * heads * N * N values; fused SDPA stores none), which at "
                "DeiT's N = 197 (224 px) is more than exact fused SDPA stores: "
                "enable 'softmax' (with 'matmul') or 'attention' (fused Mesa SDPA) in the policy "
                "(docs/attention.md)")
    return paths


def deploy_on_epoch(model: nn.Module, policies: list, epoch: int, optimizer=None, verbose=print):
    """Apply a section read by :func:`read_policy` when ``epoch`` is one of its triggers.

    Unlike the original (which applied a section's blocks to the layers of every tag), a list from
    :func:`read_policy` is applied to the layers of its section's tag only; a hand-built list
    (no ``tag``) to all Mesa layers, as the original."""
    if not hasattr(model, "modules") or len(policies) < 1:
        return
    if not isinstance(policies[0], dict) or "trigger" not in policies[0]:
        raise PolicyError("deploy_on_epoch: policies[0] must hold the 'trigger' epochs "
                          "(use ms.policy.read_policy(filename, section))")
    if epoch not in policies[0]["trigger"]:
        return
    tag = getattr(policies, "tag", None)
    layers_ = [m for _, m in mesa_layers(model) if tag is None or m.tag == tag]
    if any(m.index < 0 for m in layers_):  # never indexed (no deploy_on_init yet)
        assign_indices(model)
    for p in policies[1:]:
        if not isinstance(p, dict):
            raise PolicyError(f"deploy_on_epoch: expected policy blocks (dicts), got {p!r}")
        for m in layers_:
            update_quantization_parameter(m, **p)
    verbose(f"mesa policy: applied {len(policies) - 1} block(s)"
            f"{f' on {tag}' if tag else ''} at epoch {epoch}")


def deploy_on_iteration(model, policies, iteration, optimizer=None, verbose=print):
    deploy_on_epoch(model, policies, iteration, optimizer, verbose)


def set_mesa(model: nn.Module, enable: bool = True, bits: int = 8, tags=None, **settings) -> int:
    """Programmatic policy: set ``enable``/``bits`` (and any policy key) on the Mesa layers of
    ``model`` whose tag is in ``tags`` (all when None). Returns how many layers were set."""
    assign_indices(model)
    n = 0
    for _, m in mesa_layers(model):
        if tags is None or m.tag in tags:
            update_quantization_parameter(m, by_index="all", enable=enable, bits=bits, **settings)
            n += 1
    return n


# ---- conversion ------------------------------------------------------------------------------
# nn classes Mesa replaces; a subclass is replaced only when it keeps the base forward (e.g.
# nn.MultiheadAttention's NonDynamicallyQuantizableLinear) or is known to compute the same
# (timm's LayerNorm); others (timm's LayerNorm2d, BatchNormAct2d, Conv2dSame, ...) are left as
# they are and their children converted.
_CONVERTIBLE = (nn.Linear, nn.Conv2d, nn.LayerNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d,
                nn.SyncBatchNorm, nn.GELU, nn.Softmax, nn.ReLU)
# subclasses with their own forward that Mesa has a version of (mesa_ops.timm_layers): the
# module's class is swapped in place, its children converted as any others
_SWAPPABLE = {"timm.layers.norm_act.BatchNormAct2d", "timm.layers.layer_scale.LayerScale",
              "timm.layers.layer_scale.LayerScale2d", "timm.models.vision_transformer.LayerScale"}
_HF_SWAPPABLE = {"transformers.pytorch_utils.Conv1D"}  # (mesa_ops.hf_layers)
_SAME_FORWARD = {"timm.layers.norm.LayerNorm", "timm.models.layers.norm.LayerNorm",
                 # mmcv's wrappers (mmseg / mmdet backbones): their forward special-cases empty
                 # inputs on torch < 1.4 / 1.5 only, and is the base forward otherwise
                 "mmcv.cnn.bricks.wrappers.Linear", "mmcv.cnn.bricks.wrappers.Conv2d"}


def _base_of(child: nn.Module):
    for base in _CONVERTIBLE:
        if isinstance(child, base):
            return base
    return None


def _convertible(child: nn.Module) -> bool:
    base = _base_of(child)
    if base is None or isinstance(child, L.MESA_LAYERS):
        return False
    cls = type(child)
    if cls is not base and cls.forward is not base.forward \
            and f"{cls.__module__}.{cls.__qualname__}" not in _SAME_FORWARD:
        _log.info("mesa convert: leaving %s as it is (it overrides %s.forward)",
                  cls.__qualname__, base.__name__)
        return False
    if getattr(child, "parametrizations", None) is not None:  # torch.nn.utils.parametrize
        _log.info("mesa convert: leaving parametrized %s as it is", cls.__qualname__)
        return False
    return True


def _first_tensor(module: nn.Module | None):
    if module is None:
        return None
    for t in module.parameters(recurse=False):
        return t
    for t in module.buffers(recurse=False):
        return t
    for t in module.parameters():
        return t
    for t in module.buffers():
        return t
    return None


def _adopt(new: nn.Module, old: nn.Module, parent: nn.Module | None = None) -> nn.Module:
    """Give ``new`` the very parameters and buffers of ``old`` (no re-initialisation); put its
    quantizer state on the device of ``old`` (or, for GELU/Softmax/ReLU, of ``parent``).
    Hooks registered on ``old`` are not carried over (as in the original)."""
    for name, p in old.named_parameters(recurse=False):
        setattr(new, name, p)
    for name, b in old.named_buffers(recurse=False):
        if name in new._buffers:
            new._buffers[name] = b
    ref = _first_tensor(old)
    if ref is None:
        ref = _first_tensor(parent)
    dev = ref.device if ref is not None and ref.device.type != "meta" else None
    if dev is not None:
        for q in new.modules():
            if isinstance(q, QuantMixin):
                for n in ("clip_val", "shift", "iteration"):
                    q._buffers[n] = q._buffers[n].to(dev)
    new.train(old.training)
    return new


def _groups_of_size(channels: int, s: int, what: str) -> int:
    if channels <= s:
        return 1  # e.g. the 3 input channels of a patch embedding: one group
    if channels % s:
        raise PolicyError(f"convert_by_group_size: group size {s} does not divide the {channels} "
                          f"channels of {what}")
    return channels // s


def _swap_class(child: nn.Module, g_of) -> nn.Module | None:
    """``child`` turned into its Mesa version in place (a class of :data:`_SWAPPABLE`), or None."""
    cls = type(child)
    qn = f"{cls.__module__}.{cls.__qualname__}"
    if qn in _HF_SWAPPABLE:
        from .hf_layers import SWAPS
    elif qn in _SWAPPABLE:
        from .timm_layers import SWAPS
    else:
        return None
    swap = SWAPS.get(qn)
    if swap is None:  # (a name of another timm version)
        return None
    mesa_cls, tag, channels = swap
    child.__class__ = mesa_cls
    ref = _first_tensor(child)
    child._init_quant(g_of(channels(child)), tag=tag)
    if ref is not None and ref.device.type != "meta":
        for b in ("clip_val", "shift", "iteration"):
            child._buffers[b] = child._buffers[b].to(ref.device)
    return child


def _convert_child(child: nn.Module, spec, parent=None, name=""):
    """A Mesa layer for an ``nn`` layer (or None). ``spec`` is ('groups', G) or ('size', S)."""
    kind, n = spec
    what = f"{name!r} ({type(child).__name__})"

    def g_of(channels):
        return n if kind == "groups" else _groups_of_size(channels, n, what)

    swapped = _swap_class(child, g_of)
    if swapped is not None:
        return swapped
    if not _convertible(child):
        return None

    meta = dict(device="meta")
    if isinstance(child, nn.Linear):
        new = L.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                       quant_groups=g_of(child.in_features), **meta)
    elif isinstance(child, nn.Conv2d):
        new = L.Conv2d(child.in_channels, child.out_channels, child.kernel_size, child.stride,
                       child.padding, child.dilation, child.groups, child.bias is not None,
                       child.padding_mode, quant_groups=g_of(child.in_channels), **meta)
    elif isinstance(child, nn.LayerNorm):
        new = L.LayerNorm(child.normalized_shape, child.eps, child.elementwise_affine,
                          bias=child.bias is not None,
                          quant_groups=g_of(child.normalized_shape[-1]), **meta)
    elif isinstance(child, nn.SyncBatchNorm):
        new = L.SyncBatchNorm(child.num_features, child.eps, child.momentum, child.affine,
                              child.track_running_stats, child.process_group,
                              quant_groups=g_of(child.num_features), **meta)
    elif isinstance(child, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)):
        cls = {nn.BatchNorm1d: L.BatchNorm1d, nn.BatchNorm2d: L.BatchNorm2d,
               nn.BatchNorm3d: L.BatchNorm3d}[_base_of(child)]
        new = cls(child.num_features, child.eps, child.momentum, child.affine,
                  child.track_running_stats, quant_groups=g_of(child.num_features), **meta)
    elif isinstance(child, nn.GELU):
        new = L.GELU(approximate=child.approximate, **_runtime_groups(spec))
    elif isinstance(child, nn.Softmax):
        new = L.Softmax(dim=child.dim, quant_groups=n if kind == "groups" else 1)
        if kind == "size":
            new.group_size = 1  # one group per head: dim 1 of (B, H, N, N)
    elif isinstance(child, nn.ReLU):
        new = L.ReLU(inplace=child.inplace, **_runtime_groups(spec))
    else:
        return None
    _adopt(new, child, parent)
    left = [k for k, t in list(new.named_parameters()) + list(new.named_buffers())
            if t.device.type == "meta" and not _is_meta_model(child)]
    if left:
        _log.info("mesa convert: leaving %s as it is (cannot carry over %s)", what, left)
        return None
    return new


def _is_meta_model(child) -> bool:
    t = _first_tensor(child)
    return t is not None and t.device.type == "meta"


def _runtime_groups(spec) -> dict:
    kind, n = spec
    return {"quant_groups": n} if kind == "groups" else {"group_size": n}


def _convert(module: nn.Module, spec) -> nn.Module:
    for name, child in module.named_children():
        if isinstance(child, L.MESA_LAYERS):
            if isinstance(child, L.BatchNormBase) and type(child) not in L.MESA_LAYERS:
                _convert(child, spec)  # a swapped class (BatchNormAct2d): its act / drop children
            continue
        new = _convert_child(child, spec, parent=module, name=name)
        if new is None or new is child:
            _convert(child, spec)
        else:
            setattr(module, name, new)
    return module


def _convert_root(module: nn.Module, spec) -> nn.Module:
    new = _convert_child(module, spec, name=type(module).__name__)
    if new is not None:  # the model itself is one nn layer: return its Mesa layer
        return new
    out = _convert(module, spec)
    mark_prefix_tokens(out)
    return out


def mark_prefix_tokens(model: nn.Module) -> int:
    """A ViT's class / distillation / register tokens lead the tokens of its ``blocks`` and
    ``norm``: keep their rows exactly (:func:`mesa_ops.quant.set_prefix_tokens`). The count is
    ``model.num_prefix_tokens`` (timm), else one per ``cls_token`` / ``dist_token`` parameter
    (the DeiT code the original Mesa ran). Returns it (0: nothing marked)."""
    if any(hasattr(model, a) for a in ("blocks_token_only", "cls_attn_blocks")):
        return 0  # CaiT / XCiT: the class token joins after the blocks
    p = getattr(model, "num_prefix_tokens", None)
    if not isinstance(p, int):
        p = sum(isinstance(getattr(model, n, None), nn.Parameter) for n in ("cls_token", "dist_token"))
    if p > 0:
        for part in ("blocks", "norm"):
            if isinstance(getattr(model, part, None), nn.Module):
                set_prefix_tokens(getattr(model, part), p)
    return p


def convert_by_num_groups(module: nn.Module, num_groups: int) -> nn.Module:
    """Replace the nn layers Mesa knows (Linear, Conv2d, LayerNorm, BatchNorm1d/2d/3d, SyncBatchNorm,
    GELU, Softmax, ReLU; timm's BatchNormAct2d) by Mesa layers with ``num_groups`` quantization
    groups, in place, and return the model.
    Every parameter and buffer is kept (the same objects: an optimizer built before still
    works), as are device, dtype and train/eval mode; converting twice changes nothing.
    Compression stays off until a policy enables it. (When ``module`` itself is such a layer,
    its Mesa layer is returned.)"""
    return _convert_root(module, ("groups", parse_groups(num_groups)))


def convert_by_group_size(module: nn.Module, hidden_group_size: int) -> nn.Module:
    """Like :func:`convert_by_num_groups` with groups of ``hidden_group_size`` channels:
    ``channels // hidden_group_size`` groups (one group when a layer has no more channels than
    that, e.g. a patch embedding's 3 input channels). GELU and ReLU derive their group count from
    their input at the first step; Softmax uses one group per head (dim 1 of (B, H, N, N))."""
    return _convert_root(module, ("size", parse_groups(hidden_group_size)))
