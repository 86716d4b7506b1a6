"""Memory-budget planner: per layer the bits (8/4/2/off), per block (compressed) checkpointing.

    profile = measure(model, probe_input)                  # bytes, error proxy, time per option
    plan = make_plan(profile, budget_bytes, batch_size)    # fits the budget: least error, then time
    write_plan(plan, model, 'plan.txt')                    # one policy file: bits + 'on checkpoint:'
    apply_plan(model, 'plan.txt')                          # bits + checkpointing (deploy_on_init)
    largest_batch(profile, budget_bytes, limit)            # the largest batch some plan fits

What is measured and what is estimated (read before trusting a plan):

* **Bytes** (measured): saved-for-backward bytes of each Mesa layer (a unit; an attention core,
  ms.SDPA or MatMul/Softmax/MatMul under one parent, is one unit) with every unit exact and at
  8, 4 and 2 bits (four audited training forwards of the probe batch, :func:`mesa_ops.audit`),
  and the input bytes of every block (outermost modules whose class name ends in ``Block``).
  A unit's exact bytes are the largest seen with its neighbours exact or packed (a tensor an
  exact neighbour would also save, e.g. SDPA's output = the projection's input, is counted for
  both: conservative). The plan assumes these add up and scale
  linearly with the batch (probe batch -> ``batch_size``). Under checkpointing a block keeps its
  input (exact, or packed at 8 bits by ``mesa_ops.checkpoint.checkpoint_block`` where that module
  exists); the recomputation in backward re-creates the activations of one block at a time, so
  the largest checkpointed block's own bytes are added to the total (conservative: the audited
  forward does not see that transient). The stem conv, whose input is the image the caller holds
  anyway, stays exact.
* **Error** (a proxy, measured): for each unit and bits, the relative L2 error that storing its
  saved activations at that many bits adds, measured by quantizing the probe batch's activations
  with a copy of the layer's own quantizer (for LayerNorm: the error of the normalized input,
  which is what its backward uses; for attention: the largest over q, k, v and the output; a
  packed checkpoint: its block input). This is *not* the gradient error; the objective sums the
  squared proxies over units (independent rounding noise adds in variance). Exact checkpointing
  has no error. After planning, :func:`verify` measures the saved bytes of the planned model and
  its gradient error (one step), bias and noise against exact training on the probe batch
  (:func:`mesa_ops.fidelity.grad_fidelity`).
* **Time** (estimated from measurements): quantization costs ``alpha`` seconds per element kept,
  ``alpha`` = (step time with every unit at 8 bits - exact step time) / elements, from the probe;
  checkpointing a block costs its measured forward time (recomputation).

Optimization: start exact; greedily apply the move (a unit one step lower: off->8->4->2; a block
to checkpointing, which also sets its units exact; an exact checkpoint to a packed one) with the
least added error per byte saved, ties by the least added time per byte, until the estimate fits
the budget; exact checkpointing adds no error, so it is preferred to quantization (least error
first, then time, as asked). No configuration fits -> :class:`PlanError` naming the smallest
reachable size and the bytes no option can reduce.
"""
from __future__ import annotations

import contextlib
import copy
import importlib
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn

from . import layers as L
from .attention import QUANTIZERS, SDPA
from .audit import audit, format_bytes
from .bench import train_step_time
from .checkpoint import site_prefix
from .policy import TAGS, assign_indices, deploy_on_init, mesa_layers
from .quant import Quantizer

__all__ = ["PlanError", "Unit", "BlockInfo", "Profile", "Plan", "measure", "make_plan", "write_plan",
           "read_plan", "check_plan", "apply_plan", "verify", "checkpoint_blocks", "checkpointed_blocks",
           "largest_batch", "BITS"]

BITS = (0, 8, 4, 2)  # 0 = exact (off)
_ATTN = (SDPA, L.MatMul, L.Softmax)


class PlanError(ValueError):
    """No configuration fits the budget (or a plan that cannot be applied)."""


@dataclass
class Unit:
    name: str                       # the layer (or, for attention, its parent + '.attention')
    layers: list                    # qualified names of its Mesa layers
    block: str | None               # the checkpointable block holding it
    elements: int = 0               # elements it stores (quantization work)
    bytes: dict = field(default_factory=dict)   # bits -> bytes at the probe batch
    err: dict = field(default_factory=dict)     # bits -> relative error proxy


