"""Measuring a model for the memory-budget planner (:mod:`mesa_ops.planner`): its units (Mesa
layers; an attention core is one) and checkpointable blocks, and per option the saved bytes, an
error proxy and the time, as a :class:`Profile`. What is measured and what is estimated: the
planner's module documentation."""
from __future__ import annotations

import copy
import importlib
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from . import layers as L
from .attention import QUANTIZERS, SDPA
from .audit import audit
from .bench import sync, time_in_turn, train_step_time
from .checkpoint import site_prefix
from .policy import mesa_layers
from .quant import Quantizer, prefix_rows

__all__ = ["PlanError", "Unit", "BlockInfo", "Profile", "measure", "unit_layers", "checkpoint_blocks", "BITS"]

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
    reads: str | None = None        # the unit whose packed copy it reads at equal bits
    shared: dict = field(default_factory=dict)  # bits -> its bytes when ``reads`` is at those bits


@dataclass
class BlockInfo:
    name: str
    in_bytes: int = 0               # its inputs' bytes (kept by an exact checkpoint)
    in_err8: float = 0.0            # error proxy of keeping them at 8 bits
    head_bytes: int = 0             # the prefix-token rows a packed checkpoint keeps exactly
    fwd_time: float = 0.0           # seconds: its forward at the probe batch (median of 3)
    in_elements: int = 0            # its inputs' elements (what a packed checkpoint quantizes)
    recompute_time: float = 0.0     # seconds its checkpointing adds to a step (probe): the step
    #                                 with every block checkpointed minus exact's, shared out by
    #                                 the blocks' forward times


@dataclass
class Profile:
    units: list
    blocks: list
    fixed_bytes: int                # bytes no option changes (stem, parameters-free ops, ...)
    probe_batch: int
    alpha: float                    # seconds per quantized element at 8 bits (probe)
    step_time: float                # exact step seconds (probe)
    packed_ckpt: bool               # mesa_ops.checkpoint.checkpoint_block available
    alphas: dict = field(default_factory=dict)  # bits -> seconds per element kept at those bits

    def cost_per_element(self, bits: int) -> float:
        """Seconds per element a unit keeps at ``bits`` (0: exact, none); ``alpha`` where the
        profile has no figure for those bits."""
        return 0.0 if not bits else self.alphas.get(bits, self.alpha)


# ---- checkpointing a plan's blocks ------------------------------------------------------------
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


def _is_stem(module: nn.Module, args: tuple, x: torch.Tensor) -> bool:
    """A Conv2d reading the image ``x`` itself: the stem, which stays exact (the caller holds
    the image anyway)."""
    return isinstance(module, L.Conv2d) and bool(args) and args[0] is x


def _without_stem(units: list, stem: list) -> list:
    return [u for u in units if not set(u.layers) & set(stem)]


def unit_layers(model: nn.Module, x: torch.Tensor) -> list[str]:
    """The Mesa layers of the units :func:`measure` plans (every unit but the stem's), from one
    no-grad forward of ``x`` (B, 3, H, W) instead of the whole profile."""
    stem, hooks = [], []
    for name, m in mesa_layers(model):
        if isinstance(m, L.Conv2d):
            hooks.append(m.register_forward_hook(
                lambda mod, args, out, name=name: stem.append(name) if _is_stem(mod, args, x) else None))
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in hooks:
            h.remove()
    return [n for u in _without_stem(_units(model, _blocks(model)), stem) for n in u.layers]


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
    rows = prefix_rows(x.shape, prefix)
    return x.numel() // x.shape[-2] * rows * x.element_size() if rows else 0


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


_UNSET = object()


def _step_times(model, x, configs: dict, steps: int, blocks: dict) -> dict:
    """{key: median step seconds} of ``model`` with each of ``configs`` ({key: layer bits})
    set in turn before its step, and ``'ckpt'``: exact with every one of ``blocks`` checkpointed
    as a plan does it (``checkpoint_blocks``; one warm-up step each; in turn, so that
    load from other processes hits them alike); the model is left exact, its blocks' classes
    as they were."""
    def stepper(bits, ckpt=None):
        def step():
            _set(model, bits)
            checkpoint_blocks(model, {n: ckpt for n in blocks})
            return train_step_time(model, (x,), device=x.device)
        return step

    steppers = {k: stepper(v) for k, v in configs.items()}
    if blocks:
        steppers["ckpt"] = stepper({}, ckpt="exact")
    before = {n: (type(b), b.__dict__.get("mesa_ckpt_mode", _UNSET)) for n, b in blocks.items()}
    try:
        ts = time_in_turn(steppers, 1, max(steps, 1), device=x.device)
    finally:
        _set(model, {})
        model.zero_grad(set_to_none=True)
        for n, b in blocks.items():
            b.__class__, mode = before[n]
            b.__dict__.pop("mesa_ckpt_mode", None)
            if mode is not _UNSET:
                b.mesa_ckpt_mode = mode
    out = {k: statistics.median(v) for k, v in ts.items()}
    out.setdefault("ckpt", out[0])
    return out


