"""The memory/time frontier: Mesa against PyTorch's own ways of saving activation memory.

Per model, saved-for-backward bytes and train-step time of

* ``exact`` (fused SDPA attention);
* ``ckpt`` (``torch.utils.checkpoint``, non-reentrant, every block) and ``ckpt/2`` (every 2nd);
* ``sac`` (selective activation checkpointing, every block:
  ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` with a policy that saves the
  outputs of the matmuls and attention, :data:`SAC_SAVE`, and recomputes the rest);
* ``compile@B`` (``torch.compile`` with ``torch._functorch.config.activation_memory_budget = B``:
  its min-cut recomputation) and ``mesa8+compile@B``;
* ``mesa8`` / ``mesa4`` / ``mesa2`` (the paper's layers at those bits);
* ``cckpt8`` / ``cckpt4`` (Mesa at those bits and every block under compressed checkpointing:
  the block input packed at those bits, the block recomputed exactly);
* ``plan@F`` (the memory planner's fastest plan, ``mesa_ops.planner.make_plan(...,
  objective='time', recompute_transient=False)``, for F x exact's saved bytes: bits per layer
  and plain / compressed checkpointing per block; the budget counts what the forward saves,
  as the other modes' figures do; profiled at the frontier's batch).

Timing: the eager modes are built side by side in one worker and stepped in turn (one step of
each per round), so other load hits all alike; each compiled mode runs in a worker of its own with
an eager ``exact`` reference stepped in turn beside it, and is reported as its ratio to that
reference times the shared ``exact`` time. Saved bytes: ``ms.SavedActivationMeter`` (autograd's
saved tensors; the compiled graphs' included), plus for ``sac`` the op outputs its policy keeps
(held by the checkpoint's own cache, not saved through autograd).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.utils.checkpoint as tckpt
from torch.utils._python_dispatch import TorchDispatchMode

import mesa_ops as ms
from mesa_ops.bench import agg_pyplot, time_in_turn
from mesa_ops.checkpoint import find_blocks, wrap_blocks

__all__ = ["EAGER_MODES", "SAC_SAVE", "FrontierRow", "default_modes", "frontier", "markdown", "pareto", "plot"]

EAGER_MODES = ("exact", "ckpt", "ckpt/2", "sac", "mesa8", "mesa4", "mesa2", "cckpt8", "cckpt4")
PLAN_FRACTIONS = (0.5, 0.2, 0.1, 0.05, 0.03)
COMPILE_BUDGETS = (0.5, 0.2, 0.1, 0.05)


def default_modes(compile_budgets=COMPILE_BUDGETS, mesa_compile=(0.2,), plans=PLAN_FRACTIONS) -> list[str]:
    return (list(EAGER_MODES) + [f"plan@{f:g}" for f in plans] + [f"compile@{b:g}" for b in compile_budgets]
            + [f"mesa8+compile@{b:g}" for b in mesa_compile])


def _aten(*names):
    ops = []
    for n in names:
        pkt, _, overload = n.partition(".")
        op = getattr(torch.ops.aten, pkt, None)
        if op is not None and hasattr(op, overload or "default"):
            ops.append(getattr(op, overload or "default"))
    return frozenset(ops)


# what the selective-checkpointing policy saves: matmul and attention outputs (the expensive ops)
SAC_SAVE = _aten("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention")


@dataclass
class FrontierRow:
    model: str
    mode: str
    batch: int
    saved_bytes: int
    step_time_s: float
    saved_x: float = float("nan")
    time_x: float = float("nan")
    note: str = ""
    extra: dict = field(default_factory=dict)


# ---- building the modes ----------------------------------------------------------------------
class _SACCounter(TorchDispatchMode):
    """Counts the bytes of the outputs of :data:`SAC_SAVE` ops run in a checkpointed forward (what
    the selective checkpoint keeps)."""

    def __init__(self, sink: list):
        super().__init__()
        self.sink = sink

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in SAC_SAVE:
            outs = out if isinstance(out, (tuple, list)) else (out,)
            self.sink[0] += sum(t.numel() * t.element_size() for t in outs if isinstance(t, torch.Tensor))
        return out


class SACBlock(nn.Module):
    """``block`` under selective activation checkpointing (:data:`SAC_SAVE` kept, the rest
    recomputed); ``kept_bytes`` counts what the policy kept since the last reset."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block
        self.kept = [0]

    @staticmethod
    def _policy(ctx, op, *args, **kwargs):
        return tckpt.CheckpointPolicy.MUST_SAVE if op in SAC_SAVE else tckpt.CheckpointPolicy.PREFER_RECOMPUTE

    def _contexts(self):
        fwd, rec = tckpt.create_selective_checkpoint_contexts(self._policy)

        @contextlib.contextmanager
        def counted():
            with fwd, _SACCounter(self.kept):
                yield
        return counted(), rec

    def forward(self, *args, **kwargs):
        if not (self.training and torch.is_grad_enabled()):
            return self.block(*args, **kwargs)
        return tckpt.checkpoint(self.block, *args, use_reentrant=False, context_fn=self._contexts, **kwargs)


