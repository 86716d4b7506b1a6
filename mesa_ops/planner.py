"""Memory-budget planner: per layer the bits (8/4/2/off), per block (compressed) checkpointing.

    profile = measure(model, probe_input)                  # bytes, error proxy, time per option
    plan = make_plan(profile, budget_bytes, batch_size)    # fits the budget: least error, then time
    plan = make_plan(profile, budget_bytes, batch_size, objective="time")  # the fastest that fits
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
  both: conservative). A unit that, with every unit at the same bits, stores less than alone
  reads a packed copy another unit saved first (a Linear its LayerNorm's x-hat, fc2 the GELU's
  input, the projection the attention's output: ``Unit.reads``, one more audit per bits);
  while the two are at equal bits it counts only what it stores beside that copy
  (``Unit.shared``), so a shared copy counts once. The plan assumes these add up and scale
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
* **Time** (estimated from measurements): a unit at b bits costs ``alphas[b]`` seconds per
  element it keeps, ``alphas[b]`` = (step time with every unit at b bits - exact step time) /
  elements, from the probe (exact and 8 / 4 / 2 bits stepped in turn; never below the figure at
  more bits, which a lower one could only be by the timing's noise); checkpointing a block
  costs its share of what checkpointing every block adds to the exact step (stepped in turn with
  the others; shared out by the blocks' forward times, medians of 3), a packed one also 8-bit
  quantization of its input.

Optimization: start exact; greedily apply the move (a unit one step lower: off->8->4->2, alone
or with the units reading its packed copy at its bits, as one; a block
to checkpointing, which also sets its units exact; an exact checkpoint to a packed one) with the
least added error per byte saved, ties by the least added time per byte, until the estimate fits
the budget; exact checkpointing adds no error, so it is preferred to quantization (least error
first, then time, as asked). ``objective='time'`` orders the moves by added time per byte
saved instead (ties by error), with units no lower than 8, 4 or 2 bits (three greedy runs, and
the error-ordered ones too), and keeps the fastest plan by the estimate; of the plans within
``time_tolerance`` (2% of the exact step) of it, the one with the least error (the estimate's
own noise is of that order: a plan is not packed at fewer bits for a gain below it). This is
what ``tools/frontier.py`` compares with PyTorch's own tools. The budget counts the
recomputation transient (above) unless ``recompute_transient=False``, which counts what
training saves in its forward only, the measure the frontier applies to every mode. No
configuration fits -> :class:`PlanError` naming the smallest reachable size and the bytes no option
can reduce.
"""
from __future__ import annotations

import contextlib
import copy
import json
import math
import os
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn

from .audit import audit, format_bytes
from .plan_measure import (BITS, BlockInfo, PlanError, Profile, Unit, _blocks, _set,
                           checkpoint_blocks, measure)
from .policy import TAGS, assign_indices, deploy_on_init, mesa_layers

