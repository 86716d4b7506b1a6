"""Mesa versions of timm layers that subclass an ``nn`` layer but have their own forward, so the
generic conversion (which replaces a layer only where its forward is the ``nn`` one) cannot take
them. Imported only when a model holds such a layer (timm is then loaded already).

* :class:`MesaBatchNormAct2d`: timm's ``BatchNormAct2d`` (batch norm, drop, activation in one
  module: EfficientViT, the ResNet-D stems of hybrids, ...): its batch norm stores x-hat as the
  Mesa batch norms do; its ``drop`` and ``act`` children are converted like any others. The
  conversion swaps the class of the module in place (parameters, buffers and children stay the
  same objects).
"""
from __future__ import annotations

import torch
from timm.layers.norm_act import BatchNormAct2d

from .layers import BatchNormBase


class MesaBatchNormAct2d(BatchNormBase, BatchNormAct2d):
    """timm's ``BatchNormAct2d`` whose batch norm stores x-hat (mesa_ops.layers.BatchNormBase)."""

    def forward(self, x):
        y = None if torch.jit.is_scripting() else self._mesa_forward(x)
        if y is None:
            return BatchNormAct2d.forward(self, x)
        return self.act(self.drop(y))


# qualified name of the timm class -> its Mesa class (exact type matches only)
SWAPS = {"timm.layers.norm_act.BatchNormAct2d": MesaBatchNormAct2d}
