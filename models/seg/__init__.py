"""ADE20K semantic segmentation on mmsegmentation 1.x with this repo's Mesa backbones.

Importing this package (configs do it with
``custom_imports=dict(imports=['models.seg'], allow_failed_imports=False)``)

1. activates the ``mmcv._ext`` stub when mmcv-lite is installed (:mod:`models.seg.mmcv_ext_stub`;
   full mmcv's compiled ops are used when present),
2. imports mmseg's models and registers in ``mmseg.registry.MODELS`` the backbones
   :class:`MesaSwinTransformer` (mmseg's SwinTransformer contract) and :class:`MesaPVT` (mmdet's
   PVT v1 contract), and the builder ``MesaCompressed`` (``ms.compress`` on any mmseg backbone).

``models/__init__.py`` does not import this package (mmseg is heavy); import it explicitly.
"""
from . import mmcv_ext_stub

mmcv_ext_stub.install()

import mmseg.models  # noqa: E402,F401  (registers mmseg's heads, necks, losses, segmentors)

from .backbones import MesaCompressed, MesaPVT, MesaSwinTransformer, resolve_policy  # noqa: E402
from .runner import (build_config, register_checkpoint_safe_globals, run_test,  # noqa: E402
                     run_train, sync_bn_to_bn)

__all__ = ["MesaPVT", "MesaSwinTransformer", "MesaCompressed", "resolve_policy", "mmcv_ext_stub", "build_config",
           "register_checkpoint_safe_globals", "run_train", "run_test", "sync_bn_to_bn"]