@dataclass
class BlockInfo:
    name: str
    in_bytes: int = 0               # its inputs' bytes (kept by an exact checkpoint)
    in_err8: float = 0.0            # error proxy of keeping them at 8 bits
    head_bytes: int = 0             # the prefix-token rows a packed checkpoint keeps exactly
    fwd_time: float = 0.0           # seconds: its forward at the probe batch


@dataclass
class Profile:
    units: list
    blocks: list
    fixed_bytes: int                # bytes no option changes (stem, parameters-free ops, ...)
    probe_batch: int
    alpha: float                    # seconds per quantized element (probe)
    step_time: float                # exact step seconds (probe)
    packed_ckpt: bool               # mesa_ops.checkpoint.checkpoint_block available


@dataclass
class Plan:
    bits: dict                      # unit name -> 0/8/4/2
    ckpt: dict                      # block name -> None / 'exact' / 'packed8'
    batch_size: int
    budget: int
    est_bytes: int
    est_error: float                # sqrt(sum of squared proxies)
    est_extra_time: float           # seconds per step, at batch_size
    est_step_time: float
    layer_bits: dict = field(default_factory=dict)   # Mesa layer name -> bits
    measured: dict = field(default_factory=dict)     # filled by verify()
    est_recompute: int = 0          # of est_bytes: the recomputation transient (the largest
    #                                 checkpointed block's own bytes, re-created in backward)


# ---- measuring -------------------------------------------------------------------------------
def _packed_ckpt():
    try:
        return importlib.import_module("mesa_ops.checkpoint").checkpoint_block
    except ModuleNotFoundError as exc:
        if exc.name != "mesa_ops.checkpoint":
            raise
        return None


def _blocks(model: nn.Module) -> dict[str, nn.Module]:
    out = {}

    def visit(prefix, module):
        for name, child in module.named_children():
            full = f"{prefix}.{name}" if prefix else name
            if type(child).__name__.endswith("Block") or getattr(child, "_mesa_ckpt", False):
                out[full] = child
            else:
                visit(full, child)
    visit("", model)
    return out


def _units(model: nn.Module, blocks: dict) -> list[Unit]:
    units: dict[str, Unit] = {}
    for name, m in mesa_layers(model):
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        key = f"{parent}.attention" if isinstance(m, _ATTN) else name
        blk = next((b for b in blocks if name.startswith(b + ".")), None)
        units.setdefault(key, Unit(key, [], blk)).layers.append(name)
    return list(units.values())


def _in_unit(module_name: str, u: Unit) -> bool:
    """Whether bytes saved by ``module_name`` belong to unit ``u`` (an attention unit also owns
    what its parent module saves itself: timm's exact SDPA call when Mesa is off)."""
    if u.name.endswith(".attention") and module_name == u.name[:-len(".attention")]:
        return True
    return any(module_name == n or module_name.startswith(n + ".") for n in u.layers)


def _set(model: nn.Module, layer_bits: dict) -> None:
    """Enable each Mesa layer at its bits (0: off); layers not named are switched off."""
    for name, m in mesa_layers(model):
        b = layer_bits.get(name, 0)
        m.enable = b > 0
        if b:
            m.bits = b


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).float().norm() / a.float().norm().clamp_min(1e-30))


def _roundtrip(quantizer, x: torch.Tensor, bits: int) -> torch.Tensor:
    q = copy.deepcopy(quantizer)
    q.bits = bits
    q.iteration.zero_()  # the probe batch's own range
    return q.quantize(x.detach()).dequantize()


def _input_err8(x: torch.Tensor, prefix: int = 0) -> float:
    """Error proxy of a packed 8-bit checkpoint input (the quantizer checkpoint_block uses, with
    the block's ``prefix`` token rows kept exactly)."""
    mod = importlib.import_module("mesa_ops.checkpoint") if _packed_ckpt() else None
    q = mod.input_quantizer(x, 8) if mod is not None and x.is_floating_point() else Quantizer(1)
    q.bits = 8
    q.prefix_tokens = prefix
    return _rel(x, q.quantize(x).dequantize())


def _head_bytes(x: torch.Tensor, prefix: int) -> int:
    """Bytes of the ``prefix`` rows (dim -2) a packed copy of ``x`` keeps exactly (QTensor.head)."""
    if not prefix or x.dim() < 3 or x.shape[-2] <= prefix:
        return 0
    return x.numel() // x.shape[-2] * prefix * x.element_size()


