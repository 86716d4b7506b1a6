"""Mesa layers: subclasses of their ``nn`` counterparts (same parameter names, same init).

In training mode with ``enable`` on (policy file, ``mesa=True`` or ``enable=True``) and a
gradient to compute, the forward runs the plain op bit for bit but saves for backward only a
packed low-bit copy of what backward needs (Pan et al., Mesa, arXiv 2111.11124). Otherwise the
layer is exactly the plain ``nn`` layer. The signatures follow the original Mesa code
(``mesa=False, args=None, logger=None, quant_groups=1``); ``bits`` is new.

TorchScript (``torch.jit.script``, eval mode) compiles each layer as its plain counterpart (the
compressed path is Python-only); FX symbolic tracing treats the layers as leaf modules (``models``
registers them with timm's ``register_notrace_module``).
"""
from __future__ import annotations

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import functional as MF
from .attention import SDPA
from .quant import QuantMixin, Quantizer, update_quantization_parameter


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


class _Layer(QuantMixin):
    """Shared constructor bits of the single-quantizer layers."""

    def _setup(self, tag, mesa, enable, quant_groups, bits, group_size=None):
        self._init_quant(quant_groups, tag=tag, enable=bool(mesa or enable), bits=bits,
                         group_size=group_size)

    def _active(self, *tensors) -> bool:
        return self.enable and self.training and _needs_grad(*tensors)


