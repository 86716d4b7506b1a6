"""Accuracy benchmark: the demo model on DIGITS, k-fold cross-validation x seeds, exact and Mesa
at 8 / 4 / 2 bits, paired by fold and seed.

    res = crossval(modes=("exact", "mesa8", "mesa4", "mesa2"), seeds=(0, 1), folds=5, epochs=30)
    print(format_results(res))

All 1797 DIGITS images (scikit-learn's 8x8 digits, upscaled to 32 px as
:class:`data.DigitsDataset`, normalized; no augmentation, as ``scripts/demo.sh``) are split into
``folds`` stratified folds, reshuffled per seed (``StratifiedKFold(shuffle=True,
random_state=seed)``): for each seed every image is validated exactly once. Each (seed, fold)
trains the demo model (:mod:`models.demo`) with the demo's recipe (:data:`DEMO_TRAIN_ARGS`,
``tools/train.py``'s parser and ``training.engine.train_one_epoch``) once per mode, from the same
initial weights and the same batch order (``torch.manual_seed(seed)``, the sampler's seed), so
the modes differ only in what Mesa does. Per mode: the mean top-1 over seeds of the
cross-validated accuracy (all images), and against the first mode the paired difference of
fold accuracies, mean +- its standard error over the mode's ``seeds x folds`` pairs (a mode may
run on a subset of the seeds: ``seeds_for``). Runs can go ``jobs`` at a time in worker
processes.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import math
import multiprocessing
import os
import statistics
import time

import numpy as np
import torch

import models
from data import DigitsDataset
from mesa_ops.bench import agg_pyplot
from data.transforms import build_transform

from .args import get_args_parser
from .engine import make_scaler, train_one_epoch
from .main import _seed, build_model, build_optimizer, resolve_args

__all__ = ["DEMO_TRAIN_ARGS", "MODES", "Arm", "digits_all", "fold_splits", "train_fold", "crossval",
           "summarize", "format_results", "plot"]

MODES = {"exact": None, "mesa8": 8, "mesa4": 4, "mesa2": 2}


@dataclasses.dataclass(frozen=True)
class Arm:
    """One way to train the demo in a cross-validation (a named "mode" of :func:`crossval`):
    Mesa at ``bits`` (None: exact), ``epochs`` (None: the cross-validation's), and further
    ``tools/train.py`` arguments after the demo's (e.g. ``("--model-kwargs", ..., "depth=6")``,
    which replaces the demo's model arguments, or ``("--warmup-epochs", "1")``)."""
    bits: int | None = None
    epochs: int | None = None
    extra_args: tuple = ()

    def describe(self, epochs: int) -> dict:
        """What a run of this arm was trained with (kept in its run file, checked on resume)."""
        return {"bits": self.bits, "epochs": self.epochs or epochs, "extra_args": list(self.extra_args)}
_D = models.demo
# scripts/demo.sh's tools/train.py arguments (without --epochs, --seed, --output-dir)
DEMO_TRAIN_ARGS = ["--model", _D.DEMO_MODEL, "--model-kwargs",
                   *[f"{k}={v}" for k, v in _D.DEMO_KWARGS.items()],
                   "--data-set", "DIGITS", "--input-size", str(_D.DEMO_INPUT_SIZE), "--batch-size", "32",
                   "--unscale-lr", "--lr", "3e-3", "--warmup-epochs", "3", "--clip-grad", "1.0",
                   "--sched-on-updates", "--min-lr", "1e-5", "--aa", "none", "--color-jitter", "0",
                   "--reprob", "0", "--mixup", "0", "--cutmix", "0", "--drop-path", "0",
                   "--no-model-ema", "--num-workers", "0", "--device", "cpu", "--no-tensorboard"]


def digits_all(image_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """All 1797 DIGITS images (N, 3, S, S) float32, normalized as the demo's evaluation, and
    their labels (N,) int64 (the demo's 1497 training images, then its 300 validation ones)."""
    args = get_args_parser().parse_args(["--input-size", str(image_size)])
    t = build_transform(False, args)
    xs, ys = [], []
    for train in (True, False):
        ds = DigitsDataset(train=train, image_size=image_size, transform=t)
        xs += [ds[i][0] for i in range(len(ds))]
        ys += ds.targets
    return torch.stack(xs), torch.tensor(ys, dtype=torch.int64)


def fold_splits(labels: torch.Tensor, folds: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(train indices, validation indices) of each fold: stratified, shuffled by ``seed``; the
    validation folds partition all indices."""
    from sklearn.model_selection import StratifiedKFold

    if folds < 2:
        raise ValueError(f"crossval: folds must be >= 2, got {folds}")
    y = labels.numpy()
    skf = StratifiedKFold(n_splits=folds, shuffle=True, random_state=seed)
    return list(skf.split(np.zeros(len(y)), y))


def _train_args(bits: int | None, seed: int, epochs: int, extra=()) -> object:
    argv = DEMO_TRAIN_ARGS + ["--epochs", str(epochs), "--seed", str(seed)] + list(extra)
    if bits:
        argv += ["--mesa-bits", str(bits)]
    return resolve_args(get_args_parser().parse_args(argv))


def train_fold(x: torch.Tensor, y: torch.Tensor, train_idx, val_idx, bits: int | None, seed: int,
               epochs: int, log_path: str | None = None, extra_args=()) -> dict:
    """Train the demo model on ``x[train_idx]`` (exact, or Mesa at ``bits`` on fc, matmul, gelu,
    layernorm, softmax, attention: ``--mesa-bits``) and validate on ``x[val_idx]``. The progress
    lines of ``train_one_epoch`` go to ``log_path`` (None: discarded). Returns ``correct``
    (validation images right, int), ``n``, ``acc1`` (%), ``saved_mib`` (saved activations of a
    training step), ``step_ms`` (last epoch's mean), ``seconds``, ``params``."""
    args = _train_args(bits, seed, epochs, extra_args)
    device = torch.device(args.device)
    t0 = time.perf_counter()
    _seed(seed)  # same init for every mode
    model = build_model(args, models.demo.DEMO_NUM_CLASSES).to(device)
    train_set = torch.utils.data.TensorDataset(x[train_idx], y[train_idx])
    sampler = torch.utils.data.DistributedSampler(train_set, num_replicas=1, rank=0, shuffle=True,
                                                  seed=seed)
    loader = torch.utils.data.DataLoader(train_set, sampler=sampler, batch_size=args.batch_size,
                                         drop_last=True)
    optimizer, sched = build_optimizer(args, model, len(loader))
    criterion = torch.nn.CrossEntropyLoss()
    scaler = make_scaler(args.amp, device)
    with open(log_path or os.devnull, "w", encoding="utf-8") as f, contextlib.redirect_stdout(f):
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            stats = train_one_epoch(model, criterion, loader, optimizer, device, epoch, scaler, args.amp,
                                    max_norm=args.clip_grad, print_freq=10 ** 9,
                                    global_step=epoch * len(loader),
                                    lr_scheduler=sched if args.sched_on_updates else None)
            sched.step(epoch + 1)
    model.eval()
    with torch.no_grad():
        xv, yv = x[val_idx].to(device), y[val_idx].to(device)
        pred = torch.cat([model(c).argmax(-1) for c in xv.split(256)])
    correct = int((pred == yv).sum())
    return {"correct": correct, "n": len(val_idx), "acc1": 100.0 * correct / len(val_idx),
            "saved_mib": float(stats["saved_act_mib"]), "step_ms": float(stats["step_ms"]),
            "seconds": time.perf_counter() - t0, "params": sum(p.numel() for p in model.parameters())}


def _task_key(mode: str, seed: int, fold: int) -> str:
    return f"{mode}_s{seed}_f{fold}"


@functools.lru_cache(maxsize=1)
def _digits():
    return digits_all(models.demo.DEMO_INPUT_SIZE)


def _run_task(mode: str, arm: Arm, seed: int, fold: int, folds: int, epochs: int, stem: str | None,
              extra_args=(), threads: int | None = None) -> dict:
    """One (mode, seed, fold) run of ``arm`` (in this process or a worker of :func:`crossval`);
    written to ``stem.json`` (its log to ``stem.log``) when ``stem`` is given."""
    if threads:
        torch.set_num_threads(threads)
    x, y = _digits()
    tr, va = fold_splits(y, folds, seed)[fold]
    r = train_fold(x, y, tr, va, arm.bits, seed, arm.epochs or epochs,
                   log_path=stem + ".log" if stem else None, extra_args=tuple(extra_args) + tuple(arm.extra_args))
    r.update(mode=mode, seed=seed, fold=fold, arm=arm.describe(epochs))
    if stem:  # (written whole or not at all: a run killed here leaves no half file for --resume)
        with open(stem + ".json.tmp", "w", encoding="utf-8") as f:
            json.dump(r, f)
        os.replace(stem + ".json.tmp", stem + ".json")
    return r


def mode_seeds(modes, seeds, seeds_for: dict | None = None) -> dict:
    """{mode: its seeds}: ``seeds``, or ``seeds_for[mode]`` (a subset of ``seeds``: the first
    mode is the reference of every pair, so it runs all of them)."""
    seeds_for = dict(seeds_for or {})
    for name, items in (("modes", modes), ("seeds", seeds)):
        if len(set(items)) != len(list(items)):
            raise ValueError(f"crossval: {name} given twice: {list(items)}")
    for m, ss in seeds_for.items():
        if m not in modes:
            raise ValueError(f"crossval: seeds given for {m!r}, which is not among the modes {list(modes)}")
        if m == modes[0] and set(ss) != set(seeds):
            raise ValueError(f"crossval: {m!r} is the reference mode and runs every seed")
        if not set(ss) <= set(seeds) or not ss:
            raise ValueError(f"crossval: the seeds of {m!r} ({list(ss)}) must be a non-empty subset "
                             f"of the seeds ({list(seeds)})")
    return {m: [s for s in seeds if s in set(seeds_for.get(m, seeds))] for m in modes}


def crossval(modes=("exact", "mesa8", "mesa4", "mesa2"), seeds=(0, 1), folds: int = 5,
             epochs: int = 30, out_dir: str | None = None, resume: bool = False, progress=print,
             extra_args=(), seeds_for: dict | None = None, jobs: int = 1,
             threads: int | None = None, arms: dict | None = None) -> dict:
    """Run every (seed, fold, mode); returns {``modes``, ``seeds``, ``seeds_for`` ({mode: its
    seeds}), ``folds``, ``epochs``, ``n_images``, ``runs``: [{mode, seed, fold, correct, n, acc1,
    saved_mib, step_ms, seconds}] in (seed, fold, mode) order}. ``seeds_for`` {mode: seeds} runs a
    mode on a subset of the seeds only (the reference, the first mode, runs all). With ``out_dir``
    each run is written to ``out_dir/runs/<mode>_s<seed>_f<fold>.json`` (its log next to it);
    ``resume``: runs found there are read instead of trained. ``jobs`` > 1 trains that many runs
    at once in worker processes, each with ``threads`` threads (default 1); every run seeds
    itself, so a run's result does not depend on where it ran. ``arms`` {name: :class:`Arm`}
    defines modes beyond :data:`MODES` (bits, epochs, model arguments of their own); a run file
    found on ``resume`` that was trained otherwise than its arm says is an error."""
    arms = {**{m: Arm(b) for m, b in MODES.items()}, **(arms or {})}
    for m in modes:
        if m not in arms:
            raise ValueError(f"crossval: unknown mode {m!r}; expected one of {', '.join(arms)}")
    if jobs < 1:
        raise ValueError(f"crossval: jobs must be >= 1, got {jobs}")
    per_mode = mode_seeds(modes, seeds, seeds_for)
    y = _digits()[1]
    run_dir = os.path.join(out_dir, "runs") if out_dir else None
    if run_dir:
        os.makedirs(run_dir, exist_ok=True)
    tasks = [(mode, seed, fold) for seed in seeds for fold in range(folds) for mode in modes
             if seed in per_mode[mode]]
    done: dict[tuple, dict] = {}
    todo = []
    for t in tasks:
        stem = os.path.join(run_dir, _task_key(*t)) if run_dir else None
        if resume and stem and os.path.isfile(stem + ".json"):
            with open(stem + ".json", encoding="utf-8") as f:
                done[t] = json.load(f)
            _check_resumed(stem + ".json", done[t], arms[t[0]].describe(epochs))
            _report(progress, done[t])
        else:
            todo.append((t, stem))

    if jobs == 1:
        for (mode, seed, fold), stem in todo:
            done[(mode, seed, fold)] = _run_task(mode, arms[mode], seed, fold, folds, epochs, stem, extra_args,
                                                 threads)
            _report(progress, done[(mode, seed, fold)])
    elif todo:
        _run_pool(todo, arms, jobs, threads or 1, folds, epochs, tuple(extra_args), done, progress)
    return {"modes": list(modes), "seeds": list(seeds), "seeds_for": per_mode, "folds": folds,
            "epochs": epochs, "n_images": int(len(y)), "runs": [done[t] for t in tasks]}


def _check_resumed(path: str, run: dict, want: dict) -> None:
    """A resumed run file must have been trained as its arm says now (files written before arms
    were recorded: the plain modes only)."""
    got = run.get("arm", {"bits": want["bits"], "epochs": run.get("epochs", want["epochs"]), "extra_args": []})
    if got != want:
        raise ValueError(f"crossval --resume: {path} was trained with {got}, its mode now means {want}: "
                         "use another output directory or delete that run")


def _run_pool(todo, arms: dict, jobs: int, threads: int, folds: int, epochs: int, extra_args: tuple, done: dict,
              progress) -> None:
    """The runs of ``todo`` in ``jobs`` worker processes, into ``done``. The first failure (or
    Ctrl-C) cancels the runs not yet started and is raised once the running ones have stopped."""
    ctx = multiprocessing.get_context("spawn")
    pool = concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx)
    try:
        futures = {pool.submit(_run_task, mode, arms[mode], seed, fold, folds, epochs, stem, extra_args, threads):
                   (mode, seed, fold) for (mode, seed, fold), stem in todo}
        for fut in concurrent.futures.as_completed(futures):
            done[futures[fut]] = fut.result()
            _report(progress, done[futures[fut]])
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


def _report(progress, r: dict) -> None:
    if progress:
        progress(f"{r['mode']:>6} seed {r['seed']} fold {r['fold']}: {r['acc1']:.2f}% "
                 f"({r['correct']}/{r['n']}), {r['seconds']:.0f} s")


def summarize(res: dict) -> list[dict]:
    """Per mode: ``acc`` mean top-1 (%) over its seeds of the cross-validated accuracy, ``acc_sd``
    its sd over seeds, ``diff`` / ``diff_se`` the paired difference to the first mode (points,
    mean +- standard error over the mode's seed x fold pairs), ``pairs``, ``seeds``,
    ``saved_mib``, ``step_ms``."""
    by = {(r["mode"], r["seed"], r["fold"]): r for r in res["runs"]}
    base = res["modes"][0]
    per_mode = res.get("seeds_for") or {}
    rows = []
    for m in res["modes"]:
        seeds = per_mode.get(m, res["seeds"])
        per_seed = []
        for s in seeds:
            rs = [by[(m, s, f)] for f in range(res["folds"])]
            per_seed.append(100.0 * sum(r["correct"] for r in rs) / sum(r["n"] for r in rs))
        d = [by[(m, s, f)]["acc1"] - by[(base, s, f)]["acc1"] for s in seeds for f in range(res["folds"])]
        se = statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else float("nan")
        mine = [r for r in res["runs"] if r["mode"] == m]
        rows.append({"mode": m, "seeds": list(seeds), "acc": statistics.fmean(per_seed),
                     "acc_sd": statistics.stdev(per_seed) if len(per_seed) > 1 else float("nan"),
                     "diff": statistics.fmean(d), "diff_se": se, "pairs": len(d),
                     "saved_mib": statistics.median(r["saved_mib"] for r in mine),
                     "step_ms": statistics.median(r["step_ms"] for r in mine)})
    return rows


def _seed_list(seeds) -> str:
    """0 1 2 -> '0-2'; 0 2 5 -> '0 2 5'."""
    seeds = list(seeds)
    if len(seeds) > 2 and seeds == list(range(seeds[0], seeds[0] + len(seeds))):
        return f"{seeds[0]}-{seeds[-1]}"
    return " ".join(map(str, seeds))


def format_results(res: dict) -> str:
    """The summary as a markdown table, with what it was run with."""
    rows = summarize(res)
    base = rows[0]
    lines = [f"Demo DeiT on DIGITS ({res['n_images']} images), {res['folds']}-fold cross-validation x "
             f"seeds, {res['epochs']} epochs; differences paired by fold and seed, +- standard error "
             "over the pairs:",
             "",
             f"| mode | seeds | top-1 (mean over seeds) | sd over seeds | vs {base['mode']} (points) | pairs | "
             "saved activations / step | step time |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        diff = "" if r is base else f"{r['diff']:+.2f} +- {r['diff_se']:.2f}"
        pairs = "" if r is base else str(r["pairs"])
        lines.append(f"| {r['mode']} | {_seed_list(r['seeds'])} | {r['acc']:.2f}% | {r['acc_sd']:.2f} | {diff} | "
                     f"{pairs} | {r['saved_mib']:.2f} MiB ({r['saved_mib'] / base['saved_mib']:.3f}x) | "
                     f"{r['step_ms']:.1f} ms |")
    return "\n".join(lines)


def plot(res: dict, path: str) -> str | None:
    """Accuracy (mean, +- the paired standard error) against saved activation bytes per step, to
    ``path`` (PNG); returns the path, or None (with no error) when matplotlib is not installed."""
    try:
        plt = agg_pyplot()
    except ImportError:
        return None
    rows = summarize(res)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for r in rows:
        err = 0.0 if r is rows[0] else r["diff_se"]
        ax.errorbar(r["saved_mib"], r["acc"], yerr=err, fmt="o", capsize=3)
        ax.annotate(r["mode"], (r["saved_mib"], r["acc"]), textcoords="offset points", xytext=(5, 5))
    ax.set_xlabel("saved activations per training step (MiB)")
    ax.set_ylabel("top-1 (%), cross-validated")
    ax.set_title(f"DIGITS, {res['folds']}-fold x up to {len(res['seeds'])} seeds, {res['epochs']} epochs",
                 fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
