"""mesa_ops: memory-saving training of Transformers by low-bit activation storage.

``import mesa_ops as ms`` gives the original Mesa API (Pan et al., arXiv 2111.11124):
``ms.Linear, ms.Conv2d, ms.LayerNorm, ms.GELU, ms.Softmax, ms.MatMul, ms.BatchNorm2d, ms.ReLU``
(and ``ms.BatchNorm1d``, ``ms.BatchNorm3d``, ``ms.SyncBatchNorm``, and for cosine attention
``ms.Normalize``, ``ms.Scale``)
and ``ms.policy`` (``convert_by_num_groups``, ``convert_by_group_size``, ``deploy_on_init``,
``deploy_on_epoch``). Kernels in ``cuda/`` are JIT-built on first use, never at import.
"""
from . import backend, functional, memory, policy, reference
from .attention import SDPA
from .layers import (MESA_LAYERS, BatchNorm1d, BatchNorm2d, BatchNorm3d, Conv2d, GELU, LayerNorm, Linear,
                     LinearFn, MatMul, Normalize, ReLU, Scale, Softmax, SyncBatchNorm)
from .memory import SavedActivationMeter, saved_activation_bytes
from .audit import audit
from .compress import compress
from .verify import verify
from .packed import QTensor
from .quant import QuantMixin, Quantizer
from .ops import get_rng_state, set_rng_state
from .nonfinite import check_nonfinite
from .quant import set_dist_sync, set_prefix_tokens

__all__ = ["SDPA", "Linear", "Conv2d", "LayerNorm", "GELU", "Softmax", "MatMul", "BatchNorm2d", "ReLU",
           "BatchNorm1d", "BatchNorm3d", "SyncBatchNorm", "Normalize", "Scale", "LinearFn",
           "MESA_LAYERS", "Quantizer", "QuantMixin", "QTensor", "policy", "memory", "backend",
           "functional", "reference", "SavedActivationMeter", "saved_activation_bytes", "compress", "audit",
           "verify"]
__all__ += ["get_rng_state", "set_rng_state", "set_dist_sync", "set_prefix_tokens", "check_nonfinite"]
__version__ = "0.1.0"