__all__ = ["OBJECTIVES", "PlanError", "Unit", "BlockInfo", "Profile", "Plan", "measure", "make_plan", "write_plan",
           "read_plan", "check_plan", "apply_plan", "verify", "checkpoint_blocks", "checkpointed_blocks",
           "largest_batch", "BITS"]


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
    est_recompute: int = 0          # the recomputation transient (the largest checkpointed
    #                                 block's own bytes, re-created in backward): in est_bytes
    #                                 when counts_recompute
    counts_recompute: bool = True


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
        self.p_units = {u.name: u for u in prof.units}
        self.readers = {}  # unit -> the units that read its packed copy at equal bits
        for u in prof.units:
            if u.reads:
                self.readers.setdefault(u.reads, []).append(u)

    def copy(self):
        c = copy.copy(self)
        c.bits, c.ckpt = dict(self.bits), dict(self.ckpt)
        return c

    def unit_bytes(self, u, b: int) -> int:
        """``u``'s bytes at ``b`` bits: less where it reads another unit's packed copy at the same
        bits (``Unit.reads``; a copy two units share counts once)."""
        if b and u.reads and self.bits.get(u.reads) == b and b in u.shared:
            return u.shared[b]
        return u.bytes[b]

    def own_bytes(self, block: str, exact: bool = False) -> int:
        return sum(u.bytes[0] if exact else self.unit_bytes(u, self.bits[u.name]) for u in self.units_of[block])

    def _counted(self, u) -> bool:
        return u.block is None or self.ckpt[u.block] is None

    def _group(self, u) -> list:
        """``u`` and the units that read its packed copy at its bits: a shared copy can move as
        one (moved alone, either side would store a copy of its own and save nothing)."""
        b = self.bits[u.name]
        return [u] + [c for c in self.readers.get(u.name, ()) if self._counted(c) and self.bits[c.name] == b]

    def _move_saved(self, group: list, nb: int) -> int:
        """Bytes saved by moving the units of ``group`` to ``nb`` bits: theirs and their readers'."""
        hit = {c.name: c for g in group for c in [g, *self.readers.get(g.name, ())] if self._counted(c)}
        before = sum(self.unit_bytes(c, self.bits[c.name]) for c in hit.values())
        old = {g.name: self.bits[g.name] for g in group}
        for g in group:
            self.bits[g.name] = nb
        after = sum(self.unit_bytes(c, self.bits[c.name]) for c in hit.values())
        self.bits.update(old)
        return before - after

    def cost(self):
        by, err2, t = self.p.fixed_bytes, 0.0, 0.0
        for u in self.p.units:
            b = self.bits[u.name]
            err2 += u.err[b] ** 2
            t += self.p.cost_per_element(b) * u.elements
            if self._counted(u):
                by += self.unit_bytes(u, b)
        for name, mode in self.ckpt.items():
            if mode is None:
                continue
            blk = self.blk[name]
            by += blk.in_bytes if mode == "exact" else _packed_bytes(blk)
            if mode == "packed8":
                err2 += blk.in_err8 ** 2
                t += self.p.cost_per_element(8) * blk.in_elements
            t += blk.recompute_time
        return by * self.s, math.sqrt(err2), t * self.s

    def reserve(self) -> int:
        return max((self.own_bytes(n) for n, m in self.ckpt.items() if m), default=0) * self.s

    def moves(self):
        """(move, bytes saved, added squared error, added seconds) of each possible step."""
        p = self.p
        for u in p.units:
            b = self.bits[u.name]
            if b != 2 and self._counted(u):
                nb = BITS[BITS.index(b) + 1]
                dt = p.cost_per_element(nb) - p.cost_per_element(b)
                yield (("unit", u.name, nb), self._move_saved([u], nb) * self.s,
                       u.err[nb] ** 2 - u.err[b] ** 2, dt * u.elements * self.s)
                group = self._group(u)
                if len(group) > 1:  # with its readers at the same bits: the shared copy moves as one
                    yield (("units", u.name, nb), self._move_saved(group, nb) * self.s,
                           sum(g.err[nb] ** 2 - g.err[b] ** 2 for g in group),
                           dt * sum(g.elements for g in group) * self.s)
        for name, mode in self.ckpt.items():
            blk = self.blk[name]
            if mode is None and self.cap is not None and self.own_bytes(name, exact=True) <= self.cap:
                inner = self.units_of[name]
                # (its units go exact: a reader outside the block loses what it shared too)
                outside = [c for u in inner for c in self.readers.get(u.name, ())
                           if c.block != name and self._counted(c)]
                lost = sum(c.bytes[self.bits[c.name]] - self.unit_bytes(c, self.bits[c.name]) for c in outside)
                yield (("ckpt", name, "exact"), (self.own_bytes(name) - blk.in_bytes - lost) * self.s,
                       -sum(u.err[self.bits[u.name]] ** 2 for u in inner),
                       (blk.recompute_time - sum(p.cost_per_element(self.bits[u.name]) * u.elements for u in inner))
                       * self.s)
            elif mode == "exact" and p.packed_ckpt:
                yield (("ckpt", name, "packed8"), (blk.in_bytes - _packed_bytes(blk)) * self.s,
                       blk.in_err8 ** 2, p.cost_per_element(8) * blk.in_elements * self.s)

    def apply(self, move):
        kind, name, val = move
        if kind == "unit":
            self.bits[name] = val
        elif kind == "units":
            for g in self._group(self.p_units[name]):
                self.bits[g.name] = val
        else:
            if self.ckpt[name] is None:
                for u in self.units_of[name]:
                    self.bits[u.name] = 0  # recomputed exactly
            self.ckpt[name] = val


def _packed_bytes(blk: BlockInfo) -> int:
    # 8-bit codes of an fp32 input + per-group step/shift + the prefix-token rows kept exactly
    return blk.in_bytes // 4 + 1024 + blk.head_bytes


OBJECTIVES = ("error", "time")


def _greedy(prof: Profile, scale: float, budget: int, cap: int | None, objective: str = "error",
            lowest_bits: int = 2, reserve: bool = True):
    """Greedy within ``budget`` minus the recomputation reserve ``cap`` (with ``reserve``; else
    ``cap`` only limits which blocks may be checkpointed): the move with the least added error
    per byte saved, ties by time (``objective='error'``), or the least added time per byte, ties
    by error (``'time'``); units go no lower than ``lowest_bits``."""
    st = _State(prof, scale, cap)
    limit = budget - ((cap or 0) * scale if reserve else 0)
    while True:
        by, err, tm = st.cost()
        if by <= limit:
            return st
        best = None
        for mv, saved, derr2, dt in st.moves():
            if saved <= 0 or (mv[0] in ("unit", "units") and mv[2] < lowest_bits):
                continue
            key = (derr2 / saved, dt / saved) if objective == "error" else (dt / saved, derr2 / saved)
            if best is None or key < best[0]:
                best = (key, mv)
        if best is None:
            return None
        st.apply(best[1])