def _ln_normed(x):
    return torch.nn.functional.layer_norm(x.float(), x.shape[-1:])


def _unit_error(model: nn.Module, unit: Unit, captured: dict, bits: int) -> float:
    errs = []
    for name in unit.layers:
        m = model.get_submodule(name)
        args, out = captured.get(name, ((), None))
        if isinstance(m, L.ReLU) or not args:
            continue  # ReLU keeps a 1-bit mask: exact
        if isinstance(m, SDPA):
            for qn, t in zip(QUANTIZERS, (args[0], args[1], args[2], out)):
                if isinstance(t, torch.Tensor):
                    t4 = t if t.dim() == 4 else \
                        t.view(t.shape[0], t.shape[1], m.quant_groups, -1).transpose(1, 2)
                    flat = t4.transpose(1, 2).reshape(t4.shape[0], t4.shape[2], -1)  # (B, L, H*D)
                    errs.append(_rel(flat, _roundtrip(getattr(m, qn), flat, bits)))
        elif isinstance(m, L.MatMul):
            errs += [_rel(args[0], _roundtrip(m.quant1, args[0], bits)),
                     _rel(args[1], _roundtrip(m.quant2, args[1], bits))]
        elif isinstance(m, L.Softmax):
            errs.append(_rel(out, _roundtrip(m.quant2, out, bits)))
        elif isinstance(m, L.LayerNorm):
            x = args[0]
            errs.append(_rel(_ln_normed(x), _ln_normed(_roundtrip(m, x, bits))))
        else:
            errs.append(_rel(args[0], _roundtrip(m, args[0], bits)))
    return max(errs, default=0.0)


def _step_time(model, x, steps: int) -> float:
    ts = [train_step_time(model, (x,)) for _ in range(steps + 1)]
    model.zero_grad(set_to_none=True)
    return statistics.median(ts[1:])


def _capture(model, x, units_on: dict, blocks: dict, timing: bool):
    """One training forward with the given layer bits; per Mesa layer its (inputs, output), per
    block its input bytes and error proxy at 8 bits (or, with ``timing``, its forward time)."""
    _set(model, units_on)
    captured, binfo, t0, stem, hooks = {}, {n: BlockInfo(n) for n in blocks}, {}, [], []
    for name, m in mesa_layers(model):
        def post(mod, args, out, name=name):
            if isinstance(mod, L.Conv2d) and args and args[0] is x:
                stem.append(name)
            if not timing:
                captured[name] = (tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args),
                                  out.detach() if isinstance(out, torch.Tensor) else None)
        hooks.append(m.register_forward_hook(post))
    for name, b in blocks.items():
        def bpre(mod, args, name=name):
            ts = [a.detach() for a in args if isinstance(a, torch.Tensor)]
            binfo[name].in_bytes = sum(a.untyped_storage().nbytes() for a in ts)
            prefix = site_prefix(mod)
            if ts:
                binfo[name].head_bytes = _head_bytes(ts[0], prefix)
            if ts and not timing:
                binfo[name].in_err8 = _input_err8(ts[0], prefix)
            t0[name] = time.perf_counter()

        def bpost(mod, args, out, name=name):
            binfo[name].fwd_time = time.perf_counter() - t0[name]
        hooks += [b.register_forward_pre_hook(bpre), b.register_forward_hook(bpost)]
    try:
        with torch.enable_grad():
            out = model(x)
        del out
    finally:
        for h in hooks:
            h.remove()
    return captured, binfo, stem


