"""Gradient fidelity of a Mesa configuration: its bias and its noise against exact autograd.

    report = grad_fidelity(model, x, target, draws=16, warm=[(x1, t1), (x2, t2)])
    report["groups"]["all"]["bias"], report["groups"]["blocks.*.attn.qkv.weight"]["noise"]

Method. ``model`` (Mesa layers enabled as the caller set them, training mode) first runs a
training forward on each ``warm`` batch, so the running ranges are those of a run that has seen
a few steps. The state that decides the rounding is then frozen: before each of the ``K =
draws`` measured steps on the fixed batch ``(x, target)`` every quantizer's ``clip_val``,
``shift`` and ``iteration`` and torch's generator are restored, and Mesa's generator base is set
to a new value (:func:`mesa_ops.set_rng_state`), so the K gradients ``g_1..g_K`` are independent
stochastic-rounding draws of one step. The exact gradient ``g0`` is that of the same step with
every quantizer off (or under the caller's ``exact`` context). With ``d_k = g_k - g0``, per
parameter group (parameter names with their block indices replaced by ``*``, plus ``all``),
relative to ``||g0||`` of the group:

* ``single``: sqrt(mean_k ||d_k||^2) -- the error of one training step's gradient;
* ``mean_err[k]``: ||mean of the first k draws - g0|| for k = 1, 2, 4, ... K. For an unbiased
  gradient it falls like 1/sqrt(k); it stops falling at the bias (the floor);
* ``noise``: sqrt(tr Var(g_k)), the per-element sample variances summed (``noise**2`` is the
  variance);
* ``bias``: sqrt(max(0, U)), U the mean over pairs a != b of <mean_a, mean_b>, the means of d
  over ``M = min(K, max_batches)`` disjoint batches of draws (draw i in batch i % M): unbiased
  for ||E[g_k] - g0||^2, the floor with the noise of a finite K taken out (with M = K it equals
  ||mean_K - g0||^2 - tr Var / K); ``bias_se``: its standard error, by the jackknife over the
  batches (which makes no assumption on how the gradient elements' noise is correlated), on the
  scale of the bias. A bias under about 2 ``bias_se`` is not resolved by K draws (raise K);
* ``slope``: log(mean_err[K] / mean_err[1]) / log(K): -0.5 for an unbiased gradient, 0 where the
  bias dominates.

Everything the model's state holds (ranges, draw counters, torch's and Mesa's generators) is put
back afterwards as the warm-up left it. Costs ``len(warm)`` forwards and ``K + 1`` training steps;
memory: ``M + 1`` float32 copies of the gradients.
"""
from __future__ import annotations

import contextlib
import math
import re
from typing import Callable, Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import ops
from .quant import QuantMixin
from .reference import RANGE_MODES

__all__ = ["grad_fidelity", "param_group", "mesa_off", "set_range_mode", "default_ks", "format_table"]

_STATE = ("clip_val", "shift", "iteration")


