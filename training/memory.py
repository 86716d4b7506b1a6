"""Memory plans in training (``mesa_ops.planner``): ``--ms-plan FILE`` (a plan of
``tools/plan_memory.py``), ``--memory-budget-gb X`` (plan here, for ``--batch-size`` or, with
``--batch-size auto``, for the largest batch whose plan fits), the predicted vs measured saved
bytes after the first step, and the loud warning for a policy that leaves the run exact.

Budget: the bytes autograd saves for backward in one training step of one process (the
planner's accounting, ``mesa_ops.audit``), 1 GB = 1e9 bytes; parameters, gradients, optimizer
state and the allocator's overhead are not in it.
"""
from __future__ import annotations

import os
import sys
import tempfile

import torch

import mesa_ops as ms
from mesa_ops import planner as P
from mesa_ops.audit import format_bytes

from .distributed import all_gather_object, get_rank, is_main_process
from .logs import log

__all__ = ["PLAN_FILE", "exact_policy_warning", "first_step_report", "plan_for_budget", "warn_loudly"]

PLAN_FILE = "memory_plan.txt"  # where --memory-budget-gb writes its plan in --output-dir
MiB = 2.0 ** 20


def warn_loudly(msg: str) -> None:
    """A warning on stderr (main process), upper-case tag so it stands out of the progress lines."""
    if is_main_process():
        print(f"WARNING: {msg}", file=sys.stderr, flush=True)


def exact_policy_warning(model, source: str) -> str | None:
    """The warning for a policy / plan that enables no Mesa layer and checkpoints no block (the
    run trains exactly, saving nothing), or None."""
    on = sum(1 for _, m in ms.policy.mesa_layers(model) if m.enable)
    if on or P.checkpointed_blocks(model):
        return None
    return (f"{source} enables no Mesa layer and checkpoints no block: this run trains exactly as without "
            "Mesa and saves no activation memory (check the file's tags and by_index lines)")


def _rng_state():
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if hasattr(ms, "get_rng_state"):
        state["mesa"] = ms.get_rng_state()
    return state


def _set_rng_state(state) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "mesa" in state:
        ms.set_rng_state(state["mesa"])


def _measure(model, input_size: int, device, probe_batch: int):
    """The planner's profile of ``model`` on a random (probe_batch, 3, S, S) batch; the model's
    weights, quantizer state and every generator are as before (the probe's training steps
    would otherwise move the quantizers' running ranges and the random streams)."""
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    rng = _rng_state()
    try:
        probe = torch.randn(probe_batch, 3, input_size, input_size, device=device)
        return P.measure(model, probe, time_steps=1)
    finally:
        model.load_state_dict(saved)
        model.zero_grad(set_to_none=True)
        _set_rng_state(rng)


def plan_for_budget(model, args, device, limit: int, even: bool = False) -> tuple[P.Plan, dict, str]:
    """Plan ``model`` (exact, built) for ``args.memory_budget_gb``: at ``args.batch_size``, or
    with ``--batch-size auto`` at the largest batch in 1..``limit`` that fits (which sets
    ``args.batch_size``; ``even``: the largest even one, as timm's Mixup needs); the plan is made on rank 0 and shared, written to
    ``<output-dir>/memory_plan.txt`` (without one: a temporary file) and applied.
    Returns (plan, the file's figures (:func:`mesa_ops.planner.read_plan`), where it is). Raises :class:`mesa_ops.planner.PlanError` when nothing fits."""
    budget = int(args.memory_budget_gb * 1e9)
    auto = args.batch_size == "auto"
    plan, err = None, None
    if get_rank() == 0:
        prof = _measure(model, args.input_size, device, 2 if auto else max(1, min(args.batch_size, 2)))
        try:
            if auto:
                plan = P.largest_batch(prof, budget, limit)
                if even and plan.batch_size % 2:
                    if plan.batch_size == 1:
                        raise P.PlanError("batch 1 fits, but Mixup / CutMix need an even batch")
                    plan = P.make_plan(prof, budget, plan.batch_size - 1)
            else:
                plan = P.make_plan(prof, budget, args.batch_size)
        except P.PlanError as exc:
            err = str(exc)
    plan, err = all_gather_object((plan, err))[0]
    if err:
        raise P.PlanError(f"--memory-budget-gb {args.memory_budget_gb:g}: {err}")
    if auto:
        args.batch_size = plan.batch_size
        log(f"--batch-size auto: {plan.batch_size}, the largest {'even ' if even else ''}batch (of at most "
            f"{limit}, this rank's training images) whose plan fits --memory-budget-gb "
            f"{args.memory_budget_gb:g}" + (" (even: Mixup / CutMix pair the images)" if even else ""))
    header = f"{args.model}, {args.input_size} px (tools/train.py --memory-budget-gb {args.memory_budget_gb:g})"
    if args.output_dir:
        path = os.path.join(args.output_dir, PLAN_FILE)
        if is_main_process():
            P.write_plan(plan, model, path, header=header)
        all_gather_object(None)  # the file is written before any rank reads it
        info = _apply(model, path)
    else:  # nowhere to keep it: a temporary file, applied and removed
        with tempfile.TemporaryDirectory() as folder:
            path = P.write_plan(plan, model, os.path.join(folder, PLAN_FILE), header=header)
            info = _apply(model, path)
        path = "not kept: no --output-dir"
    log(f"memory plan ({path}): {_describe(plan)}")
    return plan, info, path


def _apply(model, path: str) -> dict:
    P.apply_plan(model, path)
    return P.read_plan(path)


def _describe(plan: P.Plan) -> str:
    from collections import Counter

    c = Counter(plan.bits.values())
    ck = Counter(m for m in plan.ckpt.values() if m)
    units = ", ".join(f"{'exact' if b == 0 else f'{b}-bit'} {c[b]}" for b in P.BITS if c[b])
    blocks = ", ".join(f"{n} {m}" for m, n in ck.items()) or "none"
    exact = "" if any(plan.bits.values()) or ck else " (the exact model fits: no Mesa layer needed)"
    return (f"batch {plan.batch_size}, budget {plan.budget / 1e9:g} GB, units {units}, checkpointed blocks "
            f"{blocks}, predicted saved {format_bytes(plan.est_bytes)}{exact}")


def first_step_report(info: dict, batch_size: int, source: str):
    """A callable for ``train_one_epoch(on_first_step=...)``: logs the plan's predicted saved bytes
    (scaled linearly to this run's batch when the plan is for another) against the measured
    ones of the first step."""
    def report(saved_bytes: float) -> None:
        k = batch_size / info["batch_size"]
        # a plan made with recompute_transient=False (tools/frontier.py's) holds no transient in est_bytes
        extra = info.get("est_recompute", 0) * k if info.get("counts_recompute", True) else 0
        pred = info["est_bytes"] * k - extra
        scaled = "" if k == 1 else f" (scaled from the plan's batch {info['batch_size']} to {batch_size})"
        log(f"memory plan ({source}): predicted saved activations {pred / MiB:.2f} MiB in the forward"
            + (f" + {extra / MiB:.2f} MiB while a checkpointed block is recomputed" if extra else "")
            + f"{scaled}, measured {saved_bytes / MiB:.2f} MiB in the first step's forward "
              f"({saved_bytes / max(pred, 1):.2f}x), budget {info['budget'] * k / MiB:.2f} MiB")
    return report
