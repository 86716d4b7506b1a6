"""Host (Python + dispatch) time per stored activation: what Mesa costs a step when the tensors are
too small for the kernels to matter (issues 36 and 48).

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.host_time

On tiny tensors a layer's time is host time. Per row, microseconds per call (1 x 5 x 192 tokens,
DeiT-Ti's width at batch 1 and 32 x 32 pixels):

* ``bare C++``: the extension's ``quantize_step`` called directly (the floor of one stored
  activation: the argument parsing and the kernel);
* ``quantize``: ``QuantMixin.quantize`` (the Python path around that call);
* ``layer fwd`` / ``plain fwd``: the Mesa layer's training forward against its ``nn`` layer's;
* ``layer fwd+bwd`` / ``plain fwd+bwd``: the same with the backward (restore and gradient).

:func:`measure_model` times whole training steps (SGD) of a model at batch 1 on a 32 x 32 image
(DeiT-Ti / DeiT-S: 5 tokens, so Mesa's kernels cost little and the exact step is mostly its weight
GEMMs and optimizer), exact and Mesa 8-bit stepped in turn in one process, per-thread CPU time,
and divides the difference of the medians by the activations one Mesa step stores (counted as the
packed copies autograd saves). :func:`count_step` counts what a forward + backward runs: Python
function calls (``sys.setprofile``) and aten ops (a dispatch mode), exact and Mesa.
:func:`measure_compiled` times the same steps of the model under ``torch.compile`` (inductor).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections import Counter

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import mesa_ops as ms
from mesa_ops import backend
from mesa_ops.bench import time_in_turn

__all__ = ["measure", "measure_model", "count_step", "main"]

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}


def _us(fn, n: int) -> float:
    """Microseconds of per-thread CPU time per call of ``fn`` (the best of 5 rounds)."""
    for _ in range(max(20, n // 10)):
        fn()
    best = float("inf")
    for _ in range(5):
        t = time.thread_time()
        for _ in range(max(1, n // 5)):
            fn()
        best = min(best, (time.thread_time() - t) / max(1, n // 5) * 1e6)
    return best


def _cases():
    x = torch.randn(1, 5, 192)
    return [("Linear 192->192", ms.layers.Linear(192, 192), nn.Linear(192, 192), x),
            ("LayerNorm 192", ms.layers.LayerNorm(192), nn.LayerNorm(192), x),
            ("GELU", ms.layers.GELU(), nn.GELU(), x)]


def measure(n: int = 2000) -> list[dict]:
    """One row per layer of :func:`_cases` (microseconds per call)."""
    rows = []
    for name, mesa, plain, x in _cases():
        mesa.enable = True
        mesa.train(), plain.train()
        xg = x.clone().requires_grad_()
        xs = x.detach()
        mesa.quantize(xs)  # (the plan for this layout, then its arguments)
        call = mesa._step_call(xs, False, None)
        be, args = call[0], call[1]
        g = torch.ones(1, 5, 192)

        def step(m):
            def f():
                m(xg).backward(g)
            return f
        rows.append({"layer": name, "bare C++": _us(lambda: be.quantize_step(*args), n),
                     "quantize": _us(lambda: mesa.quantize(xs), n),
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


def _steppers(model: str, precision: str = "fp32"):
    """{mode: (model, one training step: forward, loss, backward, SGD)} of exact and mesa8 at batch 1
    on a 32 x 32 image (the benchmark models: torch and timm only)."""
    from .models import Config, _setup

    return {mode: _setup(Config(model=model, mode=mode, batch=1, input_size=32, precision=precision))
            for mode in ("exact", "mesa8")}


def stored_activations(step) -> int:
    """The packed copies one call of ``step`` saves for backward (uint8 storages autograd keeps)."""
    seen = set()

    def pack(t):
        if t.dtype == torch.uint8:
            seen.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return len(seen)


def measure_model(model: str = "deit_tiny_patch16_224", precision: str = "fp32", steps: int = 40,
                  warmup: int = 5) -> dict:
    """Median step seconds (per-thread CPU time) of ``model`` (batch 1, 32 x 32 image, SGD),
    exact and Mesa 8-bit stepped in turn, and the number of activations one Mesa step stores."""
    setups = _steppers(model, precision)
    steppers = {mode: s[3] for mode, s in setups.items()}
    stored = stored_activations(steppers["mesa8"])
    return {"model": model, "precision": precision, **_medians(steppers, warmup, steps), "stored": stored}


def _medians(steppers: dict, warmup: int, steps: int) -> dict:
    """{mode: median seconds of this thread's CPU time} of ``steppers`` stepped in turn."""
    times = time_in_turn(steppers, warmup, steps, clock=time.thread_time)
    return {mode: statistics.median(t) for mode, t in times.items()}


def model_line(r: dict) -> str:
    add = (r["mesa8"] - r["exact"]) / r["stored"] * 1e6
    return (f"{r['model']} {r['precision']}, batch 1, 32 x 32: exact {r['exact'] * 1e3:.2f} ms, mesa8 "
            f"{r['mesa8'] * 1e3:.2f} ms per step; {r['stored']} stored activations: Mesa adds {add:.0f} us "
            "per stored activation")


class _AtenOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def count_step(model: str = "deit_tiny_patch16_224", precision: str = "fp32", warmup: int = 3) -> dict:
    """{mode: {"python calls", "aten ops", "calls by function", "ops by name"}} of one forward +
    backward (loss included, optimizer step not) of ``model`` at batch 1 on a 32 x 32 image, exact
    and Mesa 8-bit, after ``warmup`` steps (plans, caches and the extension built)."""
    out = {}
    amp = PRECISIONS[precision]
    for mode, (net, _, x, step) in _steppers(model, precision).items():
        y = torch.zeros(1, dtype=torch.long)

        def fwd_bwd():
            with torch.autocast("cpu", dtype=amp, enabled=amp is not None):
                loss = nn.functional.cross_entropy(net(x).float(), y)
            loss.backward()

        params = list(net.parameters())

        def clear():
            for p in params:
                p.grad = None

        for _ in range(warmup):
            step()
            fwd_bwd()
            clear()
        calls = Counter()

        def prof(frame, event, arg):
            if event == "call":
                code = frame.f_code
                name = getattr(code, "co_qualname", code.co_name)  # (Python 3.11: Class.method)
                calls[f"{code.co_filename.rsplit('/', 1)[-1]}:{name}"] += 1

        sys.setprofile(prof)
        try:
            fwd_bwd()
        finally:
            sys.setprofile(None)
        clear()
        with _AtenOps() as mode_ops:
            fwd_bwd()
        clear()
        out[mode] = {"python calls": sum(calls.values()), "aten ops": sum(mode_ops.ops.values()),
                     "calls by function": calls, "ops by name": mode_ops.ops}
    return out


def measure_compiled(model: str = "deit_tiny_patch16_224", precision: str = "fp32", steps: int = 40,
                     warmup: int = 5) -> dict:
    """Median step seconds (per-thread CPU time) of ``model`` compiled by ``torch.compile``
    (inductor; batch 1, 32 x 32 image, SGD outside the compiled model), exact and Mesa 8-bit
    stepped in turn after two compiling steps each. Mesa's kernels run as native torch ops
    (``mesa::quantize_step``, ``mesa::unpack``, ``mesa::pack``, ``mesa::lut_apply``: C++ kernels the
    graphs call without Python)."""
    setups = _steppers(model, precision)
    amp = PRECISIONS[precision]
    steppers = {}
    # (dynamo traces through the layers' lru_cache'd lookups, of constant results: said once each)
    warnings.filterwarnings("ignore", message="Dynamo detected a call to a `functools.lru_cache`")
    for mode, (net, _, x, _) in setups.items():
        compiled = torch.compile(net)
        params = [p for p in net.parameters() if p.requires_grad]
        opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9)
        y = torch.zeros(1, dtype=torch.long)

        def step(compiled=compiled, opt=opt, x=x, y=y):
            with torch.autocast("cpu", dtype=amp, enabled=amp is not None):
                loss = nn.functional.cross_entropy(compiled(x).float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        step()
        step()
        steppers[mode] = step
    return {"model": model, "precision": precision, **_medians(steppers, warmup, steps)}


def compiled_line(r: dict) -> str:
    return (f"{r['model']} {r['precision']}, torch.compile (inductor), batch 1, 32 x 32: exact "
            f"{r['exact'] * 1e3:.2f} ms, mesa8 {r['mesa8'] * 1e3:.2f} ms per step "
            f"({r['mesa8'] / r['exact']:.2f}x)")


def count_line(model: str, precision: str, c: dict) -> str:
    e, m = c["exact"], c["mesa8"]
    return (f"{model} {precision}, forward + backward: Python calls exact {e['python calls']}, mesa8 "
            f"{m['python calls']} ({m['python calls'] / e['python calls']:.2f}x); aten ops exact "
            f"{e['aten ops']}, mesa8 {m['aten ops']} ({m['aten ops'] / e['aten ops']:.2f}x)")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="*", default=["deit_tiny_patch16_224", "deit_small_patch16_224"],
                    help="the whole-step rows' models (none: only the layer rows)")
    ap.add_argument("--precisions", nargs="*", default=list(PRECISIONS), choices=list(PRECISIONS))
    ap.add_argument("--calls", type=int, default=2000, help="calls per layer row")
    ap.add_argument("--steps", type=int, default=40, help="timed steps per whole-step row")
    ap.add_argument("--compiled", nargs="*", default=["deit_tiny_patch16_224", "deit_small_patch16_224"],
                    help="the compiled-step rows' models (none: no compiled rows; ~1-2 min each to compile)")
    args = ap.parse_args(argv)
    backend.get_backend(torch.zeros(1))  # (the extension built before anything is timed)
    print(f"# host time per call (us), torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
          "tensors 1 x 5 x 192")
    print(table(measure(args.calls)))
    for model in args.models:
        for precision in args.precisions:
            print(model_line(measure_model(model, precision, steps=args.steps)))
    for model in args.models[:1]:
        for precision in args.precisions:
            print(count_line(model, precision, count_step(model, precision)))
    for model in args.compiled:
        for precision in args.precisions:
            print(compiled_line(measure_compiled(model, precision, steps=args.steps)))


if __name__ == "__main__":
    main()