def measure(model: nn.Module, x: torch.Tensor, time_steps: int = 2) -> Profile:
    """Profile ``model`` (Mesa layers in place: build it with ``mesa_ops.compress`` or this repo's
    models) on the probe batch ``x`` (B, 3, H, W): per unit bytes at each bits, error proxies,
    block inputs and forward times, the quantization time per element."""
    model.train()
    blocks = _blocks(model)
    units = _units(model, blocks)
    all8 = {n: 8 for u in units for n in u.layers}
    captured, binfo8, stem = _capture(model, x, all8, blocks, timing=False)  # attention runs its op
    units = [u for u in units if not set(u.layers) & set(stem)]
    _, binfo, _ = _capture(model, x, {}, blocks, timing=True)
    for name, b in binfo.items():
        b.in_err8 = binfo8[name].in_err8
    # bytes per unit: exact (all off), and at each bits with every other unit exact (two runs,
    # alternate units on), so that no unit's bytes lean on a neighbour's packed copy
    rep = audit(model, x, verbose=False)
    per = rep.by_module()
    for u in units:
        u.bytes[0] = sum(v for k, v in per.items() if _in_unit(k, u))
    fixed = rep.total_bytes - sum(u.bytes[0] for u in units)
    for b in BITS[1:]:
        for parity in (0, 1):
            part = units[parity::2]
            _set(model, {n: b for u in part for n in u.layers})
            per = audit(model, x, verbose=False).by_module()
            for u in units:
                got = sum(v for k, v in per.items() if _in_unit(k, u))
                if u in part:
                    u.bytes[b] = got
                else:  # exact next to packed neighbours: a tensor shared with an exact neighbour
                    u.bytes[0] = max(u.bytes[0], got)  # (e.g. SDPA's output, proj's input) is its own
    for u in units:
        u.err = {b: (_unit_error(model, u, captured, b) if b else 0.0) for b in BITS}
        u.elements = sum(_numel_saved(model.get_submodule(n), captured.get(n)) for n in u.layers)
    del captured
    # time: exact vs every unit at 8 bits
    _set(model, {})
    t_exact = _step_time(model, x, time_steps)
    _set(model, {n: 8 for u in units for n in u.layers})
    t_mesa = _step_time(model, x, time_steps)
    _set(model, {})
    elements = sum(u.elements for u in units) or 1
    return Profile(units, list(binfo.values()), int(fixed), int(x.shape[0]),
                   max(t_mesa - t_exact, 0.0) / elements, t_exact, _packed_ckpt() is not None)


def _numel_saved(m, cap) -> int:
    if cap is None:
        return 0
    args, out = cap
    if isinstance(m, SDPA):
        qkv = sum(a.numel() for a in args[:3] if isinstance(a, torch.Tensor))
        return qkv + (out.numel() if out is not None else 0)
    if isinstance(m, L.Softmax):
        return out.numel() if out is not None else 0
    return sum(a.numel() for a in args if isinstance(a, torch.Tensor))


# ---- planning --------------------------------------------------------------------------------
class _State:
    """A configuration. ``cost`` = (bytes, error, extra seconds) at the target batch, bytes
    without the recomputation transient (the caller reserves it) and ``reserve``: the largest
    own bytes of a checkpointed block."""

    def __init__(self, prof: Profile, scale: float, cap: int | None = None):
        self.p, self.s = prof, scale
        self.bits = {u.name: 0 for u in prof.units}
        self.ckpt = {b.name: None for b in prof.blocks}
        self.units_of = {b.name: [u for u in prof.units if u.block == b.name] for b in prof.blocks}
        self.blk = {b.name: b for b in prof.blocks}
        self.cap = cap  # blocks whose exact own bytes exceed this cannot be checkpointed

    def copy(self):
        c = copy.copy(self)
        c.bits, c.ckpt = dict(self.bits), dict(self.ckpt)
        return c

    def own_bytes(self, block: str, exact: bool = False) -> int:
        return sum(u.bytes[0 if exact else self.bits[u.name]] for u in self.units_of[block])

    def cost(self):
        by, err2, t = self.p.fixed_bytes, 0.0, 0.0
        for u in self.p.units:
            b = self.bits[u.name]
            err2 += u.err[b] ** 2
            if b:
                t += self.p.alpha * u.elements
            if u.block is None or self.ckpt[u.block] is None:
                by += u.bytes[b]
        for name, mode in self.ckpt.items():
            if mode is None:
                continue
            blk = self.blk[name]
            by += blk.in_bytes if mode == "exact" else _packed_bytes(blk)
            if mode == "packed8":
                err2 += blk.in_err8 ** 2
            t += blk.fwd_time
        return by * self.s, math.sqrt(err2), t * self.s

    def reserve(self) -> int:
        return max((self.own_bytes(n) for n, m in self.ckpt.items() if m), default=0) * self.s

    def moves(self):
        """(move, bytes saved, added squared error, added seconds) of each possible step."""
        p = self.p
        for u in p.units:
            b = self.bits[u.name]
            if b != 2 and (u.block is None or self.ckpt[u.block] is None):
                nb = BITS[BITS.index(b) + 1]
                yield (("unit", u.name, nb), (u.bytes[b] - u.bytes[nb]) * self.s,
                       u.err[nb] ** 2 - u.err[b] ** 2, (p.alpha * u.elements if b == 0 else 0.0) * self.s)
        for name, mode in self.ckpt.items():
            blk = self.blk[name]
            if mode is None and self.cap is not None and self.own_bytes(name, exact=True) <= self.cap:
                inner = self.units_of[name]
                yield (("ckpt", name, "exact"), (self.own_bytes(name) - blk.in_bytes) * self.s,
                       -sum(u.err[self.bits[u.name]] ** 2 for u in inner),
                       (blk.fwd_time - sum(p.alpha * u.elements for u in inner if self.bits[u.name]))
                       * self.s)
            elif mode == "exact" and p.packed_ckpt:
                yield (("ckpt", name, "packed8"), (blk.in_bytes - _packed_bytes(blk)) * self.s,
                       blk.in_err8 ** 2, 0.0)

    def apply(self, move):
        kind, name, val = move
        if kind == "unit":
            self.bits[name] = val
        else:
            if self.ckpt[name] is None:
                for u in self.units_of[name]:
                    self.bits[u.name] = 0  # recomputed exactly
            self.ckpt[name] = val


