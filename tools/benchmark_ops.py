"""Forward+backward time and saved-activation bytes of each Mesa layer and of a DeiT-style block,
exact vs Mesa at 8/4/2 bits, as a markdown table.

    .venv/bin/python tools/benchmark_ops.py                 # CPU, DeiT-Ti width, batch 8
    .venv/bin/python tools/benchmark_ops.py --device cuda --batch 64 --precision bf16
"""
from __future__ import annotations

import argparse
import json
import platform

import torch

from mesa_ops import bench

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=197)
    ap.add_argument("--dim", type=int, default=192)
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--bits", default="8,4,2", help="comma-separated bit widths")
    ap.add_argument("--steps", type=int, default=10, help="timed steps (median) after 3 warm-up")
    ap.add_argument("--precision", choices=sorted(PRECISIONS), default="fp32")
    ap.add_argument("--only", default="", help="substring filter on case names (e.g. Block)")
    ap.add_argument("--json", default="", help="also write the rows to this JSON file")
    args = ap.parse_args(argv)

    bits = tuple(int(b) for b in args.bits.split(",") if b)
    cases = [c for c in bench.op_cases(args.batch, args.tokens, args.dim, args.heads)
             if args.only.lower() in c.name.lower()]
    rows = []
    for case in cases:
        rows += bench.compare(case, bits, args.device, args.steps, PRECISIONS[args.precision])
    print(f"# {platform.node()} {args.device} torch {torch.__version__} threads "
          f"{torch.get_num_threads()} precision {args.precision} batch {args.batch}")
    print(bench.format_table(rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
