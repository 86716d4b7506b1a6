"""The demo's comparison table from the ``log.txt`` of finished runs.

    python -m training.report exact=outputs/demo/exact mesa8=outputs/demo/mesa8
    python -m training.report exact/s0=... exact/s1=... mesa8/s0=... mesa8/s1=...

prints, per run: best and final top-1 accuracy, the bytes autograd held for backward in one
training step (``SavedActivationMeter``), the mean step time (forward + backward + update, data
loading excluded, over the last epoch) and the peak memory; ratios are to the first run. Runs
labelled ``GROUP/NAME`` (e.g. one per seed) are also summarised per group: mean final top-1 with its
range, mean best top-1, and the difference of each group's mean to the first group's.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

__all__ = ["main", "read_log", "table"]


def read_log(output_dir: str) -> list[dict]:
    path = os.path.join(output_dir, "log.txt")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no log (did the run finish an epoch?)")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def table(runs: dict[str, str]) -> str:
    """A markdown table of the runs ``{label: output_dir}``."""
    rows, base = [], None
    for label, folder in runs.items():
        log = read_log(folder)
        last = log[-1]
        r = {"label": label, "epochs": last["epoch"] + 1, "final": last["test_acc1"],
             "best": last["max_accuracy"], "saved": last["train_saved_act_mib"],
             "step": last["train_step_ms"], "mem": last["train_max_mem_mb"]}
        base = base or r
        rows.append(r)
    out = ["| run | epochs | top-1 final (best) | saved activations / step | step time | peak memory |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['label']} | {r['epochs']} | {r['final']:.2f}% ({r['best']:.2f}%) | "
                   f"{r['saved']:.2f} MiB ({r['saved'] / base['saved']:.3f}x) | "
                   f"{r['step']:.1f} ms ({r['step'] / base['step']:.2f}x) | {r['mem']:.0f} MiB |")
    groups: dict[str, list[dict]] = {}
    for r in rows:
        if "/" in r["label"]:
            groups.setdefault(r["label"].split("/", 1)[0], []).append(r)
    if groups:
        first = None
        out += ["", "| group | runs | top-1 final: mean (min - max) | vs first group | top-1 best: mean |",
                "|---|---|---|---|---|"]
        for name, rs in groups.items():
            finals = [r["final"] for r in rs]
            mean = sum(finals) / len(finals)
            first = mean if first is None else first
            best = sum(r["best"] for r in rs) / len(rs)
            out.append(f"| {name} | {len(rs)} | {mean:.2f}% ({min(finals):.2f} - {max(finals):.2f}) | "
                       f"{mean - first:+.2f} points | {best:.2f}% |")
    return "\n".join(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", metavar="LABEL=OUTPUT_DIR")
    a = ap.parse_args(argv)
    runs = {}
    for item in a.runs:
        label, sep, folder = item.partition("=")
        if not sep:
            ap.error(f"expected LABEL=OUTPUT_DIR, got {item!r}")
        runs[label] = folder
    try:
        print(table(runs))
    except (FileNotFoundError, KeyError, ValueError) as exc:
        sys.exit(f"error: {exc}")


if __name__ == "__main__":
    main()
