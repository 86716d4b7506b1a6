"""A checked plan for any model: the gradients Mesa gives on the user's batch against exact ones.

    report = ms.verify(model, batch)                  # or ms.compress(model, 'mesa8', verify=batch)
    print(report.summary())

On ``batch`` (a tensor or a tuple of positional inputs) the exact gradient (every Mesa layer
off) and ``draws`` Mesa gradients (stochastic rounding draws differ) are computed for a fixed
random projection of the output (of a tuple, dict or Hugging Face ``ModelOutput``: its first
floating-point tensor with a gradient, e.g. ``loss`` or ``logits``; ``loss_fn`` overrides it:
``loss_fn(output) -> scalar``), the same dropout masks in every pass. Per parameter: the relative error ``||g - g_exact|| /
||g_exact||``, root mean square over the draws. Every parameter above ``threshold`` (default 5%)
is flagged with the stored copy that causes it: the Mesa layer whose switching back to exact
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
    flagged: list = field(default_factory=list)     # (parameter, error, culprit layer or None)
    left_exact: list = field(default_factory=list)  # Mesa layers switched to exact (leave_exact)
    after: dict = field(default_factory=dict)       # errors once those are exact

    @property
    def worst(self) -> tuple[str, float]:
        errs = self.after or self.errors
        return max(errs.items(), key=lambda kv: kv[1], default=("", 0.0))

    def summary(self) -> str:
        name, err = max(self.errors.items(), key=lambda kv: kv[1], default=("-", 0.0))
        lines = [f"mesa verify: {len(self.errors)} parameters, {self.draws} draws, largest relative "
                 f"gradient error {100 * err:.2f}% ({name}); {len(self.flagged)} above "
                 f"{100 * self.threshold:g}%"]
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

    def loss(output):
        out = _output_tensor(output)
        if out is None:
            raise TypeError(f"ms.verify: the model's output ({type(output).__name__}) holds no floating-point "
                            "tensor with a gradient to check; pass loss_fn=lambda output: <a scalar>")
        key = (tuple(out.shape), out.device)
        if key not in cache:
            gen = torch.Generator().manual_seed(seed)
            cache[key] = torch.randn(out.shape, generator=gen).to(out.device) / math.sqrt(out.numel())
        return (out.float() * cache[key]).sum()
    return loss


def _errors(grads: list[dict], exact: dict) -> dict:
    total = math.sqrt(sum(float(g.float().square().sum()) for g in exact.values()))
    out = {}
    for name, ge in exact.items():
        ref = float(ge.float().norm())
        if ref <= 1e-6 * total:
            continue
        sq = [float((d[name].float() - ge.float()).norm()) ** 2 for d in grads if name in d]
        out[name] = math.sqrt(sum(sq) / max(1, len(sq))) / ref
    return out


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
           leave_exact: bool = False, rounds: int = 3, seed: int = 0) -> VerifyReport:
    """Check Mesa's gradients on ``example_inputs`` against exact ones (see the module docstring).

    Args:
        model: a model with Mesa layers (``ms.compress``, a policy, this repo's models).
        example_inputs: a tensor or a tuple of positional inputs, e.g. a (B, 3, H, W) batch.
        loss_fn: ``loss_fn(output) -> scalar`` (default: a fixed random projection of the output).
        draws: Mesa passes (each a different stochastic rounding).
        threshold: relative gradient error above which a parameter is flagged.
        leave_exact: switch the layers causing flagged errors to exact and check again, up to
            ``rounds`` times (an error may come from several stored copies).
    Returns:
        a :class:`VerifyReport`.
    """
    inputs = _as_tuple(example_inputs)
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

            def errors(off=(), n_draws=draws) -> dict:
                set_enable(off)
                return _errors([_grads(model, inputs, loss_fn, seed) for _ in range(n_draws)], exact)

            report.errors = errors()
            report.flagged = _attribute(report.errors, threshold, layers, (), errors)
            pending, off_names = report.flagged, []
            for _ in range(rounds if leave_exact else 0):
                # switch the culprits so far to exact; check again; attribute what is left
                new = {c for _, _, c in pending if c is not None} - set(off_names)
                if not new:
                    break
                off_names += sorted(new)
                off = [m for n, m in layers if n in off_names]
                report.after = errors(off=off)
                pending = _attribute(report.after, threshold, layers, off, errors)
                if not pending:
                    break
            report.left_exact = sorted(off_names)
        finally:
            set_enable()
    for name, m in layers:  # (after the snapshot's restore: these stay exact)
        if name in report.left_exact:
            m.enable = False
    return report