def _packed_bytes(blk: BlockInfo) -> int:
    # 8-bit codes of an fp32 input + per-group step/shift + the prefix-token rows kept exactly
    return blk.in_bytes // 4 + 1024 + blk.head_bytes


def _greedy(prof: Profile, scale: float, budget: int, cap: int | None):
    """Least-error-per-byte greedy within ``budget`` minus the recomputation reserve ``cap``."""
    st = _State(prof, scale, cap)
    limit = budget - (cap or 0) * scale
    while True:
        by, err, tm = st.cost()
        if by <= limit:
            return st
        best = None
        for mv, saved, derr2, dt in st.moves():
            if saved <= 0:
                continue
            key = (derr2 / saved, dt / saved)
            if best is None or key < best[0]:
                best = (key, mv)
        if best is None:
            return None
        st.apply(best[1])


def make_plan(prof: Profile, budget: int, batch_size: int, checkpointing: bool = True) -> Plan:
    """The configuration within ``budget`` bytes (saved activations at ``batch_size``) with the
    least error proxy, then the least extra time (see the module docstring). The recomputation
    transient is handled by trying each cap on the checkpointable blocks' own bytes (none, and
    each distinct block size) and keeping the best plan. ``checkpointing=False``: bits only."""
    scale = batch_size / prof.probe_batch
    probe = _State(prof, scale)
    sizes = sorted({probe.own_bytes(b.name, exact=True) for b in prof.blocks})
    caps = [None] + (sizes if checkpointing else [])
    found = []
    for cap in caps:
        st = _greedy(prof, scale, budget, cap)
        if st is not None:
            by, err, tm = st.cost()
            found.append(((round(err, 9), tm), st))
    if not found:
        low = _State(prof, scale, 0)
        for u in prof.units:
            low.bits[u.name] = 2
        smallest = low.cost()[0]
        biggest = sorted(prof.units, key=lambda u: -u.bytes[2])[:3]
        raise PlanError(
            f"budget {format_bytes(budget)} ({budget / 1e9:g} GB) is below the smallest configuration "
            f"the planner can reach at batch {batch_size} (every layer at 2 bits: "
            f"{format_bytes(smallest)}; checkpointing does not get below it either); bytes no option "
            f"reduces: {format_bytes(prof.fixed_bytes * scale)}; largest units at 2 bits: "
            + ", ".join(f"{u.name} {format_bytes(u.bytes[2] * scale)}" for u in biggest)
            + ". Lower the batch size or the input size, or raise the budget.")
    _, st = min(found, key=lambda f: f[0])
    by, err, tm = st.cost()
    layer_bits = {n: st.bits[u.name] for u in prof.units for n in u.layers}
    return Plan(dict(st.bits), dict(st.ckpt), batch_size, int(budget), int(by + st.reserve()), err, tm,
                prof.step_time * scale + tm, layer_bits, est_recompute=int(st.reserve()))


