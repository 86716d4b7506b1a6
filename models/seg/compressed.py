"""``dict(type='MesaCompressed', backbone=dict(type=..., ...), ms_policy='mesa8')``: Mesa for any
mmseg backbone (SegFormer's MixVisionTransformer, Twins, mmseg's own SwinTransformer and
VisionTransformer, ...), through :func:`mesa_ops.compress`.

``MesaCompressed`` is registered in ``mmseg.registry.MODELS`` as a builder function: it builds the
inner backbone from its config, converts it in place (``nn.Linear`` / ``Conv2d`` / ``LayerNorm`` /
``BatchNorm2d`` / ``GELU`` / ``Softmax`` / ``ReLU`` become Mesa layers holding the same
parameters; timm attention modules get a Mesa core) and returns **that backbone**: its class,
``forward``, ``init_weights``, ``train`` (frozen stages, norm_eval) and state-dict keys are the
backbone's own (the converted layers add quantizer state only), so its mmseg checkpoints load.

The coverage report goes to the log (``print_log``, logger 'current'): the converted layers, the
modules Mesa left exact and why, and, unless ``audit_input_size=None``, an audit of one training
forward on a random (1, C, h, w) input (:func:`mesa_ops.audit`): the bytes saved for backward,
the share Mesa packed and the largest uncompressed modules (for mmseg's own attention code, e.g.
the ``q @ k^T`` / ``attn @ v`` matmuls of its WindowMSA, which ``compress`` cannot see). The audit
leaves every buffer (Mesa ranges, BN statistics) as it found it. The report is kept as the
backbone's ``mesa_compress_report`` attribute (a :class:`mesa_ops.compress.CompressReport`).
"""
from __future__ import annotations

import torch
import torch.nn as nn
from mmengine.logging import print_log
from mmseg.registry import MODELS

import mesa_ops as ms

from .base import resolve_policy

__all__ = ["MesaCompressed"]


def _in_channels(model: nn.Module) -> int:
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            return m.in_channels
    raise ValueError(f"MesaCompressed: {type(model).__name__} has no Conv2d to read the input channels "
                     "from; pass audit_input_size=None")


def _audit(model: nn.Module, size) -> "ms.audit.AuditReport":
    """One training forward of a random (1, C, *size) input, every buffer restored afterwards."""
    from mesa_ops.audit import audit
    saved = {n: b.detach().clone() for n, b in model.named_buffers()}
    x = torch.randn(1, _in_channels(model), *size, device=next(iter(model.parameters())).device)
    try:
        return audit(model, x, verbose=False)
    finally:
        with torch.no_grad():
            for n, b in model.named_buffers():
                if n in saved and saved[n].shape == b.shape:
                    b.copy_(saved[n])


def MesaCompressed(backbone: dict, ms_policy="mesa8", quant_groups="heads", audit_input_size=(64, 64)):
    """Build ``backbone`` (an mmseg backbone config) and convert it with ``ms.compress``.

    Args:
        backbone: the inner backbone's config dict (``type`` and its arguments).
        ms_policy: 'mesa8' / 'mesa4' / 'mesa2', 'off' (converted, compression off), a policy file
            (relative paths also looked up under the repository root) or a dict of
            ``ms.policy.set_mesa`` arguments (see :func:`mesa_ops.compress`).
        quant_groups: 'heads' (one group per head inside attention blocks) or an int.
        audit_input_size: (h, w) of the audit's random input, or None for no audit.
    Returns:
        the inner backbone, converted in place (see the module docstring).
    """
    if not isinstance(backbone, dict) or "type" not in backbone:
        raise TypeError(f"MesaCompressed: backbone must be a config dict with a 'type', got {backbone!r}")
    if isinstance(backbone.get("type"), str) and backbone["type"] == "MesaCompressed":
        raise ValueError("MesaCompressed: the inner backbone is MesaCompressed again")
    model = MODELS.build(backbone)
    model, report = ms.compress(model, resolve_policy(ms_policy), quant_groups=quant_groups,
                                return_report=True, warn=False)
    name = backbone["type"] if isinstance(backbone["type"], str) else type(model).__name__
    lines = report.summary().splitlines()
    if audit_input_size is not None:
        if len(audit_input_size) != 2:
            raise ValueError(f"MesaCompressed: audit_input_size={audit_input_size!r}: expected (h, w)")
        report.audit = _audit(model, tuple(audit_input_size))
        listed = {n for n, _, _ in report.unsupported}
        for row in report.audit.uncompressed():
            if row.name not in listed and not row.is_mesa:
                report.unsupported.append((row.name, row.type, f"saved {row.exact_bytes} bytes uncompressed "
                                           "in a training forward"))
        lines = report.summary().splitlines()
        lines.append(f"audit of one training forward at (1, {_in_channels(model)}, "
                     f"{audit_input_size[0]}, {audit_input_size[1]}):")
        lines += report.audit.table(max_rows=0).splitlines()[-2:]
    for line in lines:
        print_log(f"MesaCompressed({name}): {line}", logger="current")
    model.mesa_compress_report = report
    return model


MODELS.register_module(name="MesaCompressed", module=MesaCompressed)
