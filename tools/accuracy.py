"""Accuracy benchmark: the demo DeiT on DIGITS, k-fold cross-validation x seeds, exact and Mesa.

    .venv/bin/python tools/accuracy.py --folds 5 --seeds 0 1 --epochs 30 --out outputs/accuracy
    .venv/bin/python tools/accuracy.py --seeds $(seq 0 29) --seeds-for mesa4=0-2 mesa2=0-2 --jobs 2

Every image is validated once per seed; each mode trains from the same initial weights and
batch order per (seed, fold); prints the mean top-1 per mode and the paired difference to the
first mode +- its standard error (``training.crossval``), writes ``<out>/results.json``, the
table (``<out>/table.md``) and a plot of accuracy against saved bytes (``<out>/accuracy.png``,
when matplotlib is installed). ``scripts/accuracy.sh`` runs it.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from training import crossval as cv


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", nargs="+", default=list(cv.MODES), choices=list(cv.MODES),
                    help="the first is the reference of the paired differences")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--out", default="outputs/accuracy")
    ap.add_argument("--resume", action="store_true", help="reuse the runs already in --out")
    ap.add_argument("--seeds-for", nargs="+", default=[], metavar="MODE=SEEDS",
                    help="run a mode on some of the seeds only, e.g. mesa4=0,1,2 (or mesa4=0-2)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="runs trained at once, in worker processes of --threads threads each (default 1)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (per job)")
    args = ap.parse_args(argv)
    try:
        pairs = [_mode_seeds(item) for item in args.seeds_for]
        seeds_for = dict(pairs)
        if len(seeds_for) < len(pairs):
            raise ValueError("--seeds-for: a mode is given twice")
        cv.mode_seeds(args.modes, args.seeds, seeds_for)
    except ValueError as e:
        ap.error(str(e))
    if args.folds < 2 or args.epochs < 1:
        ap.error("--folds must be >= 2 and --epochs >= 1")
    if args.jobs < 1:
        ap.error("--jobs must be >= 1")
    os.makedirs(args.out, exist_ok=True)
    start = time.time()
    res = cv.crossval(args.modes, args.seeds, args.folds, args.epochs, out_dir=args.out,
                      resume=args.resume, seeds_for=seeds_for, jobs=args.jobs, threads=args.threads)
    res["wall_seconds"] = time.time() - start
    table = cv.format_results(res)
    print()
    print(table)
    threads = (args.threads or 1) if args.jobs > 1 else torch.get_num_threads()
    print(f"{res['wall_seconds']:.0f} s for {len(res['runs'])} runs, {args.jobs} at a time, "
          f"{threads} thread{'s' * (threads > 1)} each")
    with open(os.path.join(args.out, "results.json"), "w", encoding="utf-8") as f:
        json.dump({**res, "summary": cv.summarize(res)}, f, indent=1)
    with open(os.path.join(args.out, "table.md"), "w", encoding="utf-8") as f:
        f.write(table + "\n")
    png = cv.plot(res, os.path.join(args.out, "accuracy.png"))
    print(f"wrote {png}" if png else "matplotlib is not installed: no plot")
    return res


def _mode_seeds(item: str) -> tuple[str, list[int]]:
    """'mesa4=0,1,2' or 'mesa4=0-2' -> ('mesa4', [0, 1, 2])."""
    mode, sep, spec = item.partition("=")
    if not sep or not mode or not spec:
        raise ValueError(f"--seeds-for: expected MODE=SEEDS (e.g. mesa4=0,1,2), got {item!r}")
    seeds: list[int] = []
    try:
        for part in spec.split(","):
            lo, dash, hi = part.partition("-")
            seeds += list(range(int(lo), int(hi) + 1)) if dash else [int(lo)]
    except ValueError:
        raise ValueError(f"--seeds-for: {spec!r} is not a list of seeds (e.g. 0,1,2 or 0-2)") from None
    return mode, seeds


if __name__ == "__main__":
    main()
