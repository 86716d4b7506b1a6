"""The paper's second claim as a tool: re-invest an activation-memory budget in model size.

    res = models.scale.largest_variant("deit_small_patch16_224", budget=2e9, batch_size=64,
                                       axis="width")
    print(res.table())          # the largest width that fits, exact and under Mesa
    model = models.create_model("deit_small_patch16_224", **res.kwargs("plan"))

A family grows along one axis in steps (timm's constructor arguments, :data:`STEPS`):

* DeiT: width k -> ``embed_dim=64k, num_heads=k`` (head dim 64, as DeiT-Ti/S/B: k = 3/6/12);
  depth k -> ``depth=k``.
* Swin: width k -> ``embed_dim=32k, num_heads=(k, 2k, 4k, 8k)`` (Swin-T/B: k = 3/4);
  depth k -> ``depths=(2, 2, 2k, 2)`` (the third stage, as Swin-T/S: k = 3/9).
* PVT: width k -> ``embed_dims=(16k, 32k, 80k, 128k)`` (PVT-Tiny: k = 4); depth k ->
  ``depths=(2, 2, k, 2)``.

The bytes of each variant are those saved for backward in one training step at ``batch_size``
(measured at a probe batch and scaled linearly; 1 GB = 1e9 bytes), per mode: ``exact``; ``mesa8`` /
``mesa4`` (every Mesa unit at those bits): an audit of the whole model so configured
(:func:`mesa_ops.audit.audit`: a packed copy two neighbours share, such as a LayerNorm's x-hat that
the next Linear reads, counts once); ``mesa8+cckpt`` (every block checkpointed with its input
packed at 8 bits, the rest at 8 bits) and ``plan`` (the planner's least-error plan within the
budget: bits per layer and checkpointing per block): the memory planner's estimates
(:mod:`mesa_ops.planner`), which count each unit's bytes as if its neighbours were exact, so
they lean high where neighbours share a copy.
Bytes grow with the step, so the largest fitting step of each mode is found by bisection over
the steps (each variant measured once, on the CPU).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from mesa_ops import planner as P
from mesa_ops.audit import audit, format_bytes
from mesa_ops.plan_measure import _set, unit_layers

from .registry import create_model, model_entry

__all__ = ["AXES", "MODES", "STEPS", "ScaleResult", "largest_variant", "variant_kwargs"]

AXES = ("width", "depth")
MODES = ("exact", "mesa8", "mesa4", "mesa8+cckpt", "plan")
STEPS = {
    "deit": {"width": lambda k: dict(embed_dim=64 * k, num_heads=k), "depth": lambda k: dict(depth=k)},
    "swin": {"width": lambda k: dict(embed_dim=32 * k, num_heads=(k, 2 * k, 4 * k, 8 * k)),
             "depth": lambda k: dict(depths=(2, 2, 2 * k, 2))},
    "pvt": {"width": lambda k: dict(embed_dims=(16 * k, 32 * k, 80 * k, 128 * k)),
            "depth": lambda k: dict(depths=(2, 2, k, 2))},
}
MAX_STEP = {"width": 16, "depth": 32}


def variant_kwargs(name: str, axis: str, k: int) -> dict:
    """The constructor arguments of step ``k`` along ``axis`` of ``name``'s family."""
    fam = model_entry(name).family
    if fam not in STEPS:
        raise ValueError(f"{name}: no size steps for family {fam!r} (known: {', '.join(STEPS)})")
    if axis not in AXES:
        raise ValueError(f"axis {axis!r}: expected one of {AXES}")
    return STEPS[fam][axis](int(k))


@dataclass
class ScaleResult:
    name: str
    axis: str
    budget: int
    batch_size: int
    best: dict                                     # mode -> largest fitting step (0: none fits)
    max_step: int = 0                              # the largest step tried
    measured: dict = field(default_factory=dict)   # step -> {mode: bytes, 'params': n}
    plans: dict = field(default_factory=dict)      # step -> Plan (or the PlanError text)

    def kwargs(self, mode: str = "plan") -> dict:
        k = self.best.get(mode, 0)
        if not k:
            raise P.PlanError(f"{self.name}: no {self.axis} step fits {format_bytes(self.budget)} at batch "
                              f"{self.batch_size} with {mode}")
        return variant_kwargs(self.name, self.axis, k)

    def table(self) -> str:
        """One line per mode: the largest step, its arguments, parameters and saved bytes."""
        lines = [f"largest {self.axis} of {self.name} whose saved activations fit "
                 f"{format_bytes(self.budget)} ({self.budget / 1e9:g} GB) at batch {self.batch_size}:"]
        for mode in self.best:  # (the modes searched, in order)
            k = self.best.get(mode, 0)
            if not k:
                lines.append(f"  {mode:12s} none (step 1 does not fit)")
                continue
            m = self.measured[k]
            kw = ", ".join(f"{a}={v}" for a, v in variant_kwargs(self.name, self.axis, k).items())
            top = " (the largest step tried)" if k == self.max_step else ""
            lines.append(f"  {mode:12s} step {k:2d} ({kw}): {m['params'] / 1e6:.1f}M parameters, "
                         f"{format_bytes(m[mode])} saved{top}")
        return "\n".join(lines)


