"""Stock timm models under ``mesa_ops.compress`` next to this repo's own models: saved bytes and
train-step time vs exact (fp32, CPU unless CUDA is the default device).

    .venv/bin/python tools/compress_bench.py --batch-size 4 --steps 3
"""
from __future__ import annotations

import argparse

import torch

import models  # noqa: F401  (registers this repo's models with timm as mesa_<name>)
from mesa_ops.bench import bench

PAIRS = [("vit_small_patch16_224", "deit_small_patch16_224"),
         ("swin_tiny_patch4_window7_224", "swin_tiny_patch4_window7_224"),
         ("pvt_v2_b1", "pvt_tiny")]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--input-size", type=int, default=224)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--policy", default="mesa8")
    ap.add_argument("--pairs", nargs="*", default=None, 
                    help="timm:ours pairs, e.g. vit_small_patch16_224:deit_small_patch16_224")
    args = ap.parse_args(argv)
    pairs = [tuple(p.split(":")) for p in args.pairs] if args.pairs else PAIRS
    torch.manual_seed(0)
    print(f"# {args.policy}, batch {args.batch_size}, {args.input_size} px, fp32, cpu threads "
          f"{torch.get_num_threads()}, median of {args.steps} interleaved steps")
    print("| model | source | params M | saved exact MiB | saved mesa MiB | saved x | step exact s "
          "| step mesa s | time x |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for timm_name, ours in pairs:
        for name, src in ((f"timm:{timm_name}", "timm + compress"), (ours, "this repo")):
            r = bench(name, args.policy, args.batch_size, args.input_size, args.steps)
            rows.append(r)
            print(f"| {name.removeprefix('timm:')} | {src} | {r['params_m']:.1f} | "
                  f"{r['saved_exact'] / 2**20:.1f} | {r['saved_mesa'] / 2**20:.1f} | "
                  f"{r['saved_mesa'] / r['saved_exact']:.3f} | {r['step_exact']:.3f} | "
                  f"{r['step_mesa']:.3f} | {r['step_mesa'] / r['step_exact']:.2f} |", flush=True)
    return rows


if __name__ == "__main__":
    main()
