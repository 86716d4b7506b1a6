"""A checked plan for any model: the gradients Mesa gives on the user's batch against exact ones.

    report = ms.verify(model, batch)                  # or ms.compress(model, 'mesa8', verify=batch)
    print(report.summary())

On ``batch`` (a tensor or a tuple of positional inputs) the exact gradient (every Mesa layer
off) and ``draws`` Mesa gradients (stochastic rounding draws differ) are computed for a fixed
random projection of the output (of a tuple, dict or Hugging Face ``ModelOutput``: its first
floating-point tensor with a gradient, e.g. ``loss`` or ``logits``; ``loss_fn`` overrides it:
``loss_fn(output) -> scalar``), the same dropout masks in every pass. Per parameter: the relative error ``||g - g_exact|| /
||g_exact||``, root mean square over the draws, and (issue 49) that error against the noise SGD
already has: the spread of exact gradients over minibatches, estimated from ``splits`` disjoint
parts of the batch (the exact gradient of each, scaled to the whole batch; the spread of their
mean is the noise of one batch of this size). Mesa's rounding noise is unbiased and independent
of the minibatch draw, so variances add: an error of ``r`` times the minibatch noise trains as a
batch ``1 / (1 + r^2)`` as large would. A parameter is flagged where ``r`` exceeds
``noise_threshold`` (default 0.5: Mesa adds more than a quarter to that parameter's gradient
variance, as cutting the batch by a fifth would); a batch of fewer than 4 samples (each part
needs two: a batch norm) flags by the relative error above ``threshold`` (default 5%) instead.
A flagged parameter is named with the stored copy that causes it: the Mesa layer whose switching back to exact
lowers that parameter's error the most. With ``leave_exact=True`` those layers are switched off
(exact) and the check is run again, attributing what is still above the threshold (three rounds
at most); ``report.after`` holds the errors then. Parameters whose exact gradient is ~0 (below 1e-6 of the
model's gradient norm, e.g. a bias before a batch norm) have no relative error and are not
flagged.

The model is left as it was: parameters, buffers (running ranges, batch-norm statistics, draw
counters), ``.grad`` and train/eval mode are restored, and torch's RNG too; only the layers
switched to exact with ``leave_exact`` stay so.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from .policy import mesa_layers


@dataclass
class VerifyReport:
    threshold: float
    draws: int
    errors: dict = field(default_factory=dict)      # parameter name -> relative gradient error
    flagged: list = field(default_factory=list)     # (parameter, score, culprit layer or None): the
    # score is the error / minibatch noise where that was measured, else the relative error
    noise: dict = field(default_factory=dict)       # parameter -> minibatch noise (norm, this batch size)
    vs_noise: dict = field(default_factory=dict)    # parameter -> Mesa's error / that noise
    noise_threshold: float | None = None            # the flag criterion when noise was measured
    splits: int = 0                                 # parts of the batch the noise came from
    noise_note: str = ""                            # why the noise was not measured, if it was not
    left_exact: list = field(default_factory=list)  # Mesa layers switched to exact (leave_exact)
    after: dict = field(default_factory=dict)       # errors once those are exact

    @property
    def worst(self) -> tuple[str, float]:
        errs = self.after or self.errors
        return max(errs.items(), key=lambda kv: kv[1], default=("", 0.0))

    def summary(self) -> str:
        name, err = max(self.errors.items(), key=lambda kv: kv[1], default=("-", 0.0))
        head = (f"mesa verify: {len(self.errors)} parameters, {self.draws} draws, largest relative "
                f"gradient error {100 * err:.2f}% ({name})")
        if self.vs_noise:
            n2, r = max(self.vs_noise.items(), key=lambda kv: kv[1])
            lines = [f"{head}; largest error vs minibatch noise ({self.splits} parts of the batch) "
                     f"{r:.2f}x ({n2}); {len(self.flagged)} above {self.noise_threshold:g}x"]
            lines += [f"  {p}: {r:.2f}x the minibatch noise ({100 * self.errors.get(p, 0.0):.1f}% relative), "
                      f"from {c or '(no single Mesa layer)'}" for p, r, c in self.flagged]
        else:
            lines = [f"{head}; {len(self.flagged)} above {100 * self.threshold:g}%"
                     + (f" ({self.noise_note})" if self.noise_note else "")]
            lines += [f"  {p}: {100 * e:.1f}%, from {c or '(no single Mesa layer)'}" for p, e, c in self.flagged]
        if self.left_exact:
            n, e = self.worst
            lines.append(f"left exact: {', '.join(self.left_exact)}; largest error now {100 * e:.2f}% ({n})")
        return "\n".join(lines)


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


class _Snapshot:
    """Parameters, buffers, gradients, mode and RNG of ``model``, restored on exit."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __enter__(self):
        m = self.model
        self.state = {k: v.detach().clone() for k, v in m.state_dict(keep_vars=True).items()
                      if isinstance(v, torch.Tensor)}
        self.grads = {n: (None if p.grad is None else p.grad.clone()) for n, p in m.named_parameters()}
        self.training = m.training
        self.rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        return self

    def __exit__(self, *exc):
        m = self.model
        with torch.no_grad():
            for k, v in m.state_dict(keep_vars=True).items():
                if k in self.state and isinstance(v, torch.Tensor):
                    v.copy_(self.state[k])
        for n, p in m.named_parameters():
            p.grad = self.grads.get(n)
        m.train(self.training)
        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        return False