def _mode_bytes(prof, batch_size: int, budget: int, plan: bool = True) -> tuple[dict, object]:
    """The planner's estimates: ``mesa8+cckpt`` and (with ``plan``) the plan's bytes."""
    scale = batch_size / prof.probe_batch
    out = {}
    st = P._State(prof, scale)
    for u in prof.units:
        st.bits[u.name] = 8
    for b in prof.blocks:
        st.apply(("ckpt", b.name, "exact"))
        if prof.packed_ckpt:
            st.apply(("ckpt", b.name, "packed8"))
    out["mesa8+cckpt"] = st.cost()[0] + st.reserve()
    if not plan:
        return out, None
    try:
        plan = P.make_plan(prof, budget, batch_size)
        out["plan"] = plan.est_bytes
    except P.PlanError as exc:
        plan = str(exc)
        out["plan"] = math.inf
    return out, plan


def _configured_bytes(model, x: torch.Tensor, batch_size: int) -> dict:
    """``exact`` / ``mesa8`` / ``mesa4`` bytes of the whole model at ``batch_size``: one audited
    training forward with every layer of the planner's units
    (:func:`mesa_ops.plan_measure.unit_layers`) at those bits (the model is left all exact)."""
    scale = batch_size / x.shape[0]
    on = unit_layers(model, x)
    out = {}
    for mode, bits in (("exact", 0), ("mesa8", 8), ("mesa4", 4)):
        _set(model, {n: bits for n in on})
        out[mode] = audit(model, x, verbose=False).total_bytes * scale
    _set(model, {})
    return out


def largest_variant(name: str, budget: float, batch_size: int, axis: str = "width", *, input_size: int = 224,
                    model_kwargs: dict | None = None, probe_batch: int = 1, max_step: int | None = None,
                    verbose=None, modes=MODES) -> ScaleResult:
    """The largest step of ``name``'s family along ``axis`` whose saved activations at
    ``batch_size`` fit ``budget`` bytes, per mode of ``modes`` (of :data:`MODES`; see the module
    docstring). ``model_kwargs``: other constructor arguments (kept; the axis's own are set per
    step); ``max_step``: the largest step tried (default 16 for width, 32 for depth)."""
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"largest_variant: unknown mode(s) {bad}; expected some of {MODES}")
    verbose = verbose or (lambda *_: None)
    budget = int(budget)
    hi_step = int(max_step or MAX_STEP[axis])
    variant_kwargs(name, axis, 1)  # checks the family and axis
    res = ScaleResult(name, axis, budget, batch_size, {}, hi_step)

    def measure(k: int) -> dict:
        if k not in res.measured:
            kw = {**(model_kwargs or {}), **variant_kwargs(name, axis, k)}
            torch.manual_seed(0)
            model = create_model(name, img_size=input_size, **kw)
            x = torch.randn(probe_batch, 3, input_size, input_size)
            got, plan = _configured_bytes(model, x, batch_size), None
            if {"mesa8+cckpt", "plan"} & set(modes):  # (the planner's profile: bytes, no step timed)
                planned, plan = _mode_bytes(P.measure(model, x, time_steps=0), batch_size, budget,
                                            plan="plan" in modes)
                got.update(planned)
            got["params"] = sum(p.numel() for p in model.parameters())
            res.measured[k], res.plans[k] = got, plan
            verbose(f"{name} {axis} step {k}: " + ", ".join(
                f"{m} {format_bytes(v) if math.isfinite(v) else 'no plan'}" for m, v in got.items() if m != "params"))
            del model
        return res.measured[k]

    # a mode that never keeps more than another fits at least the other's step: start there
    floor = {"mesa8": "exact", "mesa4": "mesa8", "plan": "exact"}
    for mode in modes:
        lo, hi = res.best.get(floor.get(mode), 0), hi_step + 1  # lo fits (0: nothing), hi does not
        if lo and measure(lo)[mode] > budget:  # (the planner's estimate can exceed the audited exact)
            lo = 0
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if measure(mid)[mode] <= budget:
                lo = mid
            else:
                hi = mid
        res.best[mode] = lo
    return res