def _swap_blocks(model: nn.Module, make, every: int = 1) -> list:
    out = []
    for i, (parent, name, block) in enumerate(find_blocks(model)):
        if i % every == every - 1 or every == 1:
            w = make(block)
            setattr(parent, name, w)
            out.append(w)
    return out


def _mesa(model: nn.Module, name: str, bits: int) -> None:
    from benchmarks.models import _mode_policy

    ms.policy.set_mesa(model, **_mode_policy(name, f"mesa{bits}"))
    if "conv" in _mode_policy(name, f"mesa{bits}")["tags"]:  # the image's patch embedding stays exact
        next(m for m in model.modules() if isinstance(m, nn.Conv2d)).enable = False


class _Plans:
    """The planner's profile of a model (measured once) and its plan files per budget."""

    def __init__(self, name: str, make, batch: int, exact_saved: int, folder: str):
        from mesa_ops import planner as P

        self.P, self.name, self.batch, self.exact_saved, self.folder = P, name, batch, exact_saved, folder
        self.model = model = make()
        side = self.size(model)
        # profiled at the batch it plans for: step times do not scale linearly from a smaller
        # probe (Mesa's per-layer host time and a block's recomputation have fixed parts)
        self.prof = P.measure(model, torch.randn(batch, 3, side, side))

    @staticmethod
    def size(model) -> int:
        pe = getattr(model, "patch_embed", None)
        img = getattr(pe, "img_size", None)
        return int(img[0]) if img is not None else 224

    def path(self, fraction: float) -> str:
        # saved bytes as every mode here counts them: what the forward saves, not the transient a
        # checkpointed block re-creates in backward (ckpt's and compile's are not counted either)
        plan = self.P.make_plan(self.prof, int(fraction * self.exact_saved), self.batch, objective="time",
                                recompute_transient=False)
        path = os.path.join(self.folder, f"plan_{fraction:g}.txt")
        self.P.write_plan(plan, self.model, path, header=f"{self.name} at {fraction:g} x exact")
        return path


def build(name: str, mode: str, input_size: int, plans: _Plans | None = None, model_kwargs: dict | None = None):
    """(model in train mode, what its mode wrapped) for an eager frontier mode."""
    from models import create_model
    from mesa_ops import planner as P

    torch.manual_seed(0)
    model = create_model(name, img_size=input_size, **(model_kwargs or {}))
    wrapped = []
    if mode == "ckpt":
        wrapped = wrap_blocks(model, None)
    elif mode == "ckpt/2":
        wrapped = wrap_blocks(model, None, select=range(1, len(find_blocks(model)), 2))
    elif mode == "sac":
        wrapped = _swap_blocks(model, SACBlock)
    elif mode.startswith("mesa") and "+" not in mode:
        _mesa(model, name, int(mode[4:]))
    elif mode.startswith("cckpt"):
        bits = int(mode[5:])
        _mesa(model, name, bits)
        wrapped = wrap_blocks(model, bits)
    elif mode.startswith("plan@"):
        P.apply_plan(model, plans.path(float(mode[5:])))
    elif mode.startswith("mesa8+compile@"):
        _mesa(model, name, 8)
    elif mode != "exact" and not mode.startswith("compile@"):
        raise ValueError(f"unknown frontier mode {mode!r}")
    return model.train(), wrapped


