"""Host (Python + dispatch) time per stored activation: what Mesa costs a step when the tensors are
too small for the kernels to matter (issue 36, item 4).

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.host_time

On tiny tensors (2 x 4 x 64) a layer's time is host time. Per row, microseconds per call:

* ``bare C++``: the extension's ``quantize_step`` called directly (the floor of one stored
  activation: the argument parsing and the kernel on 512 elements);
* ``quantize``: ``QuantMixin.quantize`` (the Python path around that call: state, layout,
  draws, the prefix rows);
* ``layer fwd`` / ``plain fwd``: the Mesa layer's training forward against its ``nn`` layer's
  (an autograd Function, saving the packed copy);
* ``layer fwd+bwd`` / ``plain fwd+bwd``: the same with the backward (dequantize and gradient).

The difference ``layer - plain`` is what Mesa adds per stored activation on the host; a
DeiT-Ti step stores ~86, so at small batches it bounds the step time from below.

:func:`measure_model` times a whole training step (SGD) of a model at batch 1 on a 32 x 32 image
(DeiT-Ti: 5 tokens, so the Mesa kernels cost little and the exact step is mostly its weight
GEMMs), exact and Mesa 8-bit stepped in turn, and divides the difference by the number of
stored activations (the packed copies one Mesa step makes).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn

import mesa_ops as ms
from mesa_ops import backend, quant
from mesa_ops.bench import time_in_turn

__all__ = ["measure", "measure_model", "main"]


def _us(fn, n: int) -> float:
    for _ in range(max(20, n // 10)):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def _cases():
    x = torch.randn(2, 4, 64)
    return [("Linear 64->64", ms.layers.Linear(64, 64, quant_groups=2), nn.Linear(64, 64), x),
            ("LayerNorm 64", ms.layers.LayerNorm(64, quant_groups=2), nn.LayerNorm(64), x),
            ("GELU", ms.layers.GELU(quant_groups=2), nn.GELU(), x)]


def measure(n: int = 2000) -> list[dict]:
    """One row per layer of :func:`_cases` (microseconds per call)."""
    rows = []
    for name, mesa, plain, x in _cases():
        mesa.enable = True
        mesa.train(), plain.train()
        xg = x.clone().requires_grad_()
        xs = x.detach()
        be = backend.kernel_for(backend.get_backend(xs), xs, xs.dtype, 8)
        clip, shift, it = mesa._state()
        g, inner = mesa.groups_for(xs.shape)
        draws = mesa._draws_for(it)

        def bare():
            be.quantize_step(xs, g, inner, clip, shift, it, 0.9, 0.1, 1, 8, False, 0, draws, True, False, True)

        def step(m):
            def f():
                m(xg).sum().backward()
            return f
        rows.append({"layer": name, "bare C++": _us(bare, n), "quantize": _us(lambda: mesa.quantize(xs), n),
                     "layer fwd": _us(lambda: mesa(xg), n), "plain fwd": _us(lambda: plain(xg), n),
                     "layer fwd+bwd": _us(step(mesa), n // 2), "plain fwd+bwd": _us(step(plain), n // 2)})
    return rows


def table(rows: list[dict]) -> str:
    cols = ["layer", "bare C++", "quantize", "layer fwd", "plain fwd", "layer fwd+bwd", "plain fwd+bwd",
            "Mesa adds"]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        add = r["layer fwd+bwd"] - r["plain fwd+bwd"]
        out.append(f"| {r['layer']} | " + " | ".join(f"{r[c]:.1f}" for c in cols[1:-1]) + f" | {add:.1f} |")
    return "\n".join(out)


def measure_model(model: str = "deit_tiny_patch16_224", steps: int = 40, warmup: int = 5) -> dict:
    """Median step seconds of ``model`` (batch 1, 32 x 32 image, fp32, SGD), exact and Mesa
    8-bit stepped in turn, and the number of activations one Mesa step stores."""
    from .models import Config, _setup  # (the benchmark models: torch and timm only)

    steppers = {mode: _setup(Config(model=model, mode=mode, batch=1, input_size=32))[3]
                for mode in ("exact", "mesa8")}
    calls = [0]
    # (every stored activation passes QuantMixin._with_prefix once, whether it was quantized
    # alone or with others: quant.quantize_many)
    original = quant.QuantMixin._with_prefix

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return original(self, *args, **kwargs)

    quant.QuantMixin._with_prefix = counted
    try:
        steppers["mesa8"]()
    finally:
        quant.QuantMixin._with_prefix = original
    times = time_in_turn(steppers, warmup, steps)
    return {"model": model, "exact": statistics.median(times["exact"]),
            "mesa8": statistics.median(times["mesa8"]), "stored": calls[0]}


def model_line(r: dict) -> str:
    add = (r["mesa8"] - r["exact"]) / r["stored"] * 1e6
    return (f"{r['model']}, batch 1, 32 x 32: exact {r['exact'] * 1e3:.2f} ms, mesa8 {r['mesa8'] * 1e3:.2f} ms "
            f"per step; {r['stored']} stored activations: Mesa adds {add:.0f} us per stored activation")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="deit_tiny_patch16_224", help="the whole-step row's model ('' for none)")
    ap.add_argument("--calls", type=int, default=2000, help="calls per layer row")
    args = ap.parse_args(argv)
    print(f"# host time per call (us), torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
          "tensors 2 x 4 x 64")
    print(table(measure(args.calls)))
    if args.model:
        print()
        print(model_line(measure_model(args.model)))


if __name__ == "__main__":
    main()