def _grads(model, inputs, loss_fn, seed: int) -> dict:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout / drop-path masks in every pass
    loss_fn(model(*inputs)).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _output_tensor(out):
    """The tensor of a model's output the check projects: the output itself, or the first
    floating-point tensor with a gradient in a tuple, list, dict or Hugging Face ``ModelOutput``
    (its ``loss`` when it has one, else e.g. its ``logits``), or None."""
    if isinstance(out, torch.Tensor):
        return out if out.is_floating_point() else None
    if isinstance(out, Mapping):  # (a ModelOutput is an OrderedDict of the fields that are set)
        items = out.values()
    elif isinstance(out, (tuple, list)):
        items = out
    elif callable(getattr(out, "to_tuple", None)):
        items = out.to_tuple()
    else:
        return None
    for it in items:
        t = _output_tensor(it)
        if t is not None and t.requires_grad:
            return t
    return None


def _projection(seed: int):
    """A fixed random projection of the output (of any tensor shape; of a structured output its
    tensor :func:`_output_tensor` picks): the loss of the check."""
    cache = {}

    def loss(output, rows: slice | None = None, batch: int = 0):
        """``rows``: the output is those rows of a batch of ``batch``: the same rows of that
        batch's projection (the parts' losses then sum to the whole batch's)."""
        out = _output_tensor(output)
        if out is None:
            raise TypeError(f"ms.verify: the model's output ({type(output).__name__}) holds no floating-point "
                            "tensor with a gradient to check; pass loss_fn=lambda output: <a scalar>")
        shape = tuple(out.shape)
        if rows is not None and out.dim() > 0:
            shape = (batch,) + shape[1:]
        key = (shape, out.device)
        if key not in cache:
            gen = torch.Generator().manual_seed(seed)
            cache[key] = torch.randn(shape, generator=gen).to(out.device) / math.sqrt(math.prod(shape))
        proj = cache[key] if rows is None or out.dim() == 0 else cache[key][rows]
        return (out.float() * proj).sum()
    return loss


def _norms(exact: dict) -> dict:
    """{parameter: ||g_exact||} of the parameters with a relative error: those whose exact
    gradient is above 1e-6 of the model's gradient norm."""
    norms = {n: float(g.float().norm()) for n, g in exact.items()}
    total = math.sqrt(sum(v * v for v in norms.values()))
    return {n: v for n, v in norms.items() if v > 1e-6 * total}


def _errors(grads: list[dict], exact: dict, scale: dict) -> dict:
    """{parameter: RMS over the draws of ||g - g_exact||, divided by ``scale[parameter]``}."""
    out = {}
    for name, ref in scale.items():
        ge = exact[name].float()
        sq = [float((d[name].float() - ge).norm()) ** 2 for d in grads if name in d]
        out[name] = math.sqrt(sum(sq) / max(1, len(sq))) / ref if ref > 0 else 0.0
    return out