def largest_batch(prof: Profile, budget: int, limit: int, checkpointing: bool = True) -> Plan:
    """The plan for the largest batch in 1..``limit`` that some configuration fits in ``budget``
    (bytes scale linearly with the batch, so the batches that fit are 1..B: bisection over
    :func:`make_plan`). Raises :class:`PlanError` when not even batch 1 fits."""
    lo = make_plan(prof, budget, 1, checkpointing)  # raises when nothing fits
    hi = limit + 1
    b = 1
    while hi - b > 1:
        mid = (b + hi) // 2
        try:
            lo = make_plan(prof, budget, mid, checkpointing)
            b = mid
        except PlanError:
            hi = mid
    return lo if lo.batch_size == b else make_plan(prof, budget, b, checkpointing)


# ---- applying and writing --------------------------------------------------------------------
class _CheckpointedMixin:
    """Put in front of a block's class by :func:`checkpoint_blocks`: its forward runs under
    activation checkpointing (exact: torch.utils.checkpoint non-reentrant; packed8: the block's
    input kept at 8 bits by mesa_ops.checkpoint.checkpoint_block) while training with grad."""
    _mesa_ckpt = True

    def forward(self, *args, **kwargs):
        base = super().forward
        if not (self.training and torch.is_grad_enabled()) or self.mesa_ckpt_mode is None:
            return base(*args, **kwargs)
        if self.mesa_ckpt_mode == "exact":
            return torch.utils.checkpoint.checkpoint(base, *args, use_reentrant=False, **kwargs)
        fn = _packed_ckpt()
        if fn is None:
            raise PlanError("packed checkpointing needs mesa_ops.checkpoint.checkpoint_block")
        return fn(_Forward(self, type(self).__mro__[2]), *args, bits=8, **kwargs)


class _Forward(nn.Module):
    """The block's own forward as a module (for checkpoint_block), not registered in the model."""

    def __init__(self, block, base):
        super().__init__()
        object.__setattr__(self, "_block", block)
        object.__setattr__(self, "_base", base)
        self.training = block.training

    def parameters(self, recurse: bool = True):
        return self._block.parameters(recurse)

    def forward(self, *args, **kwargs):
        return self._base.forward(self._block, *args, **kwargs)


_CKPT_CLASSES: dict = {}


def checkpoint_blocks(model: nn.Module, modes: dict) -> None:
    """Checkpoint the named blocks of ``model`` ({name: 'exact' / 'packed8' / None}) in place;
    parameter names and the state dict are unchanged."""
    for name, mode in modes.items():
        block = model.get_submodule(name)
        cls = type(block)
        if not isinstance(block, _CheckpointedMixin):
            if cls not in _CKPT_CLASSES:
                _CKPT_CLASSES[cls] = type(f"Checkpointed{cls.__name__}", (_CheckpointedMixin, cls),
                                          {"__module__": __name__})
            block.__class__ = _CKPT_CLASSES[cls]
        if mode not in (None, "exact", "packed8"):
            raise PlanError(f"checkpoint mode of {name!r} must be None, 'exact' or 'packed8', got {mode!r}")
        block.mesa_ckpt_mode = mode


PLAN_MARK = "# mesa-plan: "  # the header line holding the plan's figures as JSON


def _native(model: nn.Module) -> bool:
    """This repo's models run each block through ``run_block``, which reads a policy file's
    per-block checkpoint choice (``block.mesa_checkpoint``)."""
    return hasattr(model, "set_grad_checkpointing") and hasattr(model, "checkpointed")


def _layer_counts(model: nn.Module) -> dict:
    counts: dict = {}
    for _, m in mesa_layers(model):
        counts[m.tag] = counts.get(m.tag, 0) + 1
    return counts