def make_plan(prof: Profile, budget: int, batch_size: int, checkpointing: bool = True,
              objective: str = "error", recompute_transient: bool = True,
              time_tolerance: float = 0.02) -> Plan:
    """The configuration within ``budget`` bytes (saved activations at ``batch_size``) with the
    least error proxy, then the least extra time (``objective='error'``, see the module
    docstring), or the fastest by the estimate (``'time'``: greedy runs ordered by time and by
    error, units no lower than 8, 4 or 2 bits, plus plain or packed checkpointing), and of the
    plans within ``time_tolerance`` x the exact step of the fastest the one with the least
    error. The recomputation transient is counted in the budget by trying each cap on the
    checkpointable blocks' own bytes (none, and each distinct block size) and keeping the best
    plan; ``recompute_transient=False`` counts what the forward saves only (every block may be
    checkpointed). ``checkpointing=False``: bits only."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective {objective!r}: expected one of {OBJECTIVES}")
    scale = batch_size / prof.probe_batch
    probe = _State(prof, scale)
    sizes = sorted({probe.own_bytes(b.name, exact=True) for b in prof.blocks})
    if not checkpointing:
        caps = [None]
    elif recompute_transient:
        caps = [None] + sizes
    else:  # bits only, or any block checkpointed (nothing reserved)
        caps = [None, max(sizes, default=0)]
    found = []
    # greedy is not optimal: for 'time' the time-ordered and the error-ordered runs, at each
    # lowest bits, and the fastest of all
    for lowest in ((8, 4, 2) if objective == "time" else (2,)):
        for order in ((objective,) if objective == "error" else ("time", "error")):
            for cap in caps:
                st = _greedy(prof, scale, budget, cap, order, lowest, recompute_transient)
                if st is not None:
                    by, err, tm = st.cost()
                    found.append(((round(err, 9), tm) if objective == "error" else (tm, round(err, 9)), st))
    if found and objective == "time":
        fastest = min(k[0] for k, _ in found)
        slack = time_tolerance * prof.step_time * scale
        found = [((k[1], k[0]), st) for k, st in found if k[0] <= fastest + slack]
    if not found:
        low = _State(prof, scale, 0)
        for u in prof.units:
            low.bits[u.name] = 2
        smallest = low.cost()[0]
        if checkpointing and prof.blocks:  # and every block checkpointed (packed where possible)
            for name in low.ckpt:
                low.apply(("ckpt", name, "exact"))
                if prof.packed_ckpt:
                    low.ckpt[name] = "packed8"
            for u in prof.units:
                low.bits[u.name] = 2 if low._counted(u) else 0
            ck = low.cost()[0] + (low.reserve() if recompute_transient else 0)
            how = (f"every layer at 2 bits: {format_bytes(smallest)}; every block checkpointed"
                   f"{' with its recomputation transient' if recompute_transient else ''}: {format_bytes(ck)}")
            smallest = min(smallest, ck)
        else:
            how = f"every layer at 2 bits: {format_bytes(smallest)}"
        biggest = sorted(prof.units, key=lambda u: -u.bytes[2])[:3]
        raise PlanError(
            f"budget {format_bytes(budget)} ({budget / 1e9:g} GB) is below the smallest configuration "
            f"the planner can reach at batch {batch_size} (the smaller of {how}); bytes no option "
            f"reduces: {format_bytes(prof.fixed_bytes * scale)}; largest units at 2 bits: "
            + ", ".join(f"{u.name} {format_bytes(u.bytes[2] * scale)}" for u in biggest)
            + ". Lower the batch size or the input size, or raise the budget.")
    _, st = min(found, key=lambda f: f[0])
    by, err, tm = st.cost()
    layer_bits = {n: st.bits[u.name] for u in prof.units for n in u.layers}
    held = st.reserve() if recompute_transient else 0
    return Plan(dict(st.bits), dict(st.ckpt), batch_size, int(budget), int(by + held), err, tm,
                prof.step_time * scale + tm, layer_bits, est_recompute=int(st.reserve()),
                counts_recompute=recompute_transient)


def largest_batch(prof: Profile, budget: int, limit: int, checkpointing: bool = True,
                  objective: str = "error", recompute_transient: bool = True,
                  time_tolerance: float = 0.02) -> Plan:
    """The plan for the largest batch in 1..``limit`` that some configuration fits in ``budget``
    (bytes scale linearly with the batch, so the batches that fit are 1..B: bisection over
    :func:`make_plan`). Raises :class:`PlanError` when not even batch 1 fits."""
    def plan(batch):
        return make_plan(prof, budget, batch, checkpointing, objective, recompute_transient, time_tolerance)

    lo = plan(1)  # raises when nothing fits
    hi = limit + 1
    b = 1
    while hi - b > 1:
        mid = (b + hi) // 2
        try:
            lo = plan(mid)
            b = mid
        except PlanError:
            hi = mid
    return lo if lo.batch_size == b else plan(b)


# ---- applying and writing --------------------------------------------------------------------
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
