"""Per Mesa kernel: the bytes it must move, its time, and the bandwidth that implies against the
device's own copy bandwidth (issue 36: "a printed roofline figure per kernel").

    .venv/bin/python -m benchmarks.roofline                          # CPU, the C++ kernels
    python -m benchmarks.roofline --device cuda --dtype fp16         # scripts/cuda_check.sh's stage

One activation x of shape (B, N, C) (default on CUDA: DeiT-S at batch 128, 128 x 197 x 384 in fp16,
6 groups; on the CPU batch 8) goes through each step of the Mesa path alone, the median of
``--repeats`` calls, the device synchronized around each:

* ``quantize``: ``QuantMixin.quantize`` (the range update from x's per-group min / max, then the
  codes): at least x read once and the codes written: n x (element size + bits / 8) bytes;
* ``dequantize``: ``QTensor.restore`` (codes -> x): n x (bits / 8 + element size);
* ``table x grad``: ``packed.apply_table`` with a multiplier (GELU's backward: a per-group table
  read by code, times the incoming gradient): codes and gradient read, result written:
  n x (bits / 8 + 2 x element size);
* ``copy``: ``y.copy_(x)``, 2 x n x element size: the bandwidth the device reaches on a plain copy.

``GB/s`` is those minimum bytes over the time (1 GB = 1e9 bytes); ``of copy`` that bandwidth as a
fraction of the copy's. A kernel that reads x twice or runs below bandwidth shows up as a low
fraction. Each row's time includes the Python around the kernel (the path a layer takes), so
small tensors measure host time rather than the kernel.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from mesa_ops import layers as L
from mesa_ops.bench import sync
from mesa_ops.packed import QTensor, apply_table, levels

__all__ = ["measure", "table", "main"]

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _median_seconds(fn, device: str, repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def measure(shape=(8, 197, 384), groups: int = 6, bits: int = 8, dtype=torch.float32, device: str = "cpu",
            repeats: int = 20) -> list[dict]:
    """One row per kernel of the module docstring: ``kernel``, ``elements``, ``bytes`` (the minimum
    it moves), ``seconds`` (median), ``gbps``, ``of_copy`` (fraction of the copy's GB/s)."""
    torch.manual_seed(0)
    x = torch.randn(*shape, device=device, dtype=dtype)
    g = torch.randn_like(x)
    n, es = x.numel(), x.element_size()
    layer = L.GELU(quant_groups=groups, bits=bits, enable=True).to(device).train()
    q = layer.quantize(x)
    if not isinstance(q, QTensor):
        raise RuntimeError(f"roofline: the quantizer returned {type(q).__name__}, not a packed copy")
    tensors, meta = q.tensors()[:3], q.meta()  # (the codes only: no exact prefix rows here)
    tab = levels(q.step, q.shift, bits, dtype)
    y = torch.empty_like(x)
    code_bytes = n * bits // 8
    cases = [("quantize", lambda: layer.quantize(x), n * es + code_bytes),
             ("dequantize", lambda: QTensor.restore(tensors, meta), code_bytes + n * es),
             ("table x grad", lambda: apply_table(tensors, meta, tab, mul=g), code_bytes + 2 * n * es),
             ("copy", lambda: y.copy_(x), 2 * n * es)]
    rows = []
    with torch.no_grad():
        for name, fn, nbytes in cases:
            s = _median_seconds(fn, device, repeats)
            rows.append({"kernel": name, "elements": n, "bytes": nbytes, "seconds": s, "gbps": nbytes / s / 1e9})
    copy_bw = rows[-1]["gbps"]
    for r in rows:
        r["of_copy"] = r["gbps"] / copy_bw
    return rows


def table(rows: list[dict]) -> str:
    out = ["| kernel | elements | min bytes | time | GB/s | of copy |", "|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['kernel']} | {r['elements']:,} | {r['bytes'] / 2 ** 20:.1f} MiB | "
                   f"{r['seconds'] * 1e6:.0f} us | {r['gbps']:.1f} | {r['of_copy']:.2f}x |")
    return "\n".join(out)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", type=int, nargs=3, default=None, metavar=("B", "N", "C"),
                    help="default 128 197 384 on CUDA, 8 197 384 on the CPU")
    ap.add_argument("--groups", type=int, default=6)
    ap.add_argument("--bits", type=int, default=8, choices=(8, 4, 2))
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default fp16 on CUDA, fp32 on the CPU")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    shape = tuple(args.shape or ((128, 197, 384) if cuda else (8, 197, 384)))
    dtype = DTYPES[args.dtype or ("fp16" if cuda else "fp32")]
    if shape[-1] % args.groups:
        ap.error(f"--groups {args.groups} does not divide C = {shape[-1]}")
    where = torch.cuda.get_device_name(args.device) if cuda else f"cpu, {torch.get_num_threads()} threads"
    print(f"# roofline: {where}, torch {torch.__version__}, x {tuple(shape)} {str(dtype).replace('torch.', '')}, "
          f"{args.groups} groups, {args.bits} bits, median of {args.repeats}")
    rows = measure(shape, args.groups, args.bits, dtype, args.device, args.repeats)
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