def _saved(model, x, wrapped) -> int:
    for w in wrapped:
        if isinstance(w, SACBlock):
            w.kept[0] = 0
    with ms.SavedActivationMeter(model) as meter:
        out = model(x)
    del out
    return int(meter.total_bytes) + sum(w.kept[0] for w in wrapped if isinstance(w, SACBlock))


def _stepper(model, x, y):
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    def step():
        loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step


def _interleave(steppers: list, warmup: int, steps: int) -> list[float]:
    """Median seconds of each stepper, stepped in turn (``mesa_ops.bench.time_in_turn``)."""
    times = time_in_turn(dict(enumerate(steppers)), warmup, steps)
    return [statistics.median(times[i]) for i in range(len(steppers))]


def measure_eager(name: str, modes: list[str], batch: int, input_size: int, warmup: int, steps: int,
                  model_kwargs: dict | None = None) -> list[dict]:
    """Saved bytes and interleaved step times of the eager ``modes`` (one process)."""
    from models import create_model

    x = torch.randn(batch, 3, input_size, input_size, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 1000, (batch,), generator=torch.Generator().manual_seed(1))
    built, rows = {}, []
    exact_model, _ = build(name, "exact", input_size, model_kwargs=model_kwargs)
    exact_saved = _saved(exact_model, x, [])
    with tempfile.TemporaryDirectory() as d:
        plans = None
        if any(m.startswith("plan@") for m in modes):
            plans = _Plans(name, lambda: create_model(name, img_size=input_size, **(model_kwargs or {})), batch,
                           exact_saved, d)
        for mode in modes:
            try:
                built[mode] = build(name, mode, input_size, plans, model_kwargs) if mode != "exact" \
                    else (exact_model, [])
            except (ms.planner.PlanError, ValueError) as exc:
                rows.append({"mode": mode, "saved_bytes": 0, "step_time_s": float("nan"),
                             "note": str(exc).split(";")[0][:120]})
    ok = [m for m in modes if m in built]
    saved = {m: _saved(built[m][0], x, built[m][1]) for m in ok}
    times = _interleave([_stepper(built[m][0], x, y) for m in ok], warmup, steps)
    rows += [{"mode": m, "saved_bytes": saved[m], "step_time_s": t, "note": ""} for m, t in zip(ok, times)]
    return rows


def measure_compiled(name: str, mode: str, batch: int, input_size: int, warmup: int, steps: int,
                     model_kwargs: dict | None = None) -> dict:
    """A compiled mode beside an eager exact reference (this process): saved bytes, its step
    time and the ratio to the reference's (stepped in turn)."""
    import torch._functorch.config as fconf

    budget = float(mode.split("@")[1])
    x = torch.randn(batch, 3, input_size, input_size, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 1000, (batch,), generator=torch.Generator().manual_seed(1))
    ref, _ = build(name, "exact", input_size, model_kwargs=model_kwargs)
    model, _ = build(name, mode, input_size, model_kwargs=model_kwargs)
    fconf.activation_memory_budget = budget
    compiled = torch.compile(model)
    t0 = time.perf_counter()
    _stepper(compiled, x, y)()  # compiles forward and backward
    compile_s = time.perf_counter() - t0
    saved = _saved(compiled, x, [])
    t_ref, t_mode = _interleave([_stepper(ref, x, y), _stepper(compiled, x, y)], warmup, steps)
    return {"mode": mode, "saved_bytes": saved, "step_time_s": t_mode, "ref_time_s": t_ref,
            "note": f"compile {compile_s:.0f} s"}


def _worker(args: list, timeout: float | None) -> object:
    cmd = [sys.executable, "-m", "benchmarks.frontier", json.dumps(args)]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=root)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"frontier worker {args[:3]} took more than {timeout} s") from exc
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith(("[", "{"))]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"frontier worker {args[:2]} failed:\n{p.stderr[-3000:]}")
    return json.loads(lines[-1])


