"""The paper's second claim measured: an activation budget re-invested in a larger model.

    .venv/bin/python tools/reinvest.py --budget-steps 1 2 --seeds 0 1 2 --jobs 2 --plot docs/reinvest.png

Per budget (what exact saves at the given depth / width step of the demo DeiT, batch 32, as an
audit of one training forward counts it): exact at the largest model that fits against Mesa 8-bit at its larger
one, same epochs, and Mesa for exact's training time; the demo on all 1797 DIGITS images, k-fold
cross-validation x seeds, differences paired by fold and seed (benchmarks/reinvest.py). Writes
``<out>/results.json``, ``<out>/table.md``, the run files (``--resume`` reuses them) and, with
``--plot``, accuracy against the budget (``--markdown``: the table to a file too).
"""
from __future__ import annotations

import argparse
import json
import os
import time

from benchmarks import reinvest as R


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--axis", default="depth", choices=R.AXES, help="the dimension the model grows along")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--budget-steps", nargs="+", type=int, default=[1, 2], metavar="K",
                   help="budgets: what exact saves at these steps along --axis (default 1 2)")
    g.add_argument("--budget-mib", nargs="+", type=float, default=None, metavar="MIB",
                   help="budgets in MiB of saved activations per step at batch 32")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--jobs", type=int, default=1, help="runs trained at once (one thread each)")
    ap.add_argument("--out", default="outputs/reinvest")
    ap.add_argument("--resume", action="store_true", help="reuse the runs (and step times) already in --out")
    ap.add_argument("--plot", default="", help="PNG: top-1 against the budget, one line per method")
    ap.add_argument("--markdown", default="", help="write the table (and the command's settings) to this file too")
    args = ap.parse_args(argv)
    if args.folds < 2 or args.epochs < 1 or args.jobs < 1:
        ap.error("--folds must be >= 2, --epochs and --jobs >= 1")
    if args.budget_mib is None and min(args.budget_steps) < 1:
        ap.error("--budget-steps must be >= 1")
    if args.budget_mib is not None and min(args.budget_mib) <= 0:
        ap.error("--budget-mib must be > 0")
    start = time.time()
    try:
        res = R.run(args.budget_steps, args.axis, args.seeds, args.folds, args.epochs, out_dir=args.out,
                    resume=args.resume, jobs=args.jobs,
                    budgets_bytes=[m * 2 ** 20 for m in args.budget_mib] if args.budget_mib else None)
    except ValueError as exc:
        ap.error(str(exc))
    res["wall_seconds"] = time.time() - start
    table = R.format_table(res)
    lines = R.summary_lines(res)
    print()
    print(table)
    print("\n".join(lines))
    print(f"{res['wall_seconds']:.0f} s for {len(res['runs'])} runs, {args.jobs} at a time")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w", encoding="utf-8") as f:
        json.dump({**res, "summary": R.summarize(res)}, f, indent=1)
    with open(os.path.join(args.out, "table.md"), "w", encoding="utf-8") as f:
        f.write(table + "\n")
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write(f"{table}\n\n" + "".join(f"* {line}\n" for line in lines) + f"\n{res['wall_seconds']:.0f} s for {len(res['runs'])} runs, {args.jobs} at a time; "
                    f"step times of the exact / Mesa models measured side by side: " + "; ".join(
                        f"B{i} {p['t_exact'] * 1e3:.1f} / {p['t_mesa8'] * 1e3:.1f} ms" for i, p in enumerate(res["plan"]))
                    + "\n")
    if args.plot:
        png = R.plot(res, args.plot)
        print(f"wrote {png}" if png else "matplotlib is not installed: no plot")
    return res


if __name__ == "__main__":
    main()
