"""The mmseg backbones of this package (one import place): :class:`MesaSwinTransformer` (mmseg's
SwinTransformer contract, :mod:`models.seg.swin_backbone`), :class:`MesaPVT` (mmdet's PVT v1
contract, :mod:`models.seg.pvt_backbone`) and the ``MesaCompressed`` builder
(:mod:`models.seg.compressed`: ``ms.compress`` on any mmseg backbone); shared parts in
:mod:`models.seg.base`. Used for the Semantic FPN (PVT) and UperNet (Swin) ADE20K experiments of
the paper (Pan et al., arXiv 2111.11124, Sec. 5)."""
from .base import MesaBackbone, resolve_policy
from .compressed import MesaCompressed
from .pvt_backbone import PVT_ARCHS, MesaPVT
from .swin_backbone import SWIN_ARCHS, MesaSwinTransformer, shifted_window_mask

__all__ = ["MesaPVT", "MesaSwinTransformer", "MesaCompressed", "MesaBackbone", "resolve_policy",
           "PVT_ARCHS", "SWIN_ARCHS", "shifted_window_mask"]