def _capture(model, x, units_on: dict, blocks: dict, timing: bool):
    """One training forward with the given layer bits; per Mesa layer its (inputs, output), per
    block its input bytes and error proxy at 8 bits (or, with ``timing``, its forward time)."""
    _set(model, units_on)
    captured, binfo, t0, stem, hooks = {}, {n: BlockInfo(n) for n in blocks}, {}, [], []
    for name, m in mesa_layers(model):
        def post(mod, args, out, name=name):
            if _is_stem(mod, args, x):
                stem.append(name)
            if not timing:
                captured[name] = (tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args),
                                  out.detach() if isinstance(out, torch.Tensor) else None)
        hooks.append(m.register_forward_hook(post))
    for name, b in blocks.items():
        def bpre(mod, args, name=name):
            ts = [a.detach() for a in args if isinstance(a, torch.Tensor)]
            binfo[name].in_bytes = sum(a.untyped_storage().nbytes() for a in ts)
            binfo[name].in_elements = sum(a.numel() for a in ts)
            prefix = site_prefix(mod)
            if ts:
                binfo[name].head_bytes = _head_bytes(ts[0], prefix)
            if ts and not timing:
                binfo[name].in_err8 = _input_err8(ts[0], prefix)
            sync(x.device)
            t0[name] = time.perf_counter()

        def bpost(mod, args, out, name=name):
            sync(x.device)
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


def measure(model: nn.Module, x: torch.Tensor, time_steps: int = 5) -> Profile:
    """Profile ``model`` (Mesa layers in place: build it with ``mesa_ops.compress`` or this repo's
    models) on the probe batch ``x`` (B, 3, H, W): per unit bytes at each bits, error proxies,
    block inputs and forward times (median of 3 forwards), the quantization time per element at
    each bits (``time_steps`` timed steps of each of exact and every unit at 8 / 4 / 2 bits,
    stepped in turn after one warm-up each). ``time_steps=0``: no steps are timed (a profile for
    bytes and errors only: its step times, per-element costs and recomputation times are 0, so
    ``make_plan(objective='time')`` has nothing to go by and the error objective breaks no tie by
    time; models.scale, which needs only whether a plan fits, uses it)."""
    model.train()
    blocks = _blocks(model)
    units = _units(model, blocks)
    all8 = {n: 8 for u in units for n in u.layers}
    captured, binfo8, stem = _capture(model, x, all8, blocks, timing=False)  # attention runs its op
    units = _without_stem(units, stem)
    timed = [_capture(model, x, {}, blocks, timing=True)[1] for _ in range(3)]
    binfo = timed[0]
    for name, b in binfo.items():
        b.in_err8 = binfo8[name].in_err8
        b.fwd_time = statistics.median(t[name].fwd_time for t in timed)
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
    _shared_copies(model, x, units)
    for u in units:
        u.err = {b: (_unit_error(model, u, captured, b) if b else 0.0) for b in BITS}
        u.elements = sum(_numel_saved(model.get_submodule(n), captured.get(n)) for n in u.layers)
    del captured
    # time: exact against every unit at 8, 4 and 2 bits and every block checkpointed, in turn
    configs = {b: {n: b for u in units for n in u.layers} for b in BITS}
    t = (_step_times(model, x, configs, time_steps, blocks) if time_steps > 0
         else dict.fromkeys([*configs, "ckpt"], 0.0))
    fwd = sum(b.fwd_time for b in binfo.values())
    for b in binfo.values():
        b.recompute_time = max(t["ckpt"] - t[0], 0.0) * (b.fwd_time / fwd if fwd > 0 else 1 / len(binfo))
    elements = sum(u.elements for u in units) or 1
    # fewer bits never cost less per element (the same range, rounding and draws, more packing):
    # a figure below the one at more bits is the timing's noise, which would buy error for nothing
    alphas, floor = {}, 0.0
    for b in BITS[1:]:
        floor = alphas[b] = max(floor, (t[b] - t[0]) / elements)
    return Profile(units, list(binfo.values()), int(fixed), int(x.shape[0]), alphas[8], t[0],
                   _packed_ckpt() is not None, alphas)


def _shared_copies(model: nn.Module, x: torch.Tensor, units: list) -> None:
    """``reads`` / ``shared`` of each unit: with every unit at the same bits a unit that stores
    less than alone reads a packed copy another unit saved first (a LayerNorm's x-hat that the
    next Linear restores its input from, GELU's input that fc2 reads through a table, the
    attention output that proj reads; the audit names the first saver of each storage saved
    again); its bytes then are what it stores beside that copy. One audit per bits."""
    seen, source = {}, {}
    for b in BITS[1:]:
        _set(model, {n: b for u in units for n in u.layers})
        rep = audit(model, x, verbose=False)
        per = rep.by_module()
        seen[b] = [sum(v for k, v in per.items() if _in_unit(k, u)) for u in units]
        for reader, first in rep.reused:
            r = next((u for u in units if _in_unit(reader, u)), None)
            f = next((u for u in units if _in_unit(first, u)), None)
            if r is not None and f is not None and r is not f:
                source.setdefault(r.name, f.name)
    _set(model, {})
    for i, u in enumerate(units):
        if u.name in source and any(seen[b][i] < u.bytes[b] for b in BITS[1:]):
            u.reads = source[u.name]
            u.shared = {b: min(seen[b][i], u.bytes[b]) for b in BITS[1:]}


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
