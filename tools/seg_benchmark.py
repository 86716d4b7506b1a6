"""Saved activations and CPU/GPU step time of one segmentation train iteration, Mesa 8-bit vs off
(benchmarks.seg.train_step_stats), printed as a table:

    python tools/seg_benchmark.py --crop 512 --batch 2
"""
from __future__ import annotations

import argparse
import os

import torch

from benchmarks.seg import train_step_stats

DEFAULT_CONFIGS = ["configs/seg/fpn_pvt-tiny-mesa8_8xb4-40k_ade20k-512x512.py",
                   "configs/seg/upernet_swin-tiny-patch4-window7-mesa8_8xb2-160k_ade20k-512x512.py"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, help="-mesa8 configs of configs/seg/")
    ap.add_argument("--crop", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2, help="images per step (UperNet's BN needs >= 2)")
    ap.add_argument("--steps", type=int, default=1,
                    help="timed train iterations per mode (median), after one metered warm-up iteration")
    args = ap.parse_args(argv)
    print(f"# train iteration (forward, loss, backward, AdamW), crop {args.crop}, batch {args.batch}, "
          f"saved bytes of a metered warm-up step, median time of {args.steps} step(s), "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, cpu")
    print("| config | mode | saved MiB (whole step) | x | saved MiB (backbone + image) | x | step s | x |")
    print("|---|---|---|---|---|---|---|---|")
    for config in args.configs:
        on = train_step_stats(config, crop=args.crop, batch=args.batch, mesa=True, steps=args.steps)
        off = train_step_stats(config, crop=args.crop, batch=args.batch, mesa=False, steps=args.steps,
                               model=on["model"])
        name = os.path.basename(config).split("_8x")[0].replace("-mesa8", "")
        for label, r in (("exact", off), ("mesa8", on)):
            print(f"| {name} | {label} | {r['saved_bytes'] / 2**20:.1f} | "
                  f"{r['saved_bytes'] / off['saved_bytes']:.3f} | {r['backbone_saved_bytes'] / 2**20:.1f} | "
                  f"{r['backbone_saved_bytes'] / off['backbone_saved_bytes']:.3f} | {r['step_s']:.2f} | "
                  f"{r['step_s'] / off['step_s']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
