"""Mesa versions of timm layers that subclass an ``nn`` layer but have their own forward, so the
generic conversion (which replaces a layer only where its forward is the ``nn`` one) cannot take
them. Imported only when a model holds such a layer (timm is then loaded already).

* :class:`MesaBatchNormAct2d`: timm's ``BatchNormAct2d`` (batch norm, drop, activation in one
  module: EfficientViT, the ResNet-D stems of hybrids, ...): its batch norm stores x-hat as the
  Mesa batch norms do; its ``drop`` and ``act`` children are converted like any others. The
  conversion swaps the class of the module in place (parameters, buffers and children stay the
  same objects).
* :class:`MesaLayerScale` / :class:`MesaLayerScale2d`: timm's ``LayerScale`` (x * gamma on
  (..., C)) and ``LayerScale2d`` (on (B, C, H, W)): x stored packed for gamma's gradient
  (mesa_ops.layers.LayerScaleBase); ``inplace`` is honoured when compression is off.
"""
from __future__ import annotations

import torch
from timm.layers.norm_act import BatchNormAct2d

from .layers import BatchNormBase, LayerScaleBase

try:  # (timm >= 1.0.8: timm.layers.layer_scale; before: in vision_transformer / not there)
    from timm.layers.layer_scale import LayerScale, LayerScale2d
except ImportError:
    from timm.models.vision_transformer import LayerScale
    LayerScale2d = None


class MesaBatchNormAct2d(BatchNormBase, BatchNormAct2d):
    """timm's ``BatchNormAct2d`` whose batch norm stores x-hat (mesa_ops.layers.BatchNormBase)."""

    def forward(self, x):
        y = None if torch.jit.is_scripting() else self._mesa_forward(x)
        if y is None:
            return BatchNormAct2d.forward(self, x)
        return self.act(self.drop(y))


class MesaLayerScale(LayerScaleBase, LayerScale):
    """timm's ``LayerScale`` storing x packed (groups along the last dim) for gamma's gradient."""

    group_dim = "last"

    def forward(self, x):
        y = self._mesa_forward(x, self.gamma)
        return LayerScale.forward(self, x) if y is None else y


def _qualname(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


# qualified name of the timm class -> (its Mesa class, policy tag, its channels) (exact types)
SWAPS = {"timm.layers.norm_act.BatchNormAct2d": (MesaBatchNormAct2d, "bn", lambda m: m.num_features),
         _qualname(LayerScale): (MesaLayerScale, "scale", lambda m: m.gamma.numel())}

if LayerScale2d is not None:
    class MesaLayerScale2d(LayerScaleBase, LayerScale2d):
        """timm's ``LayerScale2d`` storing x packed (groups along channels) for gamma's gradient."""

        group_dim = "channel"

        def forward(self, x):
            y = self._mesa_forward(x, self.gamma.view(1, -1, 1, 1))
            return LayerScale2d.forward(self, x) if y is None else y

    SWAPS[_qualname(LayerScale2d)] = (MesaLayerScale2d, "scale", lambda m: m.gamma.numel())
