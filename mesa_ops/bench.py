"""Timing and memory helpers shared by ``tools/benchmark_ops.py`` and the model
benchmarks: interleaved train-step timing, saved-activation bytes, and the per-layer cases.
"""
from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from . import layers as L
from .blocks import Block
from .memory import SavedActivationMeter
from .policy import mesa_layers, set_mesa


def sync(device) -> None:
    """Wait for the device's queued work (CUDA); a no-op on CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_in_turn(steppers: dict, warmup, steps, device="cpu", clock=time.perf_counter) -> dict:
    """{name: [seconds of each timed call]} of ``steppers`` {name: callable}, called in turn (one
    call of each per round, the device synchronized around each) so that load from other
    processes hits them alike. ``warmup`` / ``steps``: untimed then timed calls, an int or
    {name: int}; ``device``: one for all, or {name: device}; ``clock``: wall time, or e.g.
    ``time.thread_time`` (this thread's CPU time: host-time benchmarks)."""
    def of(v, n):
        return v[n] if isinstance(v, dict) else v

    times = {n: [] for n in steppers}
    for i in range(max(of(warmup, n) + of(steps, n) for n in steppers)):
        for n, fn in steppers.items():
            if i >= of(warmup, n) + of(steps, n):
                continue
            sync(of(device, n))
            t0 = clock()
            fn()
            sync(of(device, n))
            if i >= of(warmup, n):
                times[n].append(clock() - t0)
    return times


def agg_pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display); ImportError where
    matplotlib is not installed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def saved_bytes(model: nn.Module, inputs: tuple,
                autocast_dtype: torch.dtype | None = None) -> SavedActivationMeter:
    """Saved-activation accounting of one training forward of ``model(*inputs)``."""
    model.train()
    dev = next((t.device for t in inputs if isinstance(t, torch.Tensor)), torch.device("cpu"))
    with SavedActivationMeter(model) as meter:
        with torch.autocast(dev.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            out = model(*inputs)
    del out
    return meter


@dataclass
class OpCase:
    """One benchmark case: a Mesa module and the shapes of its inputs."""
    name: str
    make: Callable[[], nn.Module]
    shapes: tuple
    requires_grad: tuple = None


def op_cases(batch: int = 8, tokens: int = 197, dim: int = 192, heads: int = 3) -> list[OpCase]:
    """The layers of a DeiT-Ti-width block at its shapes, plus conv/bn/relu on a feature map."""
    hd = dim // heads
    tok = (batch, tokens, dim)
    att = (batch, heads, tokens, tokens)
    fmap = (batch, 64, 28, 28)
    return [
        OpCase("Linear 192->768", lambda: L.Linear(dim, 4 * dim, quant_groups=heads), (tok,)),
        OpCase("LayerNorm 192", lambda: L.LayerNorm(dim, quant_groups=heads), (tok,)),
        OpCase("GELU 768", lambda: L.GELU(quant_groups=heads), ((batch, tokens, 4 * dim),)),
        OpCase("Softmax (B,H,N,N)", lambda: L.Softmax(dim=-1, quant_groups=heads), (att,)),
        OpCase("MatMul q@k^T", lambda: L.MatMul(quant_groups=heads),
               ((batch, heads, tokens, hd), (batch, heads, hd, tokens))),
        OpCase("Conv2d 64->64 3x3", lambda: L.Conv2d(64, 64, 3, padding=1, quant_groups=4), (fmap,)),
        OpCase("BatchNorm2d 64", lambda: L.BatchNorm2d(64, quant_groups=4), (fmap,)),
        OpCase("ReLU", lambda: L.ReLU(), (fmap,)),
        OpCase(f"Block dim{dim} h{heads} N{tokens}", lambda: Block(dim, heads), (tok,)),
    ]


def train_step_time(model, inputs: tuple, autocast_dtype=None, device="cpu") -> float:
    """Seconds of one forward + ``sum()`` loss + backward of ``model(*inputs)`` (parameter
    gradients cleared first; of a tuple output, its first item), with the device synchronised."""
    dev = torch.device(device)
    for p in model.parameters():
        p.grad = None
    sync(dev)
    t0 = time.perf_counter()
    with torch.autocast(dev.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        out = model(*inputs)
    (out[0] if isinstance(out, tuple) else out).float().sum().backward()
    sync(dev)
    return time.perf_counter() - t0


def compare(case: OpCase, bits_list=(8, 4, 2), device: str = "cpu", steps: int = 10,
            autocast_dtype: torch.dtype | None = None, seed: int = 0, warmup: int = 3) -> list[dict]:
    """Exact vs Mesa at each bit width for one case: median step time and saved bytes, with
    ratios. The modes' steps are interleaved (exact, mesa8, mesa4, ... per round) so that drifts
    of a shared machine hit them alike."""
    torch.manual_seed(seed)
    base = case.make().to(device)
    dev = torch.device(device)
    inputs = tuple(torch.randn(s, device=device).requires_grad_() for s in case.shapes)
    modes = (None,) + tuple(bits_list)
    models = []
    for bits in modes:
        m = copy.deepcopy(base).train()
        set_mesa(m, enable=bits is not None, bits=bits or 8)
        models.append(m)
    times = [[] for _ in modes]
    for r in range(warmup + steps):
        for i, m in enumerate(models):
            t = train_step_time(m, inputs, autocast_dtype, dev)
            if r >= warmup:
                times[i].append(t)
    rows = []
    ref_t = ref_b = None
    for bits, m, ts in zip(modes, models, times):
        t = statistics.median(ts)
        b = saved_bytes(m, inputs, autocast_dtype=autocast_dtype).total_bytes
        if bits is None:
            ref_t, ref_b = t, b
        rows.append(dict(case=case.name, mode="exact" if bits is None else f"mesa{bits}",
                         time_ms=t * 1e3, time_ratio=t / ref_t, saved_bytes=b,
                         bytes_ratio=b / ref_b if ref_b else float("nan")))
    return rows


def format_table(rows: list[dict]) -> str:
    """Markdown table: one row per case, per mode 'ms (x time, x bytes)'."""
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    cases = list(dict.fromkeys(r["case"] for r in rows))
    by = {(r["case"], r["mode"]): r for r in rows}
    head = "| case | " + " | ".join(modes) + " |"
    lines = [head, "|" + "---|" * (len(modes) + 1)]
    for c in cases:
        cells = []
        for md in modes:
            r = by.get((c, md))
            if r is None:
                cells.append("")
            elif md == "exact":
                cells.append(f"{r['time_ms']:.2f} ms, {r['saved_bytes'] / 2**20:.2f} MiB")
            else:
                cells.append(f"{r['time_ms']:.2f} ms ({r['time_ratio']:.2f}x time, "
                             f"{r['bytes_ratio']:.3f}x bytes)")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- timm models by name, under compress ------------------------------------------------------
def build_model(name: str, policy="mesa8", img_size: int | None = None, **kwargs) -> nn.Module:
    """A model by name, with Mesa on per ``policy``: this repo's models (registered in timm as
    ``mesa_<name>`` once ``models`` is imported) through their own ``ms_policy``; any other timm
    model (or ``timm:<name>``, e.g. ``timm:deit_small_patch16_224`` for timm's DeiT) created by
    ``timm.create_model`` (random init) and converted by :func:`compress`. ``img_size`` is passed
    to models that take it (PVT-v2 does not: it runs at any size)."""
    import timm

    own = not name.startswith("timm:") and timm.is_model(f"mesa_{name}")
    if name.startswith("timm:"):
        name = name[len("timm:"):]
    if not timm.is_model(f"mesa_{name}" if own else name):
        raise ValueError(f"unknown model {name!r} (neither this repo's nor timm's)")
    full = f"mesa_{name}" if own else name
    extra = dict(kwargs, **({"ms_policy": None if policy in ("off", "exact") else policy} if own else {}))
    if img_size is not None:
        try:
            model = timm.create_model(full, img_size=img_size, **extra)
        except TypeError as exc:
            if "img_size" not in str(exc):
                raise
            model = timm.create_model(full, **extra)
    else:
        model = timm.create_model(full, **extra)
    if not own:
        from .compress import compress

        compress(model, policy, warn=False)
    return model


def bench(name: str, policy="mesa8", batch_size: int = 4, img_size: int = 224, steps: int = 3) -> dict:
    """Saved bytes and train-step time of model ``name`` (see :func:`build_model`) with Mesa per
    ``policy`` vs exact (the same model with every Mesa layer off: for a timm model its original
    forward). Steps (forward, sum loss, backward; fp32) alternate exact / Mesa; medians."""
    from .audit import audit

    model = build_model(name, policy, img_size=img_size).train()
    on = {n: m.enable for n, m in mesa_layers(model)}
    x = torch.randn(batch_size, 3, img_size, img_size)

    def set_on(flag):
        for n, m in mesa_layers(model):
            m.enable = on[n] and flag

    res = {"model": name, "policy": str(policy), "batch": batch_size, "img_size": img_size,
           "params_m": sum(p.numel() for p in model.parameters()) / 1e6}
    times = {True: [], False: []}
    for flag in (False, True):
        set_on(flag)
        res["saved_mesa" if flag else "saved_exact"] = audit(model, x, verbose=False).total_bytes
        train_step_time(model, (x,))  # warm-up
    for _ in range(steps):
        for flag in (False, True):
            set_on(flag)
            times[flag].append(train_step_time(model, (x,)))
    res["step_exact"] = statistics.median(times[False])
    res["step_mesa"] = statistics.median(times[True])
    return res
