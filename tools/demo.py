"""Demo: a 2-block DeiT-Ti-width model trained a few steps exact and with Mesa (8 and 4 bits),
from the same init on the same batches; prints loss, saved-activation memory and step time."""
from __future__ import annotations

import argparse

import torch

from mesa_ops import bench


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--bits", default="8,4")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    rows = bench.train_compare(tuple(int(b) for b in args.bits.split(",")), depth=args.depth,
                               batch=args.batch, steps=args.steps, device=args.device)
    print(f"DeiT-Ti-width model, {args.depth} blocks, batch {args.batch}, 197 tokens, "
          f"{args.steps} AdamW steps on {args.device}")
    print("| mode | loss first -> last | saved activations | step time |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['first_loss']:.3f} -> {r['final_loss']:.3f} | "
              f"{r['saved_bytes'] / 2**20:.2f} MiB ({r['bytes_ratio']:.3f}x) | "
              f"{r['step_ms']:.1f} ms ({r['time_ratio']:.2f}x) |")


if __name__ == "__main__":
    main()
