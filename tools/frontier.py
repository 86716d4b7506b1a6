"""The memory/time frontier: Mesa and its planner against PyTorch's checkpointing, selective
checkpointing and torch.compile's memory budget (``benchmarks.frontier``).

    OMP_NUM_THREADS=2 .venv/bin/python tools/frontier.py --model deit_small_patch16_224 \
        --batch-size 8 --markdown frontier.md --plot frontier.png

Prints one table per model: saved-for-backward bytes and step time of every mode, as ratios to
exact training, ``*`` on the modes no other mode beats on both. ``--modes`` picks modes
(default: all; ``--no-compile`` leaves out the torch.compile ones, which compile for a minute or
more each on a CPU).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from dataclasses import asdict

import torch
from timm.utils import ParseKwargs

from benchmarks import frontier as F


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", nargs="+", default=["deit_small_patch16_224"])
    ap.add_argument("--modes", default="", help="comma-separated (default: " + ",".join(F.default_modes()) + ")")
    ap.add_argument("--no-compile", action="store_true", help="leave out the torch.compile modes")
    ap.add_argument("--model-kwargs", nargs="*", default={}, action=ParseKwargs, metavar="KEY=VALUE",
                    help="model constructor arguments (e.g. window_size=4 for Swin at another input size)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--input-size", type=int, default=224)
    ap.add_argument("--steps", type=int, default=5, help="timed steps (median) after --warmup")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--markdown", default="")
    ap.add_argument("--json", default="")
    ap.add_argument("--plot", default="", help="PNG: saved bytes against step time, one panel per model")
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m] or F.default_modes()
    if args.no_compile:
        modes = [m for m in modes if "compile@" not in m]
    rows = []
    for name in args.model:
        print(f"{name}: {len(modes)} modes ...", file=sys.stderr, flush=True)
        try:
            rows += F.frontier(name, modes, args.batch_size, args.input_size, args.warmup, args.steps,
                               model_kwargs=args.model_kwargs)
        except (RuntimeError, ValueError) as exc:
            sys.exit(f"error: {exc}")
    head = (f"# {platform.processor() or platform.machine()} cpu x{torch.get_num_threads()}, torch "
            f"{torch.__version__}, batch {args.batch_size}, {args.input_size}px, fp32, SGD, median of "
            f"{args.steps} steps after {args.warmup}")
    text = head + "\n" + F.markdown(rows)
    print(text)
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    if args.plot:
        F.plot(rows, args.plot)


if __name__ == "__main__":
    main()
