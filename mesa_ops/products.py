"""Elementwise products with a module's own parameter under :func:`mesa_ops.compress` (issue 49,
item 2): a layer scale written inline (``self.lambda_1 * x`` in transformers' BEiT layer,
``self.layer_scale * self.block(x)`` in torchvision's ConvNeXt block, ``x * self.lambda1`` in
transformers' Dinov2LayerScale and its kin, an RMS norm's ``self.weight * x``) saves x exactly for
the parameter's gradient. A module whose forward multiplies by one of its own parameters of
per-channel shape ((C,), (C, 1, 1), (1, 1, C): read from its source) has its class swapped for a
subclass that, while Mesa is on, routes those products to a Mesa :class:`ProductScale`
(``mesa_products[<parameter name>]``): x stored packed (groups along the parameter's channel
dim), the gradient of x (g * gamma) exact, the product bit for bit the original. Products with a
computed gate (squeeze-excitation's ``scale * x``) are not parameters: they stay exact and the
audit of ``compress(..., example_inputs=...)`` names the module that saves them.
"""
from __future__ import annotations

import inspect
import re

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from .attention_forms import _MULS, MesaAttentionMixin
from .layers import MESA_LAYERS, LayerScaleBase

__all__ = ["ProductScale", "convert_products"]



class ProductScale(LayerScaleBase, nn.Module):
    """``x * s`` with s a per-channel parameter another module owns: x stored at ``bits`` bits,
    groups along ``group_dim`` ('last': s of shape (C,) or (1, 1, C); 'channel': (C, 1, 1) on
    (B, C, H, W)), for s's gradient; the gradient of x exact."""

    def __init__(self, group_dim: str = "last", mesa=False, args=None, logger=None, quant_groups=1,
                 bits=8, enable=False):
        nn.Module.__init__(self)
        self.group_dim = group_dim
        self._setup("scale", mesa, enable, quant_groups, bits)

    def forward(self, x, s):
        y = self._mesa_forward(x, s)
        return x * s if y is None else y


class _ProductsToMesa(TorchFunctionMode):
    """Routes, in one forward of its owner, ``x * p`` / ``p * x`` with ``p`` one of the owner's
    routed parameters (that very tensor) and x of the product's shape to the owner's
    ``mesa_products[name]``; every other call runs as it is."""

    def __init__(self, owner):
        super().__init__()
        self.owner = owner
        self.routes = {id(owner._parameters[n]): n for n in owner.mesa_products}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _MULS and not kwargs and len(args) == 2:
            a, b = args
            for x, p in ((a, b), (b, a)):
                name = self.routes.get(id(p))
                if (name is not None and isinstance(x, torch.Tensor) and x.dim() >= p.dim()
                        and torch.broadcast_shapes(x.shape, p.shape) == x.shape):
                    return self.owner.mesa_products[name](x, p)
        return func(*args, **kwargs)


class MesaProductsMixin:
    """In front of a module's class: its own forward, with its products by its routed
    parameters stored packed while Mesa is on (training, grad enabled, a product enabled)."""

    def forward(self, *args, **kwargs):
        on = self.training and torch.is_grad_enabled() and any(m.enable for m in self.mesa_products.values())
        if not on:
            return super().forward(*args, **kwargs)
        with _ProductsToMesa(self):
            return super().forward(*args, **kwargs)


_SUBCLASSES: dict = {}


def _scales(m: nn.Module) -> dict:
    """{parameter name: group dim} of ``m``'s own per-channel parameters its forward multiplies by
    (``self.<name> *`` or ``* self.<name>`` in its source)."""
    cands = {n: p for n, p in m._parameters.items()
             if p is not None and p.is_floating_point() and p.dim() in (1, 3) and p.numel() == max(p.shape)}
    if not cands:
        return {}
    try:
        src = inspect.getsource(type(m).forward)
    except (OSError, TypeError):
        return {}
    out = {}
    for n, p in cands.items():
        if re.search(rf"\bself\.{re.escape(n)}\s*\*(?!\*)|(?<!\*)\*\s*self\.{re.escape(n)}\b", src):
            out[n] = "channel" if p.dim() == 3 and p.shape[0] > 1 else "last"
    return out


def convert_products(model: nn.Module, groups_of) -> None:
    """Swap the class of every module of ``model`` that multiplies by its own per-channel
    parameter (see the module docstring) and give it ``mesa_products``; ``groups_of(name)``:
    the group count asked for the module (the largest divisor of its channels not above it)."""
    for name, m in list(model.named_modules()):
        if (isinstance(m, MESA_LAYERS + (MesaAttentionMixin, MesaProductsMixin))
                or type(m).__module__.startswith("torch.nn")):
            continue
        scales = _scales(m)
        if not scales:
            continue
        cls = type(m)
        if cls not in _SUBCLASSES:
            _SUBCLASSES[cls] = type(f"Mesa{cls.__name__}", (MesaProductsMixin, cls),
                                    {"__module__": __name__,
                                     "__doc__": f"{cls.__qualname__} with its layer-scale products stored "
                                                "packed (mesa_ops.products)."})
        ops = nn.ModuleDict()
        for pname, dim in scales.items():
            p = m._parameters[pname]
            c, g = p.numel(), int(groups_of(name))
            g = max(d for d in range(1, g + 1) if c % d == 0)
            ops[pname] = ProductScale(dim, quant_groups=g).to(p.device if p.device.type != "meta" else "cpu")
        m.__class__ = _SUBCLASSES[cls]
        m.mesa_products = ops
        ops.train(m.training)
