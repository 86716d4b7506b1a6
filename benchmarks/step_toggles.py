"""Which part of Mesa's CPU step time comes from which setting (issue 38, item 4): exact, Mesa 8-bit,
Mesa 8-bit with the prefix-token rows stored in the patch tokens' ranges (``prefix_tokens=0``,
before issue 22.8) and Mesa 8-bit with running ranges only (``range_mode='ema'``: the fused
attention then reruns its forward in backward), built side by side and stepped in turn in one
process (so load from elsewhere hits them alike), median step time and its ratio to exact.

    .venv/bin/python -m benchmarks.step_toggles --model deit_tiny_patch16_224 --batch-size 8 --steps 40
"""
from __future__ import annotations

import argparse
import statistics

import torch

from mesa_ops.bench import time_in_turn
from mesa_ops.fidelity import set_range_mode
from mesa_ops.quant import set_prefix_tokens

from .models import Config, _setup

__all__ = ["VARIANTS", "measure", "main"]

VARIANTS = ("exact", "mesa8", "mesa8-noprefix", "mesa8-ema")


def measure(model: str, batch: int, steps: int, warmup: int = 2, variants=VARIANTS) -> dict:
    """{variant: [step seconds]} of ``variants`` (of :data:`VARIANTS`), stepped in turn."""
    stepper = {}
    for name in variants:
        net, _, _, step = _setup(Config(model=model, mode="exact" if name == "exact" else "mesa8", batch=batch))
        if name == "mesa8-noprefix":
            set_prefix_tokens(net, 0)
        elif name == "mesa8-ema":
            set_range_mode(net, "ema")
        stepper[name] = step
    return time_in_turn(stepper, warmup, steps)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="deit_tiny_patch16_224")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    args = ap.parse_args(argv)
    times = measure(args.model, args.batch_size, args.steps, variants=args.variants)
    ref = statistics.median(times[args.variants[0]])
    print(f"# {args.model}, batch {args.batch_size}, CPU {torch.get_num_threads()} threads, fp32, median of "
          f"{args.steps} steps in turn; ratios to {args.variants[0]}")
    print("| variant | step ms | ratio | min - max ms |\n|---|---|---|---|")
    for n, t in times.items():
        m = statistics.median(t)
        print(f"| {n} | {m * 1e3:.1f} | {m / ref:.3f}x | {min(t) * 1e3:.0f} - {max(t) * 1e3:.0f} |")
    return times


if __name__ == "__main__":
    main()