def write_plan(plan: Plan, model: nn.Module, path: str, header: str = "") -> str:
    """Write the plan as one policy file: per tag, ``by_index`` blocks of the layers at each
    bits, and an ``on checkpoint:`` section (the checkpointed blocks, by index over the '*Block'
    modules; ``bits: 8`` for a packed input). ``--ms-policy`` / ``deploy_on_init`` /
    ``models.create_model(ms_policy=path)`` apply both on this repo's models; ``tools/train.py
    --ms-plan`` also compares the predicted saved bytes with the measured ones. The first lines
    are comments; one (``# mesa-plan: {...}``) holds the figures as JSON (:func:`read_plan`)."""
    assign_indices(model)
    by_tag: dict[str, dict[int, list]] = {}
    for name, m in mesa_layers(model):
        by_tag.setdefault(m.tag, {}).setdefault(plan.layer_bits.get(name, 0), []).append(m.index)
    names = list(_blocks(model))
    ck = {n: m for n, m in plan.ckpt.items() if m}
    info = {k: v for k, v in asdict(plan).items() if k not in ("bits", "layer_bits")}
    info.update(ckpt=ck, header=header, blocks=len(names), layers=_layer_counts(model),
                layers_on=sum(1 for b in plan.layer_bits.values() if b))
    lines = [f"# Mesa memory plan (mesa_ops.planner){': ' + header if header else ''}",
             f"# batch {plan.batch_size}, budget {plan.budget / 1e9:g} GB: estimated saved "
             f"{format_bytes(plan.est_bytes)}, error proxy {plan.est_error:.4f}, extra time "
             f"{plan.est_extra_time:.3f} s/step",
             f"# checkpointed blocks: {' '.join(f'{n}={m}' for n, m in ck.items()) or 'none'}",
             PLAN_MARK + json.dumps(info, sort_keys=True), ""]
    for tag in TAGS:
        if tag not in by_tag:
            continue
        lines += [f"on {tag}:", "    by_index: all", "    enable: False"]
        for b in (8, 4, 2):
            idx = sorted(by_tag[tag].get(b, []))
            if idx:
                lines += [f"    by_index: {' '.join(map(str, idx))}", "    enable: True", f"    bits: {b}"]
        lines.append("")
    if ck:
        lines += ["on checkpoint:", "    by_index: all", "    enable: False"]
        for mode, bits in (("exact", None), ("packed8", 8)):
            idx = [names.index(n) for n, m in ck.items() if m == mode]
            if idx:
                lines += [f"    by_index: {' '.join(map(str, sorted(idx)))}", "    enable: True"]
                lines += [f"    bits: {bits}"] if bits else []
        lines.append("")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    return path


