"""The GPU check's pieces (scripts/cuda_check.sh): the table beside the paper's memory column, the
kernels' self-check on the device, and the collection of the CUDA test files.

The paper's figures (Pan et al., arXiv 2111.11124; the ziplab/Mesa README table: batch 128,
224 px, AMP, one RTX 3090, ``torch.cuda.max_memory_allocated``, its issue #2) are
:data:`PAPER_MB`, MB as that README prints them (2**20 bytes). The paper's baseline and Mesa both
spell attention out (q@k, softmax, attn@v as separate ops): our ``exact-explicit`` and
``mesa8-explicit`` modes are that setting like for like (AdamW as the paper trained with,
``--optimizer adamw``), ``exact`` (PyTorch's fused attention) and ``mesa8`` (Mesa on the fused
attention, :class:`mesa_ops.SDPA`) stand beside them.

    python -m benchmarks.gpu --self-check          # every dtype x bits on this GPU (exit 1 on a mismatch)
    python -m benchmarks.gpu --collect FILES...    # the CUDA-marked tests of FILES collect (exit 1 if none)
"""
from __future__ import annotations

import argparse
import math
import sys

# model -> (exact MB, Mesa MB) at batch 128, AMP fp16
PAPER_MB = {
    "deit_tiny_patch16_224": (4171, 1858),
    "deit_small_patch16_224": (8459, 3840),
    "deit_base_patch16_224": (17691, 8616),
    "swin_tiny_patch4_window7_224": (11812, 5371),
    "pvt_tiny": (7800, 3782),
}
TABLE_MODES = ("exact", "exact-explicit", "mesa8", "mesa8-explicit")


def _mib(r) -> float:
    return r["peak_bytes"] / 2**20


def _ips(r) -> float:
    t = r["step_time_s"]
    return r["batch"] / t if t and not math.isnan(t) else float("nan")


def _cell(r, fn, fmt="{:.0f}") -> str:
    if r is None or r.get("dry_run"):
        return "-"
    if r.get("oom"):
        return "OOM"
    v = fn(r)
    return "-" if math.isnan(v) else fmt.format(v)


def _ratio(a, b, fn) -> str:
    if a is None or b is None or a.get("oom") or b.get("oom"):
        return "-"
    x, y = fn(a), fn(b)
    return "-" if not y or math.isnan(x) or math.isnan(y) else f"{x / y:.3f}"


def paper_table(rows: list[dict]) -> str:
    """Markdown, two tables, one row per (model, precision, batch) that has an ``exact`` record
    (dicts of :class:`benchmarks.models.Record` fields): peak MiB of each of :data:`TABLE_MODES`
    present ('-' where not run, 'OOM'), Mesa over exact for the fused and the explicit attention,
    the paper's exact and Mesa MB and their ratio (batch 128 fp16 only); then img/s per mode."""
    by_key: dict = {}
    for r in rows:
        by_key.setdefault((r["model"], r["precision"], r["batch"]), {})[r["mode"]] = r
    keys = [k for k, modes in sorted(by_key.items()) if "exact" in modes]
    mem = ["model", "precision", "batch", *(f"{m} MiB" for m in TABLE_MODES), "mesa8 / exact",
           "explicit: mesa8 / exact", "paper exact MB", "paper Mesa MB", "paper ratio"]
    out = ["| " + " | ".join(mem) + " |", "|" + "---|" * len(mem)]
    for key in keys:
        m = by_key[key]
        paper = PAPER_MB.get(key[0]) if key[2] == 128 and key[1] == "fp16" else None
        cells = [key[0], key[1], str(key[2]), *(_cell(m.get(md), _mib) for md in TABLE_MODES),
                 _ratio(m.get("mesa8"), m.get("exact"), _mib),
                 _ratio(m.get("mesa8-explicit"), m.get("exact-explicit"), _mib),
                 *(("-", "-", "-") if paper is None else
                   (str(paper[0]), str(paper[1]), f"{paper[1] / paper[0]:.3f}"))]
        out.append("| " + " | ".join(cells) + " |")
    speed = ["model", "precision", "batch", *(f"{m} img/s" for m in TABLE_MODES), "mesa8 / exact",
             "explicit: mesa8 / exact"]
    out += ["", "| " + " | ".join(speed) + " |", "|" + "---|" * len(speed)]
    for key in keys:
        m = by_key[key]
        cells = [key[0], key[1], str(key[2]), *(_cell(m.get(md), _ips) for md in TABLE_MODES),
                 _ratio(m.get("mesa8"), m.get("exact"), _ips),
                 _ratio(m.get("mesa8-explicit"), m.get("exact-explicit"), _ips)]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def self_check_all(device: str = "cuda", printer=print) -> int:
    """:func:`mesa_ops.backend.self_check` of the CUDA kernels for every dtype x bits on
    ``device``, and :func:`~mesa_ops.backend.self_check_many` (three calls in one launch against
    one at a time); returns the number of cases that differ."""
    import torch

    from mesa_ops import backend

    be = backend.get_backend(torch.zeros(1, device=device), "cuda")
    bad = 0
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        for bits in (8, 4, 2, 1):
            problem = backend.self_check(be, torch.device(device), dt, bits)
            printer(f"{str(dt):16s} {bits} bits: {problem or 'identical to the reference'}")
            bad += problem is not None
            if getattr(be, "has_many", False):
                many = backend.self_check_many(be, torch.device(device), dt, bits)
                printer(f"{str(dt):16s} {bits} bits, 3 in one launch: "
                        f"{many or 'identical to one at a time'}")
                bad += many is not None
    return bad


def collect(files: list[str], printer=print) -> int:
    """Collect ``files`` with pytest (nothing runs): 0 when they collect without error and hold
    CUDA-marked tests, else 1. Prints the count per file."""
    import pytest

    class Counter:
        def __init__(self):
            self.items = []

        def pytest_collection_finish(self, session):
            self.items = list(session.items)

    counter = Counter()
    rc = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *files], plugins=[counter])
    per: dict = {}
    for item in counter.items:
        f = item.nodeid.split("::")[0]
        n_all, n_cuda = per.get(f, (0, 0))
        per[f] = (n_all + 1, n_cuda + ("cuda" in item.keywords))
    for f in files:
        n_all, n_cuda = per.get(f, (0, 0))
        printer(f"{f}: {n_all} tests, {n_cuda} marked cuda")
    n_cuda = sum(c for _, c in per.values())
    if rc != 0 or n_cuda == 0:
        printer(f"collection failed (pytest exit status {int(rc)}, {n_cuda} CUDA-marked tests)")
        return 1
    printer(f"collected: {sum(a for a, _ in per.values())} tests, {n_cuda} of them CUDA-marked")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--self-check", action="store_true")
    what.add_argument("--collect", nargs="+", metavar="FILE")
    args = ap.parse_args(argv)
    if args.self_check:
        return 1 if self_check_all() else 0
    return collect(args.collect)


if __name__ == "__main__":
    sys.exit(main())
