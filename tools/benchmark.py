"""Memory and speed of whole models, exact vs Mesa vs activation checkpointing, side by side.

    .venv/bin/python tools/benchmark.py --model deit_tiny_patch16_224 --batch-size 4 \
        --modes exact,mesa8,mesa8+cckpt --steps 3 --json bench.json --plot bench.png
Memory: each configuration in a fresh worker process (peak RSS on CPU is then its own). CPU step
times: one worker per model builds all its modes and steps them in turn (``--sequential``: one
worker per configuration).
"""
from __future__ import annotations

import argparse
import csv
import json
import platform
import sys
from dataclasses import asdict

import torch
from tqdm import tqdm

from benchmarks import models as B
from benchmarks.gpu import paper_table


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", nargs="+", default=["deit_tiny_patch16_224"],
                    help="registered model name(s) (see models.list_models())")
    ap.add_argument("--modes", default="exact,exact-explicit,mesa8,mesa8-explicit,mesa4,ckpt,mesa8+cckpt")
    ap.add_argument("--batch-size", type=int, nargs="+", default=[8])
    ap.add_argument("--input-size", type=int, default=224)
    ap.add_argument("--precision", choices=sorted(B.PRECISIONS), nargs="+", default=["fp32"])
    ap.add_argument("--steps", type=int, default=5, help="timed steps (median) after --warmup")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--budget-gb", type=float, default=0.0,
                    help="also search the largest batch whose peak memory fits this budget")
    ap.add_argument("--max-batch", type=int, default=2048)
    ap.add_argument("--optimizer", choices=B.OPTIMIZERS, default="sgd",
                    help="sgd (momentum) or adamw (the paper's, as scripts/cuda_check.sh measures)")
    ap.add_argument("--lora", type=int, default=0, metavar="RANK",
                    help="LoRA fine-tuning (peft) at this rank on qkv, proj, fc1, fc2, the rest "
                         "frozen (LowMemoryBP's ViT setting: 4); needs peft")
    ap.add_argument("--dry-run", action="store_true",
                    help="build every (model, mode) and step it once at batch 1 on the CPU; write "
                         "the output files with no figures (scripts/cuda_check.sh --rehearse)")
    ap.add_argument("--json", default="")
    ap.add_argument("--markdown", default="", help="write the printed table(s) to this file too")
    ap.add_argument("--csv", default="")
    ap.add_argument("--plot", default="", help="PNG path for memory/time bar charts")
    ap.add_argument("--in-process", action="store_true",
                    help="CUDA: measure every configuration in this process, one after the other "
                         "(max_memory_allocated is reset for each; no worker start-up per row)")
    ap.add_argument("--paper", action="store_true",
                    help="also print exact vs mesa8 beside the paper's memory column (benchmarks.gpu)")
    ap.add_argument("--sequential", action="store_true",
                    help="CPU: time each configuration in its own worker instead of stepping a "
                         "model's modes in turn in one worker (the default, robust to other load)")
    args = ap.parse_args(argv)

    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in B.MODES]
    if bad:
        ap.error(f"unknown mode(s) {bad}; choose from {', '.join(B.MODES)}")
    if args.in_process and not args.device.startswith("cuda") and not args.dry_run:
        ap.error("--in-process measures CUDA memory only; on CPU each configuration needs its own "
                 "process (peak RSS)")
    configs = [B.Config(m, md, bs, args.input_size, prec, args.steps, args.warmup, args.device,
                        optimizer=args.optimizer, lora=args.lora)
               for prec in args.precision for bs in args.batch_size for m in args.model for md in modes]
    records, budgets = [], {}
    if args.dry_run:
        records = [B.dry_run(cfg) for cfg in configs]
    elif args.in_process:
        records = [B.measure_fresh(cfg) for cfg in tqdm(configs, desc="configurations", file=sys.stderr,
                                                         disable=not sys.stderr.isatty())]
    elif args.device == "cpu" and not args.sequential:
        for name in tqdm(args.model, desc="models", file=sys.stderr):
            records += B.run_interleaved([c for c in configs if c.model == name])
    else:
        records = [B.run_in_worker(cfg) for cfg in tqdm(configs, desc="configurations", file=sys.stderr)]
    for cfg in configs:
        if args.budget_gb and not args.dry_run:
            budgets[(cfg.model, cfg.mode)] = B.largest_batch(cfg, int(args.budget_gb * 2**30),
                                                             args.max_batch)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") and not args.dry_run else \
        (platform.processor() or platform.machine())
    head = (f"# {device} {args.device}, torch {torch.__version__}, batch "
            f"{' '.join(map(str, args.batch_size))}, {args.input_size}px, {' '.join(args.precision)}, "
            f"{args.optimizer}, median of {args.steps} steps after {args.warmup}"
            + (f", budget {args.budget_gb} GB" if args.budget_gb else "")
            + (" (dry run: built and stepped once on the CPU at batch 1; no figures)" if args.dry_run else ""))
    text = [head, B.markdown_table(records, budgets or None)]
    rows = [dict(asdict(r), largest_batch=budgets.get((r.model, r.mode))) for r in records]
    if args.paper:
        text += ["", paper_table(rows)]
    print("\n".join(text))
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write("\n".join(text) + "\n")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    if args.csv:
        keys = [k for k in rows[0] if k != "by_type"]
        with open(args.csv, "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
    if args.plot:
        B.plot(records, args.plot)


if __name__ == "__main__":
    main()
