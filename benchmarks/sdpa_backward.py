"""Step time and saved bytes of the range rules and the fused attention's backward (issue 20).

    python -m benchmarks.sdpa_backward [--model deit_tiny_patch16_224] [--img 224] [--batch 8]
        [--rounds 12]

One model at 8 bits (``mesa8``), the same weights and batch, three configurations:

* ``paper``: the paper's clip (``range_mode`` 'ema') and the fused backward from the forward's
  logsumexp (``consistent_backward`` False) -- the code before issue 20;
* ``default``: ``range_mode`` 'union' and ``consistent_backward`` None (auto: no rerun there);
* ``consistent``: 'union' with the forward rerun on the stored q, k, v in backward.

Each round times one training step (forward, backward, an SGD step) of every configuration in
turn (the order rotating), so slow phases of the machine hit all three; prints the median step time, its ratio to
``paper`` (median of the per-round ratios, with their range) and the bytes saved for backward
(``ms.SavedActivationMeter``).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import mesa_ops as ms

MiB = 2.0 ** 20
CONFIGS = {"paper": ("ema", False), "default": ("union", None), "consistent": ("union", True)}


def _configure(model, range_mode: str, consistent) -> None:
    for m in model.modules():
        if isinstance(m, ms.QuantMixin):
            m.range_mode = range_mode
        if isinstance(m, ms.SDPA):
            m.range_mode, m.consistent_backward = range_mode, consistent


def measure(name: str, img: int = 224, batch: int = 8, rounds: int = 12, seed: int = 0) -> list[dict]:
    import models

    torch.manual_seed(seed)
    built = {}
    for label, (rule, consistent) in CONFIGS.items():
        torch.manual_seed(seed)
        model = models.create_model(name, ms_policy="mesa8", drop_path_rate=0.0, img_size=img).train()
        _configure(model, rule, consistent)
        built[label] = (model, torch.optim.SGD(model.parameters(), lr=1e-4))
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, 3, img, img, generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)

    def step(label: str, meter: bool = False):
        model, opt = built[label]
        opt.zero_grad(set_to_none=True)
        t = time.perf_counter()
        if meter:
            with ms.SavedActivationMeter(model) as m:
                loss = torch.nn.functional.cross_entropy(model(x), y)
        else:
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return time.perf_counter() - t, (m.total_bytes if meter else None)

    saved = {label: step(label, meter=True)[1] for label in CONFIGS}
    for label in CONFIGS:  # warm-up
        step(label)
    times = {label: [] for label in CONFIGS}
    order = list(CONFIGS)
    for i in range(rounds):  # (the order rotates from round to round: no position effect)
        for label in order[i % 3:] + order[:i % 3]:
            times[label].append(step(label)[0])
    rows = []
    for label in CONFIGS:
        ratios = [a / b for a, b in zip(times[label], times["paper"])]
        rows.append({"model": name, "config": label, "range_mode": CONFIGS[label][0],
                     "consistent_backward": CONFIGS[label][1], "step_s": statistics.median(times[label]),
                     "time_x": statistics.median(ratios), "time_x_min": min(ratios),
                     "time_x_max": max(ratios), "saved_mib": saved[label] / MiB,
                     "saved_x": saved[label] / saved["paper"]})
    return rows


def format_table(rows: list[dict], rounds: int) -> str:
    lines = [f"| model | config | range_mode | consistent_backward | step s (median of {rounds}) | "
             "time x paper (median, range of rounds) | saved MiB | saved x paper |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['config']} | {r['range_mode']} | {r['consistent_backward']} | "
                     f"{r['step_s']:.3f} | {r['time_x']:.3f} ({r['time_x_min']:.2f}-{r['time_x_max']:.2f}) | "
                     f"{r['saved_mib']:.2f} | {r['saved_x']:.4f} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", nargs="+", default=["deit_tiny_patch16_224"])
    ap.add_argument("--img", type=int, default=224)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=12)
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.batch < 1:
        ap.error("--rounds and --batch must be >= 1")
    rows = []
    for name in args.model:
        rows += measure(name, args.img, args.batch, args.rounds)
    print(f"{args.img} px, batch {args.batch}, fp32, {torch.get_num_threads()} threads, {args.rounds} "
          "interleaved rounds:")
    print(format_table(rows, args.rounds))
    return rows


if __name__ == "__main__":
    main()