def frontier(name: str, modes: list[str], batch: int = 8, input_size: int = 224, warmup: int = 2,
             steps: int = 5, timeout: float | None = None, model_kwargs: dict | None = None) -> list[FrontierRow]:
    """The frontier rows of one model (each group of modes in fresh worker processes);
    ``model_kwargs``: constructor arguments (e.g. Swin's ``window_size`` at another input size)."""
    kw = dict(model_kwargs or {})
    eager = [m for m in modes if "compile@" not in m]
    if "exact" not in eager:
        eager.insert(0, "exact")
    rows = {r["mode"]: r for r in _worker(["eager", name, eager, batch, input_size, warmup, steps, kw], timeout)}
    base = rows["exact"]
    for m in [m for m in modes if "compile@" in m]:
        r = _worker(["compiled", name, m, batch, input_size, warmup, steps, kw], timeout)
        # the ratio to its own eager reference, on the shared exact time
        r["time_x"] = r["step_time_s"] / r["ref_time_s"]
        r["step_time_s"] = r["time_x"] * base["step_time_s"]
        rows[m] = r
    out = []
    for m in ["exact"] + [m for m in modes if m != "exact"]:
        r = rows[m]
        t = r.get("time_x", r["step_time_s"] / base["step_time_s"])
        out.append(FrontierRow(name, m, batch, int(r["saved_bytes"]), float(r["step_time_s"]),
                               r["saved_bytes"] / base["saved_bytes"] if r["saved_bytes"] else float("nan"),
                               t, r.get("note", "")))
    return out


def pareto(rows: list[FrontierRow]) -> set[str]:
    """The modes no other mode beats on both saved bytes and time (ties kept)."""
    ok = [r for r in rows if not math.isnan(r.time_x) and r.saved_bytes > 0]
    return {r.mode for r in ok
            if not any(o.saved_bytes <= r.saved_bytes and o.time_x <= r.time_x
                       and (o.saved_bytes < r.saved_bytes or o.time_x < r.time_x) for o in ok)}


def markdown(rows: list[FrontierRow]) -> str:
    """One table per model: mode, saved MiB, saved x, time x, on the frontier (*), note."""
    out = ["| model | mode | saved MiB | saved x | step s | time x | frontier | note |",
           "|---|---|---|---|---|---|---|---|"]
    for name in dict.fromkeys(r.model for r in rows):
        mine = [r for r in rows if r.model == name]
        front = pareto(mine)
        for r in sorted(mine, key=lambda r: (-(r.saved_x if not math.isnan(r.saved_x) else -1), r.time_x)):
            out.append(f"| {name} | {r.mode} | {r.saved_bytes / 2**20:.1f} | {r.saved_x:.3f} | "
                       f"{r.step_time_s:.3f} | {r.time_x:.3f} | {'*' if r.mode in front else ''} | {r.note} |")
    return "\n".join(out)


def plot(rows: list[FrontierRow], path: str) -> None:
    """Saved bytes (x exact, log scale) against step time (x exact), one panel per model, the
    frontier joined; Mesa modes filled, PyTorch's hollow."""
    plt = agg_pyplot()

    names = list(dict.fromkeys(r.model for r in rows))
    fig, axes = plt.subplots(1, len(names), figsize=(5.2 * len(names), 4.2), squeeze=False)
    for ax, name in zip(axes[0], names):
        mine = [r for r in rows if r.model == name and not math.isnan(r.time_x) and r.saved_bytes]
        front = sorted((r for r in mine if r.mode in pareto(mine)), key=lambda r: r.saved_x)
        ax.plot([r.saved_x for r in front], [r.time_x for r in front], "-", color="0.7", zorder=1)
        for r in mine:
            mesa = r.mode.startswith(("mesa", "cckpt", "plan"))
            ax.scatter(r.saved_x, r.time_x, s=36, zorder=2, edgecolors="C0" if mesa else "C3",
                       facecolors="C0" if mesa else "none")
            ax.annotate(r.mode, (r.saved_x, r.time_x), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_xlabel("saved for backward (x exact)")
        ax.set_ylabel("step time (x exact)")
        ax.set_title(f"{name}, batch {mine[0].batch}" if mine else name, fontsize=9)
        ax.grid(alpha=0.3)
    fig.suptitle("memory/time frontier (filled: Mesa and its planner; hollow: PyTorch's tools)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":  # worker: python -m benchmarks.frontier '<json args>'
    a = json.loads(sys.argv[1])
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    if a[0] == "eager":
        print(json.dumps(measure_eager(*a[1:])))
    else:
        print(json.dumps(measure_compiled(*a[1:])))