def _split(inputs: tuple, parts: int):
    """``inputs`` cut into ``parts`` (at most one per two rows) along the batch dim (that of the
    first tensor: every tensor with that many rows is cut, anything else passed whole):
    [(rows, inputs of the part)], or [] when the batch has fewer than 4 rows."""
    first = next((t for t in inputs if isinstance(t, torch.Tensor) and t.dim() > 0), None)
    b = 0 if first is None else first.shape[0]
    k = min(parts, b // 2)  # (two rows a part at least: a batch norm needs more than one value)
    if k < 2:
        return []
    bounds = [round(i * b / k) for i in range(k + 1)]
    return [(slice(lo, hi), tuple(t[lo:hi] if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == b
                                  else t for t in inputs)) for lo, hi in zip(bounds, bounds[1:])]


def _minibatch_noise(model, inputs, loss_fn, default_loss: bool, exact: dict, seed: int, parts: int) -> dict:
    """{parameter: the spread of exact gradients over minibatches of this batch's size}: the
    exact gradient of each of ``parts`` disjoint parts g_i, scaled to the whole batch by
    c = ||g_batch|| / ||mean_i g_i|| (c = parts for a summed loss, 1 for a mean), their standard
    deviation over the parts divided by sqrt(parts): the noise of the whole batch's gradient,
    which averages the parts. {} when the batch cannot be split."""
    chunks = _split(inputs, parts)
    if not chunks:
        return {}
    b = chunks[-1][0].stop
    grads = []
    for rows, sub in chunks:
        part_loss = (lambda out, rows=rows: loss_fn(out, rows, b)) if default_loss else loss_fn
        grads.append(_grads(model, sub, part_loss, seed))
    names = [n for n in exact if all(n in g for g in grads)]
    mean = {n: sum(g[n].float() for g in grads) / len(grads) for n in names}
    full = math.sqrt(sum(float(exact[n].float().square().sum()) for n in names))
    avg = math.sqrt(sum(float(mean[n].square().sum()) for n in names))
    c = full / avg if avg > 0 else 1.0
    k = len(grads)
    return {n: c * math.sqrt(sum(float((g[n].float() - mean[n]).square().sum()) for g in grads) / (k - 1))
            / math.sqrt(k) for n in names}


def _attribute(errs: dict, threshold: float, layers: list, off, errors) -> list:
    """(parameter, error, culprit) of the parameters above ``threshold``: each enabled layer not
    in ``off`` switched back to exact alone (one draw); the culprit is the layer whose switch
    lowers that parameter's error the most (None when none does)."""
    bad = {p: e for p, e in errs.items() if e > threshold}
    if not bad:
        return []
    trials = {name: errors(off=tuple(off) + (m,), n_draws=1) for name, m in layers if m not in off}
    out = []
    for p, e in sorted(bad.items(), key=lambda kv: -kv[1]):
        best = min(trials, key=lambda n: trials[n].get(p, e), default=None)
        out.append((p, e, best if best is not None and trials[best].get(p, e) < e else None))
    return out


def verify(model: nn.Module, example_inputs, loss_fn=None, draws: int = 3, threshold: float = 0.05,
           leave_exact: bool = False, rounds: int = 3, seed: int = 0, noise_threshold: float = 0.5,
           splits: int = 4) -> VerifyReport:
    """Check Mesa's gradients on ``example_inputs`` against exact ones (see the module docstring).

    Args:
        model: a model with Mesa layers (``ms.compress``, a policy, this repo's models).
        example_inputs: a tensor or a tuple of positional inputs, e.g. a (B, 3, H, W) batch.
        loss_fn: ``loss_fn(output) -> scalar`` (default: a fixed random projection of the output);
            it is also called on the outputs of parts of the batch (the minibatch noise): one that
            cannot take them (labels of the whole batch closed over) falls back to ``threshold``.
        draws: Mesa passes (each a different stochastic rounding).
        threshold: relative gradient error above which a parameter is flagged when the
            minibatch noise cannot be measured (a batch of one).
        noise_threshold: Mesa's error / the minibatch noise above which a parameter is flagged.
        splits: parts of the batch the minibatch noise is estimated from (at most one per row).
        leave_exact: switch the layers causing flagged errors to exact and check again, up to
            ``rounds`` times (an error may come from several stored copies).
    Returns:
        a :class:`VerifyReport`.
    """
    inputs = _as_tuple(example_inputs)
    default_loss = loss_fn is None
    loss_fn = loss_fn or _projection(seed)
    layers = [(n, m) for n, m in mesa_layers(model) if m.enable]
    report = VerifyReport(threshold=threshold, draws=draws)
    if not layers:
        return report

    def set_enable(off=()):
        for _, m in layers:
            m.enable = m not in off

    with _Snapshot(model):
        model.train()
        try:
            set_enable(off=[m for _, m in layers])  # the exact pass: every Mesa layer off
            exact = _grads(model, inputs, loss_fn, seed)
            norms = _norms(exact)
            try:
                noise = _minibatch_noise(model, inputs, loss_fn, default_loss, exact, seed, splits)
            except (ValueError, RuntimeError, IndexError, TypeError) as exc:  # a loss_fn of the whole batch
                noise, report.noise_note = {}, (f"no minibatch noise: loss_fn failed on a part of the batch "
                                                f"({type(exc).__name__}); judged by relative error")
            noise = {n: v for n, v in noise.items() if n in norms}
            limit = noise_threshold if noise else threshold
            scale = noise or norms  # the flag criterion's denominator

            def errors(off=(), n_draws=draws) -> dict:
                set_enable(off)
                return _errors([_grads(model, inputs, loss_fn, seed) for _ in range(n_draws)], exact, scale)

            set_enable()
            mesa = [_grads(model, inputs, loss_fn, seed) for _ in range(draws)]
            report.errors = _errors(mesa, exact, norms)
            score = report.errors
            if noise:
                report.noise, report.noise_threshold, report.splits = noise, noise_threshold, len(_split(inputs, splits))
                report.vs_noise = score = _errors(mesa, exact, noise)
            report.flagged = _attribute(score, limit, layers, (), errors)
            pending, off_names = report.flagged, []
            for _ in range(rounds if leave_exact else 0):
                # switch the culprits so far to exact; check again; attribute what is left
                new = {c for _, _, c in pending if c is not None} - set(off_names)
                if not new:
                    break
                off_names += sorted(new)
                off = [m for n, m in layers if n in off_names]
                set_enable(off)
                mesa = [_grads(model, inputs, loss_fn, seed) for _ in range(draws)]
                report.after = _errors(mesa, exact, norms)
                pending = _attribute(_errors(mesa, exact, scale), limit, layers, off, errors)
                if not pending:
                    break
            report.left_exact = sorted(off_names)
        finally:
            set_enable()
    for name, m in layers:  # (after the snapshot's restore: these stay exact)
        if name in report.left_exact:
            m.enable = False
    return report