class Linear(_Layer, nn.Linear):
    """``nn.Linear`` storing its input (..., in_features) at ``bits`` bits, G groups along it.
    With a frozen weight (no weight gradient) nothing is stored: it is the plain layer."""

    group_dim = "last"

    def __init__(self, in_features, out_features, bias=True, mesa=False, args=None, logger=None,
                 quant_groups=1, bits=8, enable=False, group_size=None, device=None, dtype=None):
        nn.Linear.__init__(self, in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._setup("fc", mesa, enable, quant_groups, bits, group_size)

    def forward(self, x):
        if not torch.jit.is_scripting():  # TorchScript (eval): the plain layer
            # (the parameters read from _parameters: no Module.__getattr__ frame, once per step;
            # a parametrized weight, a property, is not there: then read as it is)
            w = self._parameters.get("weight")
            if w is None:
                w = self.weight
            # (needs a gradient: the weight's own, with grad mode on)
            if self.enable and self.training and w.requires_grad and torch.is_grad_enabled():
                return MF.linear_fn(x, w, self.bias, self)
        return F.linear(x, self.weight, self.bias)


class LinearBase(_Layer):
    """The Mesa base of a layer computing x @ W^T + b with parameters of its own in another form
    (transformers' ``Conv1D``: W stored transposed; mesa_ops.hf_layers): x stored packed."""

    group_dim = "last"


class LinearFn(_Layer, nn.Module):
    """``F.linear(x, weight, bias)`` as a Mesa layer, for a module that keeps its projection
    weight itself and calls the function (``nn.MultiheadAttention``'s ``in_proj_weight``): no
    parameters of its own; ``forward(x, weight, bias)`` stores x (..., in_features) at ``bits``
    bits, G groups along it, while active (training, the weight needs a gradient)."""

    group_dim = "last"

    def __init__(self, in_features: int, mesa=False, args=None, logger=None, quant_groups=1, bits=8,
                 enable=False):
        nn.Module.__init__(self)
        self.in_features = int(in_features)
        self._setup("fc", mesa, enable, quant_groups, bits)

    def forward(self, x, weight, bias=None):
        if not torch.jit.is_scripting():
            if self.enable and self.training and weight.requires_grad and torch.is_grad_enabled():
                return MF.linear_fn(x, weight, bias, self)
        return F.linear(x, weight, bias)


class Conv2d(_Layer, nn.Conv2d):
    """``nn.Conv2d`` storing its input (B, C_in, H, W) at ``bits`` bits, groups along C_in.
    With a frozen weight (no weight gradient) the input is not stored at all (exact autograd
    would keep it) and its running range is not updated."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1,
                 groups=1, bias=True, padding_mode="zeros", mesa=False, args=None, logger=None,
                 quant_groups=1, bits=8, enable=False, group_size=None, device=None, dtype=None):
        nn.Conv2d.__init__(self, in_channels, out_channels, kernel_size, stride, padding, dilation,
                           groups, bias, padding_mode, device=device, dtype=dtype)
        self._setup("conv", mesa, enable, quant_groups, bits, group_size)

    def forward(self, x):
        if torch.jit.is_scripting():
            return self._conv_forward(x, self.weight, self.bias)
        if not self._active(x, self.weight, self.bias):
            return self._conv_forward(x, self.weight, self.bias)
        padding = self.padding
        if self.padding_mode != "zeros" or isinstance(padding, str):
            if self.padding_mode != "zeros":
                x = F.pad(x, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            elif padding == "same":
                x = F.pad(x, self._reversed_padding_repeated_twice)
            padding = (0, 0)
        return MF.conv2d_fn(x, self.weight, self.bias, self.stride, padding, self.dilation,
                            self.groups, self)


class LayerNorm(_Layer, nn.LayerNorm):
    """``nn.LayerNorm`` storing its normalized input x-hat = (x - mean) * rstd (..., C) at
    ``bits`` bits plus the fp32 rstd: all its backward needs. A Mesa Linear fed by its output
    (with the same bits and rounding) stores nothing more: it restores that output as
    x-hat * weight + bias from the same bytes."""

    group_dim = "last"

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True, mesa=False,
                 args=None, logger=None, quant_groups=1, bits=8, enable=False, group_size=None,
                 device=None, dtype=None):
        nn.LayerNorm.__init__(self, normalized_shape, eps, elementwise_affine, bias=bias,
                              device=device, dtype=dtype)
        self._setup("layernorm", mesa, enable, quant_groups, bits, group_size)

    def forward(self, x):
        if not torch.jit.is_scripting():
            if self.enable and self.training and torch.is_grad_enabled():
                p = self._parameters  # (no Module.__getattr__ frames: see Linear.forward)
                w, b = (p["weight"], p["bias"]) if "weight" in p and "bias" in p else (self.weight, self.bias)
                if x.requires_grad or (w is not None and w.requires_grad) or (b is not None and b.requires_grad):
                    return MF.layer_norm_fn(x, self.normalized_shape, w, b, self.eps, self)
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class GELU(_Layer, nn.GELU):
    """``nn.GELU`` storing its input (..., C) at ``bits`` bits, groups along the last dim."""

    group_dim = "last"

    def __init__(self, approximate="none", mesa=False, args=None, logger=None, quant_groups=1,
                 bits=8, enable=False, group_size=None):
        nn.GELU.__init__(self, approximate=approximate)
        self._setup("gelu", mesa, enable, quant_groups, bits, group_size)

    def forward(self, x):
        if not torch.jit.is_scripting():
            if self.enable and self.training and x.requires_grad and torch.is_grad_enabled():
                return MF.gelu_fn(x, self.approximate, self)
        return F.gelu(x, approximate=self.approximate)


class ReLU(_Layer, nn.ReLU):
    """``nn.ReLU`` whose backward keeps a 1-bit mask (exact gradient, 1/32 of fp32 bytes).
    ``inplace`` is honoured when compression is off; with it on the output is a new tensor."""

    group_dim = "last"

    def __init__(self, inplace=False, mesa=False, args=None, logger=None, quant_groups=1, bits=8,
                 enable=False, group_size=None):
        nn.ReLU.__init__(self, inplace=inplace)
        self._setup("relu", mesa, enable, quant_groups, bits, group_size)

    def forward(self, x):
        if not torch.jit.is_scripting():
            if self._active(x):
                return MF.relu_fn(x)
        return F.relu(x, inplace=self.inplace)


class BatchNormBase(_Layer):
    """The Mesa training forward of the batch norms (1d, 2d, 3d, SyncBatchNorm, timm's
    BatchNormAct2d): it stores x-hat, each channel normalized by its batch statistics, at
    ``bits`` bits (see mesa_ops.functional.norm); eval mode, running statistics and a frozen
    affine are the plain layer."""

    def _mesa_forward(self, x):
        """The Mesa training forward of ``x``, or None where the plain forward applies."""
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        if not (use_batch_stats and self._active(x, self.weight, self.bias)):
            return None
        self._check_input_dim(x)
        # momentum bookkeeping exactly as nn.modules.batchnorm._BatchNorm.forward
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        track = not self.training or self.track_running_stats
        return MF.batch_norm_fn(x, self.weight, self.bias, self.running_mean if track else None,
                                self.running_var if track else None, momentum, self.eps, self)

    def forward(self, x):
        y = None if torch.jit.is_scripting() else self._mesa_forward(x)
        return super().forward(x) if y is None else y


def _bn_init(self, base, num_features, eps, momentum, affine, track_running_stats, mesa, enable,
             quant_groups, bits, group_size, device, dtype, **extra):
    base.__init__(self, num_features, eps, momentum, affine, track_running_stats, device=device,
                  dtype=dtype, **extra)
    self._setup("bn", mesa, enable, quant_groups, bits, group_size)


class BatchNorm1d(BatchNormBase, nn.BatchNorm1d):
    """``nn.BatchNorm1d`` storing x-hat of its input (B, C) or (B, C, L) at ``bits`` bits."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, mesa=False, args=None, logger=None, quant_groups=1,
                 bits=8, enable=False, group_size=None, device=None, dtype=None):
        _bn_init(self, nn.BatchNorm1d, num_features, eps, momentum, affine, track_running_stats, mesa,
                 enable, quant_groups, bits, group_size, device, dtype)


