"""DeiT, Swin and PVT built from ``mesa_ops`` layers, weight-compatible with their official
checkpoints, with Mesa (low-bit activation storage for backward) on or off per model.

    import models
    model = models.create_model("deit_small_patch16_224", pretrained="deit_small.pth",
                                ms_policy="configs/mesa/mesa_8bit.txt")   # or "mesa8", or None
    models.list_models("swin*")
    report = models.load_checkpoint(model, "checkpoint.pth")

Importing this package also registers every model with timm as ``mesa_<name>``; the models follow
timm's model contract (``features_only``, ``forward_intermediates``, ``group_matcher``,
``set_grad_checkpointing``, ``pretrained_cfg``: see :mod:`models.timm_api`).
"""
from . import checkpoint, demo, export, layers, registry, timm_api
from .checkpoint import CheckpointError, LoadReport, load_checkpoint, save_checkpoint
from .registry import MESA_TAGS, TIMM_PREFIX, apply_policy, create_model, is_model, list_models
from . import deit, pvt, swin  # noqa: E402  (registers the models)
from . import scale  # noqa: E402  (needs the registry filled)

__all__ = ["create_model", "list_models", "is_model", "load_checkpoint", "save_checkpoint", "apply_policy",
           "CheckpointError", "LoadReport", "MESA_TAGS", "TIMM_PREFIX", "deit", "swin", "pvt", "layers",
           "checkpoint", "export", "registry", "scale", "timm_api", "demo"]
