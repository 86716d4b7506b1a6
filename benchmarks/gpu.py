"""The GPU table: exact vs Mesa 8-bit per model, batch and precision, beside the paper's memory.

The paper's figures (Pan et al., arXiv 2111.11124; the ziplab/Mesa README table: batch 128,
224 px, AMP, one RTX 3090, ``torch.cuda.max_memory_allocated``) are :data:`PAPER_MB`, MB as that
README prints them (2**20 bytes). Our ``peak MiB`` is ``max_memory_allocated`` over training
steps of the model built here (parameters, gradients, SGD-with-momentum state, activations): at
batch 128 the columns compare like for like up to the optimizer state (the paper trained with
AdamW: one more parameter-sized state, 22 MB for DeiT-Ti, 88 MB for DeiT-S).
"""
from __future__ import annotations

import math

# model -> (exact MB, Mesa MB) at batch 128, AMP fp16
PAPER_MB = {
    "deit_tiny_patch16_224": (4171, 1858),
    "deit_small_patch16_224": (8459, 3840),
    "deit_base_patch16_224": (17691, 8616),
    "swin_tiny_patch4_window7_224": (11812, 5371),
    "pvt_tiny": (7800, 3782),
}


def _mib(r) -> float:
    return r["peak_bytes"] / 2**20


def _ips(r) -> float:
    t = r["step_time_s"]
    return r["batch"] / t if t and not math.isnan(t) else float("nan")


def paper_table(rows: list[dict]) -> str:
    """Markdown: one row per (model, precision, batch) with exact and ``mesa8`` records (dicts of
    :class:`benchmarks.models.Record` fields): peak MiB, the ratio, img/s, and the paper's
    exact and Mesa MB at batch 128 (fp16; '-' elsewhere)."""
    by_key: dict = {}
    for r in rows:
        by_key.setdefault((r["model"], r["precision"], r["batch"]), {})[r["mode"]] = r
    cols = ["model", "precision", "batch", "exact MiB", "mesa8 MiB", "mesa8 / exact",
            "paper exact MB", "paper Mesa MB", "paper ratio", "exact img/s", "mesa8 img/s",
            "speed ratio"]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for (model, prec, batch), modes in sorted(by_key.items()):
        e, m = modes.get("exact"), modes.get("mesa8")
        if e is None or m is None:
            continue
        oom = e.get("oom") or m.get("oom")
        paper = PAPER_MB.get(model) if batch == 128 and prec == "fp16" else None
        cells = [model, prec, str(batch),
                 "OOM" if e.get("oom") else f"{_mib(e):.0f}",
                 "OOM" if m.get("oom") else f"{_mib(m):.0f}",
                 "-" if oom else f"{_mib(m) / _mib(e):.3f}",
                 *(("-", "-", "-") if paper is None else
                   (str(paper[0]), str(paper[1]), f"{paper[1] / paper[0]:.3f}")),
                 "-" if e.get("oom") else f"{_ips(e):.0f}",
                 "-" if m.get("oom") else f"{_ips(m):.0f}",
                 "-" if oom else f"{_ips(m) / _ips(e):.3f}"]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)
