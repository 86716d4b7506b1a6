"""Adapters trained on a frozen model (LoRA through peft) under Mesa.

peft's LoRA ``Linear`` computes ``base(x) + B(A(dropout(x))) * scaling``. After
:func:`mesa_ops.compress` its three Linears are Mesa layers, and:

* the frozen ``base_layer`` stores nothing (no weight gradient; its input gradient needs only the
  weight);
* ``A``'s input is the tensor the layer before stored already (a LayerNorm's x-hat, a GELU's
  input, an attention output carrying its packed copy): ``A`` reuses that copy instead of storing
  its own (the sharing of :func:`mesa_ops.saved.find_saved`);
* ``B``'s input, (..., r), is stored at the layer's bits.

peft first casts x to ``A``'s weight dtype (float32 under autocast): a new tensor, without the
packed copy, so ``A`` stored a second one. Under autocast, where ``A``'s linear runs in
autocast's dtype whatever its input's, the cast changes no bits: a converted LoRA layer skips it
when x already has autocast's dtype, ``A``'s weight is float32 and its dropout is off
(:class:`MesaLoraMixin`).
"""
from __future__ import annotations

import sys

import torch
import torch.nn as nn

from .quant import QuantMixin

__all__ = ["MesaLoraMixin", "convert_lora_layers"]


class MesaLoraMixin:
    """Mixed in front of a peft LoRA layer class by :func:`convert_lora_layers`."""

    def _cast_input_dtype(self, x, dtype: torch.dtype):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            dev = x.device.type
            if (dtype == torch.float32 and torch.is_autocast_enabled(dev)
                    and x.dtype == torch.get_autocast_dtype(dev) and not getattr(self, "lora_variant", None)
                    and all(isinstance(d, nn.Identity) or getattr(d, "p", 1.0) == 0
                            for d in getattr(self, "lora_dropout", {}).values())):
                return x  # (autocast casts it to x.dtype again in A's linear: the same bits)
        return super()._cast_input_dtype(x, dtype)


_SUBCLASSES: dict = {}


def _is_lora_layer(m: nn.Module) -> bool:
    lora = sys.modules.get("peft.tuners.lora")  # (peft is not imported here: only if the user did)
    layer = getattr(lora, "LoraLayer", None)
    return (layer is not None and isinstance(m, layer) and hasattr(m, "_cast_input_dtype")
            and not isinstance(m, MesaLoraMixin))


def convert_lora_layers(model: nn.Module) -> int:
    """Swap each peft LoRA layer's class for a subclass with :class:`MesaLoraMixin` first (same
    state, same parameter names) and give each adapter's A the groups of the base layer (whose
    input it takes, and whose stored copy it may share); returns how many were converted."""
    n = 0
    for m in model.modules():
        if _is_lora_layer(m):
            cls = type(m)
            if cls not in _SUBCLASSES:
                _SUBCLASSES[cls] = type(f"Mesa{cls.__name__}", (MesaLoraMixin, cls),
                                        {"__module__": __name__, "__doc__": cls.__doc__})
            m.__class__ = _SUBCLASSES[cls]
            base = getattr(m, "base_layer", None)
            for a in m.lora_A.values():  # A stores what the base layer would: the same groups
                if isinstance(a, QuantMixin) and isinstance(base, QuantMixin):
                    a._resize_groups(int(base.quant_groups))
            n += 1
    return n