def read_plan(path: str) -> dict | None:
    """The figures of a plan file (:func:`write_plan`): ``batch_size``, ``budget``, ``est_bytes``,
    ``ckpt`` ({block name: 'exact' / 'packed8'}), ``blocks``, ``layers`` (per tag), ... ; None for
    a policy file that is not a plan."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith(PLAN_MARK):
                return json.loads(line[len(PLAN_MARK):])
            if line.strip() and not line.startswith("#"):
                return None
    return None


def check_plan(model: nn.Module, info: dict, path: str) -> None:
    """A plan fits ``model`` when the model has the plan's blocks and Mesa layers per tag; else
    :class:`PlanError` (one line: a plan of another model or depth would set the wrong layers)."""
    names = list(_blocks(model))
    counts = _layer_counts(model)
    if info.get("blocks") != len(names) or info.get("layers") != counts or \
            any(n not in names for n in info.get("ckpt", {})):
        raise PlanError(f"{path}: a plan for {info.get('header') or 'another model'} with {info.get('blocks')} "
                        f"blocks and Mesa layers {info.get('layers')}; this model has {len(names)} blocks and "
                        f"{counts} (make the plan for this model: tools/plan_memory.py with the same --model, "
                        "--model-kwargs and --input-size)")


def apply_plan(model: nn.Module, path: str, verbose=None) -> dict:
    """Apply a plan file (:func:`write_plan`) or any policy file: the bits through
    ``deploy_on_init(path)``, with the checkpointed blocks (the file's ``on checkpoint:``
    section; on models without per-block checkpointing of their own the blocks' class is
    swapped, :func:`checkpoint_blocks`, which keeps the module and state-dict names). A plan is
    checked against the model first (:func:`check_plan`). Returns {block name: mode} of the
    checkpointed blocks."""
    verbose = verbose or (lambda *a: None)
    info = read_plan(path)
    if info is not None:
        check_plan(model, info, path)
    if info is None or _native(model) or not info.get("ckpt"):
        deploy_on_init(model, path, verbose=verbose)
        return dict(info.get("ckpt", {})) if info else {}
    import tempfile

    with open(path, encoding="utf-8") as f:
        text = f.read()
    with tempfile.TemporaryDirectory() as d:  # the bits part alone; the blocks by class swap
        bits_only = os.path.join(d, os.path.basename(path))
        with open(bits_only, "w", encoding="utf-8") as f:
            f.write(text.split("\non checkpoint:", 1)[0])
        deploy_on_init(model, bits_only, verbose=verbose)
    checkpoint_blocks(model, info["ckpt"])
    return dict(info["ckpt"])


def checkpointed_blocks(model: nn.Module) -> list[str]:
    """Names of the blocks that run under (compressed) checkpointing: chosen by a policy file
    (``mesa_checkpoint``), wrapped in ``mesa_ops.checkpoint.CheckpointedBlock``, or by
    :func:`checkpoint_blocks`."""
    out = []
    for name, m in model.named_modules():
        mc = getattr(m, "mesa_checkpoint", None)
        if (mc is not None and mc[0]) or getattr(m, "mesa_ckpt_mode", None) or \
                type(m).__name__ == "CheckpointedBlock":
            out.append(name)
    return out


def verify(model: nn.Module, plan: Plan, x: torch.Tensor, grad_error: bool = True,
           draws: int = 4) -> dict:
    """Measure the planned configuration on ``x``: saved bytes (audit; scaled to the plan's batch
    when ``x`` is smaller) and, with ``grad_error``, its gradient against exact training (same
    batch; loss: sum of squared outputs) over ``draws`` stochastic-rounding draws
    (:func:`mesa_ops.fidelity.grad_fidelity`, every parameter): ``grad_rel_error`` the relative
    L2 error of one step's gradient, ``grad_bias`` (+- ``grad_bias_se``) the part of it that
    averaging over steps does not remove, ``grad_noise`` the part it does."""
    from .fidelity import grad_fidelity

    _set(model, plan.layer_bits)
    checkpoint_blocks(model, plan.ckpt)
    rep = audit(model, x, verbose=False)
    scale = plan.batch_size / x.shape[0]
    out = {"saved_bytes": int(rep.total_bytes * scale), "measured_batch": int(x.shape[0]),
           "scaled": scale != 1}
    if grad_error:
        @contextlib.contextmanager
        def exact(m):
            _set(m, {})
            checkpoint_blocks(m, {n: None for n in plan.ckpt})
            try:
                yield m
            finally:
                _set(m, plan.layer_bits)
                checkpoint_blocks(m, plan.ckpt)

        fid = grad_fidelity(model, x, None, draws=draws, ks=[1, draws], exact=exact,
                            check_enabled=False)["groups"]["all"]
        out.update(grad_rel_error=fid["single"], grad_bias=fid["bias"], grad_bias_se=fid["bias_se"],
                   grad_noise=fid["noise"], grad_draws=draws)
    plan.measured = out
    return out


def _grads(model, x):
    model.zero_grad(set_to_none=True)
    state = torch.random.get_rng_state()
    out = model.train()(x)
    torch.random.set_rng_state(state)
    (out[0] if isinstance(out, tuple) else out).float().square().sum().backward()
    g = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return g


def summary(plan: Plan, prof: Profile, header: str = "") -> str:
    """The plan as text: counts per bits, checkpointed blocks, estimates and measurements."""
    from collections import Counter
    c = Counter(plan.bits.values())
    ck = Counter(m for m in plan.ckpt.values() if m)
    m = plan.measured
    lines = [f"# plan{' for ' + header if header else ''}: batch {plan.batch_size}, budget "
             f"{plan.budget / 1e9:g} GB ({format_bytes(plan.budget)})",
             f"units ({len(plan.bits)}): " + ", ".join(f"{'exact' if b == 0 else f'{b}-bit'} {c[b]}"
                                                      for b in BITS if c[b]),
             f"blocks ({len(plan.ckpt)}): " + (", ".join(f"{k} {v}" for k, v in ck.items()) + " checkpointed"
                                               if ck else "none checkpointed"),
             f"estimated: saved {format_bytes(plan.est_bytes)}, error proxy {plan.est_error:.4f}, "
             f"step {plan.est_step_time:.2f} s (+{plan.est_extra_time:.2f} s over exact "
             f"{prof.step_time * plan.batch_size / prof.probe_batch:.2f} s)"]
    if m:
        lines.append(f"measured: saved {format_bytes(m['saved_bytes'])}"
                     + (f" (at batch {m['measured_batch']}, "
                        f"scaled x{plan.batch_size / m['measured_batch']:g})"
                        if m.get("scaled") else "")
                     + (f", relative gradient error vs exact {m['grad_rel_error']:.4f} per step"
                        f" (bias {m['grad_bias']:.4f} +- {m['grad_bias_se']:.4f}, noise "
                        f"{m['grad_noise']:.4f}; {m['grad_draws']} draws)"
                        if "grad_rel_error" in m else ""))
    return "\n".join(lines)