class BatchNorm2d(BatchNormBase, nn.BatchNorm2d):
    """``nn.BatchNorm2d`` storing x-hat of its input (B, C, H, W) at ``bits`` bits (groups along C)."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, mesa=False, args=None, logger=None, quant_groups=1,
                 bits=8, enable=False, group_size=None, device=None, dtype=None):
        _bn_init(self, nn.BatchNorm2d, num_features, eps, momentum, affine, track_running_stats, mesa,
                 enable, quant_groups, bits, group_size, device, dtype)


class BatchNorm3d(BatchNormBase, nn.BatchNorm3d):
    """``nn.BatchNorm3d`` storing x-hat of its input (B, C, D, H, W) at ``bits`` bits."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, mesa=False, args=None, logger=None, quant_groups=1,
                 bits=8, enable=False, group_size=None, device=None, dtype=None):
        _bn_init(self, nn.BatchNorm3d, num_features, eps, momentum, affine, track_running_stats, mesa,
                 enable, quant_groups, bits, group_size, device, dtype)


class SyncBatchNorm(BatchNormBase, nn.SyncBatchNorm):
    """``nn.SyncBatchNorm``: where its statistics are those of this process (one process, eval)
    the Mesa batch norm; where they are synchronised across ranks the plain layer, exact, said
    once (a rank's own statistics would normalize differently)."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, process_group=None, mesa=False, args=None, logger=None,
                 quant_groups=1, bits=8, enable=False, group_size=None, device=None, dtype=None):
        _bn_init(self, nn.SyncBatchNorm, num_features, eps, momentum, affine, track_running_stats,
                 mesa, enable, quant_groups, bits, group_size, device, dtype, process_group=process_group)
        self._warned_sync = False

    def _syncs(self) -> bool:
        dist = torch.distributed
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return False
        return dist.get_world_size(self.process_group or dist.group.WORLD) > 1

    def forward(self, x):
        if not torch.jit.is_scripting() and self.enable and self._syncs():
            if not getattr(self, "_warned_sync", False):
                self._warned_sync = True
                warnings.warn(f"{self.describe()}: SyncBatchNorm across ranks keeps its input exact "
                              "(Mesa stores x-hat of a batch norm whose statistics are this "
                              "process's)", RuntimeWarning, stacklevel=2)
            return nn.SyncBatchNorm.forward(self, x)
        return super().forward(x)


class _TwoQuant:
    """Attributes of MatMul/Softmax read from the quantizer in use (``_primary``) and set on both."""
    _primary = "quant1"
    _proxied = ("enable", "bits", "level", "ema_decay", "quant_groups", "stochastic",
                "range_mode", "check_finite", "nonfinite", "dist_sync", "index", "group_size",
                "layer_name")
    __jit_unused_properties__ = list(_proxied)  # Python-side settings: not compiled by TorchScript

    def update_quantization_parameter(self, **parameters):
        return update_quantization_parameter(self, **parameters)

    def describe(self) -> str:
        name = getattr(self, "layer_name", None)
        return f"{type(self).__name__}{f' {name!r}' if name else ''} (tag={self.tag})"


def _proxy(name):
    def get(self):
        return getattr(self.quant2 if self._primary == "quant2" else self.quant1, name)

    def set_(self, value):
        setattr(self.quant1, name, value)
        setattr(self.quant2, name, value)
    return property(get, set_)


for _n in _TwoQuant._proxied:
    setattr(_TwoQuant, _n, _proxy(_n))


class Softmax(_TwoQuant, nn.Softmax):
    _primary = "quant2"

    """``nn.Softmax`` storing only its output (at ``quant2``'s bits, head-wise groups on
    (B, H, N, N)). ``quant1`` (the original's input quantizer) is kept for policies and
    checkpoints of the original code; the input is never stored since backward needs only y."""

    def __init__(self, dim=None, mesa=False, args=None, logger=None, quant_groups=1, bits=8,
                 enable=False):
        nn.Softmax.__init__(self, dim=dim)
        on = bool(mesa or enable)
        self.quant1 = Quantizer(quant_groups, tag="softmax-1", enable=on, bits=bits)
        self.quant2 = Quantizer(quant_groups, tag="softmax-2", enable=on, bits=bits)
        self.tag = "softmax"

    def forward(self, x):
        if not torch.jit.is_scripting():
            if (self.quant2.enable or self.quant1.enable) and self.training and _needs_grad(x):
                dim = self.dim if self.dim is not None else F._get_softmax_dim("softmax", x.dim(), 3)
                # the output is stored by quant2; a policy enabling only quant1 (softmax-1) gets it
                return MF.softmax_fn(x, dim, self.quant2 if self.quant2.enable else self.quant1)
        return F.softmax(x, self.dim, _stacklevel=5)


class MatMul(_TwoQuant, nn.Module):
    """``a @ b`` as a module: ``quant1`` stores a, ``quant2`` stores b (head-wise groups); an
    input whose quantizer is disabled is saved exactly."""

    def __init__(self, mesa=False, args=None, logger=None, quant_groups=1, bits=8, enable=False):
        nn.Module.__init__(self)
        on = bool(mesa or enable)
        self.quant1 = Quantizer(quant_groups, tag="matmul-1", enable=on, bits=bits)
        self.quant2 = Quantizer(quant_groups, tag="matmul-2", enable=on, bits=bits)
        self.tag = "matmul"

    def forward(self, a, b):
        """Each input is stored packed when its quantizer is enabled, exactly otherwise; ``a``
        already packed by a Mesa Softmax is stored as that copy (once) in any case."""
        if not torch.jit.is_scripting():
            on = self.quant1.enable or self.quant2.enable or hasattr(a, "_mesa_saved")
            if on and self.training and _needs_grad(a, b):
                return MF.matmul_fn(a, b, self.quant1, self.quant2)
        return torch.matmul(a, b)


class Normalize(_Layer, nn.Module):
    """``F.normalize(x, 2, dim, eps)`` as a module (the q and k of Swin-V2's cosine attention and
    of XCiT's cross-covariance attention, (B, H, ., .)): stores its output at ``bits`` bits,
    groups along dim 1 (head-wise), and the row norms."""

    def __init__(self, dim=-1, eps=1e-12, mesa=False, args=None, logger=None, quant_groups=1, bits=8,
                 enable=False):
        nn.Module.__init__(self)
        self.dim, self.eps = dim, eps
        self._setup("normalize", mesa, enable, quant_groups, bits)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, eps={self.eps}, " + super().extra_repr()

    def forward(self, x):
        if not torch.jit.is_scripting():
            if self._active(x):
                return MF.normalize_fn(x, self.dim, self.eps, self)
        return F.normalize(x, 2.0, self.dim, self.eps)


class Scale(_Layer, nn.Module):
    """``x * s`` as a module, for x (B, H, ., .) and a learned s broadcast over it (Swin-V2's
    per-head logit scale, XCiT's temperature, (H, 1, 1)): stores x at ``bits`` bits (head-wise
    groups) for the gradient of s; the gradient of x (g * s) is exact."""

    def __init__(self, mesa=False, args=None, logger=None, quant_groups=1, bits=8, enable=False):
        nn.Module.__init__(self)
        self._setup("scale", mesa, enable, quant_groups, bits)

    def forward(self, x, s):
        if not torch.jit.is_scripting() and isinstance(s, torch.Tensor):
            if (self._active(x, s) and s.requires_grad and s.dim() <= x.dim()
                    and torch.broadcast_shapes(x.shape, s.shape) == x.shape):
                return MF.scale_fn(x, s, self)
        return x * s


class LayerScaleBase(_Layer):
    """The Mesa forward of timm's ``LayerScale`` / ``LayerScale2d`` (x * gamma, a learned
    per-channel scale: DeiT-III, CaiT-style ViTs, ConvNeXt-like nets; mesa_ops.timm_layers):
    x stored at ``bits`` bits for gamma's gradient, the gradient of x (g * gamma) exact."""

    def _mesa_forward(self, x, gamma):
        """``x * gamma`` through the Mesa op while active, else None (the caller's forward)."""
        if not torch.jit.is_scripting() and gamma.requires_grad and self._active(x, gamma):
            return MF.scale_fn(x, gamma, self)
        return None


class Dropout(nn.Dropout):
    """``nn.Dropout`` whose backward keeps a 1-bit mask (``functional.dropout_fn``: the same
    draws, output and gradient bit for bit) while ``enable`` is set and it trains with a
    gradient; exact nn.Dropout otherwise. No quantizer state (the mask is exact): the state
    dict is the original's. ``mesa_ops.compress`` converts ``nn.Dropout`` (p > 0, not in place)
    to it and enables it under its named policies."""

    def __init__(self, p: float = 0.5, inplace: bool = False, enable: bool = False):
        super().__init__(p, inplace)
        self.enable = bool(enable)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, enable={self.enable}"

    def forward(self, x):
        if (self.enable and self.training and not self.inplace and torch.is_grad_enabled()
                and x.requires_grad and not torch.jit.is_scripting()):
            return MF.dropout_fn(x, self.p)
        return super().forward(x)


MESA_LAYERS = (Linear, LinearFn, LinearBase, Conv2d, LayerNorm, GELU, ReLU, BatchNorm1d, BatchNorm2d, BatchNorm3d, SyncBatchNorm,
               Softmax, MatMul, SDPA, BatchNormBase, Normalize, Scale, LayerScaleBase)
# modules whose saved uint8 codes are Mesa's packing (the audit's attribution): the Mesa layers
# and the 1-bit-mask dropout
PACKING_LAYERS = MESA_LAYERS + (Dropout,)
