"""The paper's second claim, measured (issue 39): an activation-memory budget re-invested in a
larger model, exact against Mesa 8-bit, on real data.

    res = run(budget_steps=(1, 2), axis="depth", seeds=(0, 1, 2), out_dir="outputs/reinvest", jobs=2)
    print(format_table(res))

Pan et al. (Mesa, arXiv 2111.11124) claim that "by re-investing the saved memory in employing a
larger batch size or scaling up model size, we may further improve the performance under
constrained computational resources". Here the model is the demo DeiT (:mod:`models.demo`: patch 8,
32 px, width 64, 2 heads, 2 blocks) on all 1797 DIGITS images, cross-validated as
:mod:`training.crossval` (k folds x seeds, every image validated once per seed, the demo's recipe).

A budget B is the bytes autograd saves for backward in one training step at the demo's batch (32),
as an audit of one training forward of the whole model counts them (:func:`models.scale.largest_variant`). ``budget_steps`` k: B is what
exact saves at step k of the demo's family along ``axis`` (depth k: ``depth=k``; width k:
``embed_dim=64k, num_heads=k``), so exact's largest model is step k. Per budget three arms, all
from the demo's recipe:

* ``exact``: the largest step exact fits, the demo's epochs;
* ``mesa8``: the largest step Mesa 8-bit fits (every Mesa layer at 8 bits), the same epochs;
* ``mesa8-time``: that model for the epochs that fit exact's training time: epochs x exact's step
  time / Mesa's (step times of the two models measured side by side in one process, one thread,
  as the runs train; kept in ``out_dir/timing.json`` so that ``resume`` trains the same arm), the
  warmup scaled alike (at least 1 epoch).

Each Mesa arm is paired with the exact arm of its budget by fold and seed (the same folds, the
same seed; the models differ, so the initial weights do too): the mean difference of fold
accuracies +- its standard error over the pairs (:func:`training.crossval.summarize`).
"""
from __future__ import annotations

import json
import os
import statistics

import torch

import models
from mesa_ops.bench import agg_pyplot, time_in_turn
from models.scale import largest_variant, variant_kwargs
from training import crossval as cv

__all__ = ["AXES", "BATCH", "demo_variant_args", "budget_bytes", "choose", "step_times", "arms_for",
           "run", "summarize", "format_table", "summary_lines", "plot"]

AXES = ("depth", "width")
BATCH = 32  # the demo's (training.crossval.DEMO_TRAIN_ARGS)
_D = models.demo
METHODS = ("exact", "mesa8", "mesa8-time")


def _base_kwargs(axis: str) -> dict:
    """The demo's constructor arguments less those the axis sets per step."""
    own = variant_kwargs(_D.DEMO_MODEL, axis, 1)
    return {k: v for k, v in _D.DEMO_KWARGS.items() if k not in own}


def _kwargs(axis: str, k: int) -> dict:
    return {**_base_kwargs(axis), **variant_kwargs(_D.DEMO_MODEL, axis, k)}


def demo_variant_args(axis: str, k: int) -> tuple:
    """``tools/train.py`` arguments that replace the demo's model arguments by step ``k``."""
    return ("--model-kwargs", *[f"{a}={v}".replace(" ", "") for a, v in _kwargs(axis, k).items()])


def _search(budget: float, axis: str, max_step: int):
    return largest_variant(_D.DEMO_MODEL, budget, BATCH, axis, input_size=_D.DEMO_INPUT_SIZE,
                           model_kwargs=_base_kwargs(axis), max_step=max_step, modes=("exact", "mesa8"),
                           probe_batch=BATCH)


def budget_bytes(axis: str, k: int) -> int:
    """What exact saves (audited bytes) at step ``k`` along ``axis``, batch :data:`BATCH`."""
    res = _search(1e18, axis, k)  # (everything fits: step k is measured)
    return int(res.measured[k]["exact"])


def choose(budget: float, axis: str, max_step: int = 32) -> dict:
    """{'exact': step, 'mesa8': step, 'bytes': {step: {mode: audited bytes}}, 'params': {step: n}}
    of the largest steps that fit ``budget`` bytes (0: none fits)."""
    res = _search(budget, axis, max_step)
    return {"exact": res.best["exact"], "mesa8": res.best["mesa8"],
            "bytes": {k: {m: v[m] for m in ("exact", "mesa8")} for k, v in res.measured.items()},
            "params": {k: v["params"] for k, v in res.measured.items()}}


