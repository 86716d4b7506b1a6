"""Mesa versions of Hugging Face transformers layers that the generic conversion cannot take
(imported only when a model holds one: transformers is then loaded already).

* :class:`MesaConv1D`: transformers' ``Conv1D`` (GPT-2's and GPT's projections: a Linear with
  its weight stored transposed, (in, out)); stores its input (..., nx) at ``bits`` bits, groups
  along it, as :class:`mesa_ops.Linear` does (one path: ``functional.linear_fn`` on the
  transposed view of the same weight). The conversion swaps the class of the module in place
  (the parameters stay the same objects; no new state-dict key but the quantizer's).
"""
from __future__ import annotations

import torch
from transformers.pytorch_utils import Conv1D

from . import functional as MF
from .layers import LinearBase

__all__ = ["MesaConv1D", "SWAPS"]


class MesaConv1D(LinearBase, Conv1D):
    """transformers' ``Conv1D`` (x (..., nx) @ weight (nx, nf) + bias) storing x packed."""

    @property
    def in_features(self) -> int:
        return int(self.nx)

    def forward(self, x):
        w = self.weight
        if not torch.jit.is_scripting() and self.enable and self.training and w.requires_grad \
                and torch.is_grad_enabled():
            return MF.linear_fn(x, w.t(), self.bias, self)
        return Conv1D.forward(self, x)

    def __repr__(self) -> str:
        return f"MesaConv1D(nf={self.nf}, nx={self.nx}, {self.extra_repr()})"


# qualified name -> (its Mesa class, policy tag, its channels) (exact types): see mesa_ops.policy
SWAPS = {"transformers.pytorch_utils.Conv1D": (MesaConv1D, "fc", lambda m: int(m.nx))}