def param_group(name: str) -> str:
    """The group of a parameter: its name with block indices replaced by ``*``
    (``blocks.3.attn.qkv.weight`` -> ``blocks.*.attn.qkv.weight``)."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)", "*", name)


def _quantizers(model: nn.Module) -> list:
    return [m for m in model.modules() if isinstance(m, QuantMixin)]


@contextlib.contextmanager
def mesa_off(model: nn.Module):
    """Every quantizer of ``model`` off inside the block (exact autograd); each one's own
    ``enable`` is put back after."""
    qs = _quantizers(model)
    was = [q.enable for q in qs]
    try:
        for q in qs:
            q.enable = False
        yield model
    finally:
        for q, e in zip(qs, was):
            q.enable = e


def set_range_mode(model: nn.Module, mode: str) -> int:
    """Set ``range_mode`` ('ema' / 'batch' / 'union') on every quantizer; returns how many."""
    if mode not in RANGE_MODES:
        raise ValueError(f"range_mode must be one of {RANGE_MODES}, got {mode!r}")
    qs = _quantizers(model)
    for q in qs:
        q.range_mode = mode
    return len(qs)


def default_ks(draws: int) -> list[int]:
    """1, 2, 4, ... up to ``draws``, and ``draws`` itself."""
    ks, k = [], 1
    while k < draws:
        ks.append(k)
        k *= 2
    return ks + [draws]


def _default_loss(out, target):
    outs = out if isinstance(out, (tuple, list)) else (out,)
    if target is None:  # the planner's loss: sum of squared outputs
        return sum(o.float().square().sum() for o in outs)
    return sum(F.cross_entropy(o.float(), target) for o in outs) / len(outs)


def _split(batch):
    if isinstance(batch, (tuple, list)):
        return batch[0], (batch[1] if len(batch) > 1 else None)
    return batch, None


def _grads(model, params, x, target, loss_fn) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), target)
    if not torch.isfinite(loss):
        raise FloatingPointError(f"grad_fidelity: the loss is {float(loss)}")
    loss.backward()
    out = [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for _, p in params]
    model.zero_grad(set_to_none=True)
    return out


def grad_fidelity(model: nn.Module, x: torch.Tensor, target: torch.Tensor | None = None, *,
                  draws: int = 16, warm: Iterable = (), loss_fn: Callable | None = None,
                  range_mode: str | None = None, ks: list[int] | None = None, base: int = 1,
                  exact: Callable | None = None, group: Callable[[str], str] = param_group,
                  check_enabled: bool = True, max_batches: int = 16) -> dict:
    """Measure the Mesa gradient of one step on ``x`` (B, ...) with labels ``target`` (B,) (or
    None) against exact autograd, over ``draws`` stochastic-rounding draws (see the module doc).

    ``warm``: batches ``x`` or ``(x, target)`` run forward first (the ranges' warm-up);
    ``loss_fn(output, target)``: default cross-entropy (tuple outputs averaged), or with no
    ``target`` the sum of squared outputs; ``range_mode``: set on every quantizer first (None:
    as the model has it); ``ks``: the k of ``mean_err`` (default :func:`default_ks`); ``base``:
    Mesa's generator base of the first draw (draw i uses ``base + i``); ``exact``: a function
    ``exact(model)`` giving a context manager in which the model computes exact gradients
    (default :func:`mesa_off`); ``group``: parameter name -> group name; ``max_batches``: the
    most batches of draws kept for the bias estimate (memory: that many gradients); ``check_enabled``:
    raise when no quantizer of the model is enabled (False: measure anyway, e.g. a model whose
    only approximation is a packed activation checkpoint, see :func:`mesa_ops.planner.verify`).

    Returns a dict: ``draws``, ``ks``, ``batches``, ``range_mode`` (of the first enabled
    quantizer), ``warm_steps``,
    ``groups``: {group: {``numel``, ``grad_norm``, ``single``, ``mean_err`` {k: rel},
    ``bias``, ``bias_se``, ``noise``, ``slope``}} with ``all`` first."""
    draws = int(draws)
    if draws < 2:
        raise ValueError(f"grad_fidelity: draws must be >= 2 (the variance needs two), got {draws}")
    ks = sorted(set(default_ks(draws) if ks is None else [int(k) for k in ks]))
    if ks[0] < 1 or ks[-1] > draws:
        raise ValueError(f"grad_fidelity: ks must lie in 1..{draws}, got {ks}")
    loss_fn = loss_fn or _default_loss
    exact = exact or mesa_off
    qs = _quantizers(model)
    if check_enabled and not any(q.enable for q in qs):
        raise ValueError("grad_fidelity: no Mesa quantizer of the model is enabled (nothing to measure)")
    if range_mode is not None:
        set_range_mode(model, range_mode)
    model.train()
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not params:
        raise ValueError("grad_fidelity: the model has no parameter that needs a gradient")

    n_warm = 0
    for batch in warm:
        wx, _ = _split(batch)
        model(wx)  # a training forward with grad enabled: the quantizers update their ranges
        n_warm += 1

    saved = [(getattr(q, n), getattr(q, n).detach().clone()) for q in qs for n in _STATE]
    torch_state = torch.random.get_rng_state()
    mesa_state = ops.get_rng_state()

    def restore():
        with torch.no_grad():
            for buf, val in saved:
                buf.copy_(val)  # in place: the draw counters re-read ``iteration``
        torch.random.set_rng_state(torch_state)

    try:
        restore()
        with exact(model):
            g0 = _grads(model, params, x, target, loss_fn)
        M = min(draws, max_batches)  # draw i is summed into batch i % M
        sums = [torch.zeros((M,) + g.shape, dtype=torch.float32, device=g.device) for g in g0]
        sq = [0.0] * len(params)  # sum over draws of ||d||^2
        part = {}  # k -> ||sum of the first k d||^2, per parameter
        for i in range(draws):
            restore()
            ops.set_rng_state(torch.tensor([base + i], dtype=torch.int64))
            g = _grads(model, params, x, target, loss_fn)
            for j, (gj, g0j) in enumerate(zip(g, g0)):
                d = gj.double() - g0j.double()
                sq[j] += float(d.square().sum())
                sums[j][i % M] += d.float()
            if i + 1 in ks:
                part[i + 1] = [float(t.sum(0, dtype=torch.float64).square().sum()) for t in sums]
    finally:
        restore()
        ops.set_rng_state(mesa_state)

    # per parameter: what the groups add up (the Gram matrix of the batch sums, float64)
    per = []
    for j in range(len(params)):
        per.append({"numel": g0[j].numel(), "g0": float(g0[j].double().square().sum()),
                    "sq": sq[j], "gram": _gram(sums[j]), "part": {k: part[k][j] for k in ks}})
        sums[j] = None
    counts = torch.tensor([len(range(a, draws, M)) for a in range(M)], dtype=torch.float64)
    names = ["all"] + list(dict.fromkeys(group(n) for n, _ in params))
    members = {g: [] for g in names}
    for j, (n, _) in enumerate(params):
        members["all"].append(j)
        members[group(n)].append(j)
    groups = {}
    for gname in names:
        idx = members[gname]
        groups[gname] = _summarize(
            sum(per[j]["numel"] for j in idx), sum(per[j]["g0"] for j in idx),
            sum(per[j]["sq"] for j in idx), sum(per[j]["gram"] for j in idx),
            {k: sum(per[j]["part"][k] for j in idx) for k in ks}, counts, ks)
    return {"draws": draws, "ks": ks, "batches": M, "warm_steps": n_warm,
            "range_mode": next((q.range_mode for q in qs if q.enable), None), "groups": groups}


def _gram(t: torch.Tensor, chunk: int = 1 << 20) -> torch.Tensor:
    """(M, M) float64 Gram matrix of the rows of ``t`` (M, ...), in chunks of the columns."""
    flat = t.reshape(t.shape[0], -1)
    out = torch.zeros(flat.shape[0], flat.shape[0], dtype=torch.float64)
    for c in range(0, flat.shape[1], chunk):
        part = flat[:, c:c + chunk].double()
        out += (part @ part.T).cpu()
    return out


def _bias2(gram: torch.Tensor, counts: torch.Tensor) -> float:
    """The unbiased estimate of ||E d||^2 from independent batch means: the mean over pairs
    a != b of <mean_a, mean_b>."""
    m = gram / counts[:, None] / counts[None, :]
    n = m.shape[0]
    return float((m.sum() - m.diagonal().sum()) / (n * (n - 1)))


def _summarize(numel, g0, sq, gram, part, counts, ks) -> dict:
    K = int(counts.sum())
    M = gram.shape[0]
    norm = math.sqrt(g0)
    scale = 1.0 / norm if norm > 0 else float("nan")
    total2 = float(gram.sum())  # ||sum of all d||^2
    var = max(0.0, (sq - total2 / K) / (K - 1))  # tr Var(d), the sample variance
    b2 = _bias2(gram, counts)
    if M >= 3:  # jackknife over the batches (the noise of gradient elements is correlated)
        loo = []
        for c in range(M):
            keep = [a for a in range(M) if a != c]
            loo.append(_bias2(gram[keep][:, keep], counts[keep]))
        mu = sum(loo) / M
        b2_se = math.sqrt((M - 1) / M * sum((v - mu) ** 2 for v in loo))
    else:
        b2_se = float("nan")
    bias = math.sqrt(max(0.0, b2))
    # on the bias's own scale: d sqrt(b2) = d b2 / (2 sqrt(b2)), no better than sqrt(se) near 0
    bias_se = min(math.sqrt(b2_se), b2_se / (2 * bias)) if bias > 0 else math.sqrt(b2_se)
    err = {k: math.sqrt(part[k]) / k for k in ks}
    k0 = ks[0]
    slope = (math.log(err[K] / err[k0]) / math.log(K / k0)
             if err[k0] > 0 and err[K] > 0 and K > k0 else float("nan"))
    return {"numel": int(numel), "grad_norm": norm, "single": math.sqrt(sq / K) * scale,
            "mean_err": {k: v * scale for k, v in err.items()}, "bias": bias * scale,
            "bias_se": bias_se * scale, "noise": math.sqrt(var) * scale, "slope": slope}


def format_table(report: dict, title: str = "", max_groups: int | None = None) -> str:
    """A report of :func:`grad_fidelity` as a markdown table, percentages of ``||g0||``."""
    ks = report["ks"]
    head = (["group", "single"] + [f"mean of {k}" for k in ks]
            + ["bias (floor)", "+- se", "noise", "slope"])
    rows = [("| " + " | ".join(head) + " |"), "|" + "---|" * len(head)]
    items = list(report["groups"].items())
    if max_groups is not None:
        items = items[:max_groups + 1]
    for name, g in items:
        cells = ([name, _pct(g["single"])] + [_pct(g["mean_err"][k]) for k in ks]
                 + [_pct(g["bias"]), _pct(g["bias_se"]), _pct(g["noise"]), f"{g['slope']:.2f}"])
        rows.append("| " + " | ".join(cells) + " |")
    return (title + "\n" if title else "") + "\n".join(rows)


def _pct(v: float) -> str:
    return "nan" if v != v else f"{100 * v:.3f}%"


def compare(build: Callable[[str], nn.Module], policies: Iterable[str], range_modes: Iterable,
            x: torch.Tensor, target: torch.Tensor | None = None, *, warm: Iterable = (),
            state_dict: dict | None = None, **kwargs) -> list[dict]:
    """:func:`grad_fidelity` for each policy x range mode: ``build(policy)`` a fresh model
    (Mesa on per ``policy``), loaded with ``state_dict`` (the same weights for all; None: as
    built), warmed on the same ``warm`` batches. ``range_modes``: 'ema' / 'batch' / 'union', or
    None for the model's own. Returns the reports, each with ``policy`` added."""
    warm = list(warm)
    out = []
    for policy in policies:
        for mode in range_modes:
            model = build(policy)
            if state_dict is not None:
                model.load_state_dict(state_dict)
            rep = grad_fidelity(model, x, target, warm=warm, range_mode=mode, **kwargs)
            out.append({"policy": policy, **rep})
    return out