def step_times(axis: str, steps: dict, repeats: int = 30, warmup: int = 5, threads: int = 1) -> dict:
    """Median training-step time (s) of each {name: (bits, step)}, the models built as the runs
    build them (the demo's arguments, seed 0) and stepped in turn in this process with
    ``threads`` threads, so that load from elsewhere hits them alike."""
    from training.main import build_model, build_optimizer

    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        loss_fn = torch.nn.CrossEntropyLoss()

        def stepper(bits, k):
            args = cv._train_args(bits, 0, 30, demo_variant_args(axis, k))
            torch.manual_seed(0)
            model = build_model(args, _D.DEMO_NUM_CLASSES).train()
            opt, _ = build_optimizer(args, model, 10)
            x = torch.randn(BATCH, 3, _D.DEMO_INPUT_SIZE, _D.DEMO_INPUT_SIZE)
            y = torch.randint(0, _D.DEMO_NUM_CLASSES, (BATCH,))

            def step():
                loss = loss_fn(model(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            return step

        times = time_in_turn({n: stepper(bits, k) for n, (bits, k) in steps.items()}, warmup, repeats)
        return {n: statistics.median(t) for n, t in times.items()}
    finally:
        torch.set_num_threads(prev)


def arms_for(i: int, chosen: dict, axis: str, epochs: int, t_exact: float, t_mesa: float) -> dict:
    """{name: crossval.Arm} of budget number ``i``: ``B<i>-exact``, ``B<i>-mesa8``,
    ``B<i>-mesa8-time`` (see the module docstring)."""
    ke, km = chosen["exact"], chosen["mesa8"]
    e_time = max(1, round(epochs * t_exact / t_mesa))
    warm = max(1, round(3 * e_time / epochs))  # the demo's 3 warmup epochs of its 30, scaled alike
    return {f"B{i}-exact": cv.Arm(None, epochs, demo_variant_args(axis, ke)),
            f"B{i}-mesa8": cv.Arm(8, epochs, demo_variant_args(axis, km)),
            f"B{i}-mesa8-time": cv.Arm(8, e_time, demo_variant_args(axis, km) + ("--warmup-epochs", str(warm)))}


def _plan(budgets: list[float], axis: str, epochs: int, out_dir: str | None, resume: bool, progress) -> list[dict]:
    """Per budget: the steps chosen and their step times (read from ``out_dir/timing.json`` on
    ``resume`` when it holds the same budgets and steps)."""
    path = os.path.join(out_dir, "timing.json") if out_dir else None
    if resume and path and os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
        if saved.get("axis") == axis and [round(b) for b in saved.get("budgets", [])] == [round(b) for b in budgets]:
            progress(f"reinvest: budgets, steps and step times from {path}")
            return saved["plan"]
    plan = []
    for i, b in enumerate(budgets):
        chosen = choose(b, axis)
        if not chosen["exact"]:
            raise ValueError(f"reinvest: exact fits no {axis} step in {b / 2 ** 20:.2f} MiB at batch {BATCH}")
        t = step_times(axis, {"exact": (None, chosen["exact"]), "mesa8": (8, chosen["mesa8"])})
        plan.append({"budget": b, "exact": chosen["exact"], "mesa8": chosen["mesa8"],
                     "bytes": {str(k): v for k, v in chosen["bytes"].items()},
                     "params": {str(k): v for k, v in chosen["params"].items()},
                     "t_exact": t["exact"], "t_mesa8": t["mesa8"]})
        progress(f"reinvest: budget B{i} {b / 2 ** 20:.2f} MiB: exact {axis} {chosen['exact']} "
                 f"({t['exact'] * 1e3:.1f} ms/step), mesa8 {axis} {chosen['mesa8']} ({t['mesa8'] * 1e3:.1f} ms/step)")
    if path:
        os.makedirs(out_dir, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"axis": axis, "budgets": budgets, "plan": plan}, f, indent=1)
    return plan


def run(budget_steps=(1, 2), axis: str = "depth", seeds=(0, 1, 2), folds: int = 5, epochs: int = 30,
        out_dir: str | None = None, resume: bool = False, jobs: int = 1, budgets_bytes=None,
        progress=print) -> dict:
    """The benchmark (module docstring): budgets from ``budget_steps`` (exact's bytes at those
    steps) or ``budgets_bytes``. Returns {``axis``, ``plan`` (per budget: steps, bytes, step
    times), ``arms`` {name: Arm fields}, and crossval's result fields (``runs`` ...)}."""
    if axis not in AXES:
        raise ValueError(f"reinvest: axis {axis!r}: expected one of {AXES}")
    budgets = ([float(b) for b in budgets_bytes] if budgets_bytes
               else [float(budget_bytes(axis, int(k))) for k in budget_steps])
    if not budgets:
        raise ValueError("reinvest: no budget given")
    plan = _plan(budgets, axis, epochs, out_dir, resume, progress)
    arms = {}
    for i, p in enumerate(plan):
        arms.update(arms_for(i, p, axis, epochs, p["t_exact"], p["t_mesa8"]))
    res = cv.crossval(list(arms), seeds, folds, epochs, out_dir=out_dir, resume=resume, progress=progress,
                      jobs=jobs, arms=arms)
    res.update(axis=axis, plan=plan, arms={n: a.describe(epochs) for n, a in arms.items()})
    return res


def summarize(res: dict) -> list[dict]:
    """Per budget and method: ``budget`` (bytes), ``method``, ``step`` (the axis's), ``params``,
    ``planned`` (audited bytes the step was chosen by), ``saved_mib`` (measured in training), ``epochs``, ``step_ms``
    (the runs' median), ``acc`` (mean top-1 over seeds), ``diff`` / ``diff_se`` / ``pairs``
    against that budget's exact arm (NaN for exact)."""
    rows = []
    for i, p in enumerate(res["plan"]):
        names = [f"B{i}-{m}" for m in METHODS]
        sub = {**res, "modes": names, "seeds_for": {n: res["seeds"] for n in names},
               "runs": [r for r in res["runs"] if r["mode"] in names]}
        for m, s in zip(METHODS, cv.summarize(sub)):
            k = p["exact"] if m == "exact" else p["mesa8"]
            bits_key = "exact" if m == "exact" else "mesa8"
            rows.append({"budget": p["budget"], "method": m, "step": k, "params": p["params"][str(k)],
                         "planned": p["bytes"][str(k)][bits_key], "saved_mib": s["saved_mib"],
                         "epochs": res["arms"][f"B{i}-{m}"]["epochs"], "step_ms": s["step_ms"],
                         "acc": s["acc"], "diff": float("nan") if m == "exact" else s["diff"],
                         "diff_se": float("nan") if m == "exact" else s["diff_se"],
                         "pairs": 0 if m == "exact" else s["pairs"]})
    return rows


def format_table(res: dict) -> str:
    rows = summarize(res)
    ax = res["axis"]
    lines = [f"Demo DeiT on DIGITS ({res['n_images']} images), {res['folds']}-fold x {len(res['seeds'])} seeds, "
             f"batch {BATCH}; per budget of saved activations, the largest {ax} that fits; "
             "differences paired by fold and seed with that budget's exact, +- standard error:",
             "",
             f"| budget | method | {ax} | params | saved (audit) | saved (training) | epochs | step time (runs) | top-1 | "
             "vs exact (points) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        diff = "" if r["method"] == "exact" else f"{r['diff']:+.2f} +- {r['diff_se']:.2f} ({r['pairs']})"
        lines.append(f"| {r['budget'] / 2 ** 20:.2f} MiB | {r['method']} | {r['step']} | {r['params'] / 1e3:.0f}k | "
                     f"{r['planned'] / 2 ** 20:.2f} MiB | {r['saved_mib']:.2f} MiB | {r['epochs']} | "
                     f"{r['step_ms']:.1f} ms | {r['acc']:.2f}% | {diff} |")
    return "\n".join(lines)


def summary_lines(res: dict) -> list[str]:
    """One line per budget: exact's model and top-1, Mesa's model and its paired differences."""
    rows = summarize(res)
    ax = res["axis"]
    out = []
    for i in range(len(res["plan"])):
        ex, m8, mt = rows[3 * i:3 * i + 3]
        out.append(f"budget {ex['budget'] / 2 ** 20:.2f} MiB: exact {ax} {ex['step']} {ex['acc']:.2f}%; "
                   f"Mesa 8-bit {ax} {m8['step']} ({m8['params'] / ex['params']:.1f}x the parameters) "
                   f"{m8['diff']:+.2f} +- {m8['diff_se']:.2f} points at the same epochs, "
                   f"{mt['diff']:+.2f} +- {mt['diff_se']:.2f} in exact's training time ({mt['epochs']} epochs)")
    return out


def plot(res: dict, path: str) -> str | None:
    """Top-1 against the budget, one line per method (error bars: the paired standard error), to
    ``path`` (PNG); None (no error) when matplotlib is not installed."""
    try:
        plt = agg_pyplot()
    except ImportError:
        return None
    rows = summarize(res)
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    labels = {"exact": f"exact (largest {res['axis']})", "mesa8": f"Mesa 8-bit (largest {res['axis']}), same epochs",
              "mesa8-time": "Mesa 8-bit, same training time"}
    for m in METHODS:
        mine = [r for r in rows if r["method"] == m]
        err = [0.0 if m == "exact" else r["diff_se"] for r in mine]
        ax.errorbar([r["budget"] / 2 ** 20 for r in mine], [r["acc"] for r in mine], yerr=err, marker="o",
                    capsize=3, label=labels[m])
        for r in mine:
            ax.annotate(f"{res['axis'][0]}{r['step']}", (r["budget"] / 2 ** 20, r["acc"]), textcoords="offset points",
                        xytext=(4, 4), fontsize=7)
    ax.set_xlabel(f"activation budget (MiB saved per step, batch {BATCH})")
    ax.set_ylabel("top-1 (%), cross-validated")
    ax.set_title(f"DIGITS, {res['folds']}-fold x {len(res['seeds'])} seeds", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
