"""Mesa's activation quantizer: groups, running range estimates, packing through the backend.

Paper (Pan et al., arXiv 2111.11124, Sec. 3): each activation saved for backward is stored as
b-bit codes with one scale and one offset per group; head-wise in attention (one group per head).
The range is learned by running estimates: on the first training step the batch's per-group
``min`` and ``max - min``; afterwards an EMA with decay ``ema_decay`` (0.9). Codes come from
stochastic (unbiased) rounding; values outside the running range are clamped to [0, 2^b - 1].

State kept in the state dict, with the original Mesa names: ``clip_val`` (G,) the range,
``shift`` (G,) the offset (running min), ``iteration`` (1,) the number of updates.

Group layout of a tensor (``quant_groups`` = G):
  * (B, C), (B, N, C): G contiguous groups along the last dim;
  * (B, H, N, D) attention tensors and (B, C, H, W) maps: groups along dim 1 (G = H is head-wise).
"""
from __future__ import annotations

import logging
import math
import threading
from typing import NamedTuple

import torch

from .backend import get_backend

_log = logging.getLogger("mesa_ops")
SUPPORTED_BITS = (8, 4, 2)


def channel_dim(ndim: int) -> int:
    """The dim that groups split: 1 for 4-D and larger tensors, else the last."""
    return 1 if ndim >= 4 else ndim - 1


def parse_groups(quant_groups) -> int:
    if isinstance(quant_groups, (tuple, list)):  # the original accepts a 1-tuple
        quant_groups = quant_groups[0]
    if quant_groups is None:
        quant_groups = 1
    g = int(quant_groups)
    if g < 1 or g != quant_groups:
        raise ValueError(f"quant_groups must be a positive integer, got {quant_groups!r}")
    return g


class QTensor(NamedTuple):
    """A packed activation: ``packed`` uint8 codes, per-group ``step`` and ``shift`` (fp32)."""
    packed: torch.Tensor
    step: torch.Tensor
    shift: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    bits: int
    groups: int
    inner: int
    transposed: bool  # stored as x.transpose(-2, -1) (memory order of a transposed input)

    def tensors(self):
        return (self.packed, self.step, self.shift)

    def meta(self):
        return (self.shape, self.dtype, self.bits, self.groups, self.inner, self.transposed)

    @staticmethod
    def restore(tensors, meta) -> torch.Tensor:
        packed, step, shift = tensors
        shape, dtype, bits, groups, inner, transposed = meta
        be = get_backend(packed)
        numel = math.prod(shape)
        if getattr(be, "has_dequantize_out", False) and in_backward():
            flat = be.dequantize_out(packed, step, shift, bits, groups, inner,
                                     _workspace().acquire(numel, dtype))
            out = flat.view(shape) if not transposed else None
            if out is not None:
                out._mesa_ws = True
                return out
        else:
            flat = be.dequantize(packed, step, shift, bits, groups, inner, numel, dtype)
        if transposed:
            s = list(shape)
            s[-2], s[-1] = s[-1], s[-2]
            return flat.view(s).transpose(-2, -1)
        return flat.view(shape)

    def dequantize(self) -> torch.Tensor:
        return QTensor.restore(self.tensors(), self.meta())


def _memory_view(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A contiguous tensor holding ``x``'s values without a copy where one exists."""
    if x.is_contiguous():
        return x, False
    if x.dim() >= 4 and x.transpose(-2, -1).is_contiguous():  # e.g. k.transpose(-2, -1)
        return x.transpose(-2, -1), True
    return x.contiguous(), False


class _Workspace:
    """Reusable CPU buffers for the dequantized activations of one backward pass.

    A fresh multi-MB CPU allocation costs a page fault per 4 KiB on first touch, which made
    dequantization dominate Mesa's CPU overhead. During a backward, Mesa's Functions take their
    dequantized tensors from here and hand them back (:func:`release`) once their gradients are
    computed; the buffers are dropped when the backward ends, so nothing is held during forward.
    """

    def __init__(self):
        self.free: list[torch.Tensor] = []
        self.armed = False

    def acquire(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if not self.armed:
            torch.autograd.Variable._execution_engine.queue_callback(self.clear)
            self.armed = True
        best = None
        for i, buf in enumerate(self.free):
            if buf.dtype == dtype and buf.numel() >= numel and (
                    best is None or buf.numel() < self.free[best].numel()):
                best = i
        buf = self.free.pop(best) if best is not None else torch.empty(numel, dtype=dtype)
        return buf[:numel]

    def release(self, t: torch.Tensor) -> None:
        base = t._base if t._base is not None else t
        while base._base is not None:
            base = base._base
        if base.device.type == "cpu" and base.dim() == 1 and len(self.free) < 8:
            self.free.append(base)

    def clear(self) -> None:
        self.free.clear()
        self.armed = False


_local = threading.local()


def _workspace() -> _Workspace:
    ws = getattr(_local, "ws", None)
    if ws is None:
        ws = _local.ws = _Workspace()
    return ws


def release(*tensors) -> None:
    """Give dequantized tensors back to the backward workspace (call after their last use)."""
    if in_backward():
        ws = _workspace()
        for t in tensors:
            if isinstance(t, torch.Tensor) and getattr(t, "_mesa_ws", False):
                ws.release(t)


def in_backward() -> bool:
    """True while the autograd engine runs a backward (e.g. checkpoint recomputation)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def draw_seed() -> int:
    """A 62-bit seed from torch's default generator (so torch.manual_seed fixes the noise)."""
    return int(torch.randint(0, 2 ** 62, (), dtype=torch.int64).item())


class QuantMixin:
    """Quantizer state and the one quantization path every Mesa layer stores activations through.

    Attributes set by policy files and read by users (the original's names): ``enable``,
    ``level`` (2**bits), ``bits``, ``ema_decay``, ``quant_groups``, ``tag``, ``index``; plus
    ``stochastic`` (False: round to nearest), ``range_mode`` ('ema' or 'batch': exact per-batch
    min/max, for ablations), ``check_finite`` (raise on NaN/Inf), ``group_size`` (derive G from
    the channel dim at run time).
    """

    def _init_quant(self, quant_groups=1, tag: str = "fm", enable: bool = False, bits: int = 8,
                    group_size: int | None = None):
        g = parse_groups(quant_groups)
        self.register_buffer("clip_val", torch.ones(g))
        self.register_buffer("shift", torch.zeros(g))
        self.register_buffer("iteration", torch.zeros(1))
        self.enable = bool(enable)
        self.bits = bits
        self.ema_decay = 0.9
        self.quant_groups = g
        self.group_size = group_size
        self.tag = tag
        self.index = -1
        self.stochastic = True
        self.range_mode = "ema"
        self.check_finite = True
        self.layer_name = None
        self.verbose = _log.info

    # ---- attributes -----------------------------------------------------------------------
    @property
    def bits(self) -> int:
        return self._bits

    @bits.setter
    def bits(self, value) -> None:
        b = int(value)
        if b not in SUPPORTED_BITS or b != value:
            raise ValueError(f"{self.describe()}: bits must be one of {SUPPORTED_BITS}, got {value!r}")
        self._bits = b

    @property
    def level(self) -> int:
        """Number of quantization levels, 2**bits (the original's attribute)."""
        return 1 << self._bits

    @level.setter
    def level(self, value) -> None:
        v = int(value)
        b = v.bit_length() - 1
        if v != value or (1 << b) != v or b not in SUPPORTED_BITS:
            raise ValueError(f"{self.describe()}: level must be 256, 16 or 4 (8, 4 or 2 bits), got {value!r}")
        self._bits = b

    def describe(self) -> str:
        name = getattr(self, "layer_name", None)
        where = f" '{name}'" if name else ""
        return (f"{type(self).__name__}{where} (tag={getattr(self, 'tag', '?')}, "
                f"index={getattr(self, 'index', -1)})")

    def extra_repr(self) -> str:
        base = super().extra_repr()
        q = (f"enable={self.enable}, bits={self.bits}, quant_groups={self.quant_groups}, "
             f"tag={self.tag}, index={self.index}")
        return f"{base}, {q}" if base else q

    def update_quantization_parameter(self, **parameters):
        """Apply one policy block (``by_index``, ``enable``, ``level``, ...) to this layer."""
        from .policy import update_quantization_parameter
        return update_quantization_parameter(self, **parameters)

    # ---- groups ---------------------------------------------------------------------------
    def groups_for(self, shape) -> tuple[int, int]:
        """(G, inner) of the (outer, G, inner) view for an activation of ``shape``."""
        nd = len(shape)
        if nd == 0:
            raise ValueError(f"{self.describe()}: cannot quantize a 0-d tensor")
        d = channel_dim(nd)
        c = shape[d]
        g = self.quant_groups
        if self.group_size:
            if c % self.group_size:
                raise ValueError(f"{self.describe()}: group_size={self.group_size} does not divide "
                                 f"the channel dim {c} (dim {d}) of input shape {tuple(shape)}")
            g = c // self.group_size
            if g != self.quant_groups:
                self._resize_groups(g)
        if c % g:
            raise ValueError(f"{self.describe()}: quant_groups={g} does not divide the channel dim "
                             f"{c} (dim {d}) of input shape {tuple(shape)}")
        inner = (c // g) * math.prod(shape[d + 1:])
        return g, inner

    def _resize_groups(self, g: int) -> None:
        if float(self.iteration.reshape(-1)[0]) != 0:
            raise ValueError(f"{self.describe()}: input needs {g} groups but the running estimates "
                             f"hold {self.quant_groups}")
        dev = self.clip_val.device
        self.clip_val = torch.ones(g, device=dev)
        self.shift = torch.zeros(g, device=dev)
        self.quant_groups = g

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        key = prefix + "clip_val"
        if self.group_size and key in state_dict and state_dict[key].shape != self.clip_val.shape:
            self._resize_groups(state_dict[key].numel())
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    # ---- the quantization path ------------------------------------------------------------
    def _state_fp32(self) -> None:
        """Keep the running estimates in float32 (model.half() / .to(bf16) cast buffers too)."""
        for n in ("clip_val", "shift", "iteration"):
            t = getattr(self, n)
            if t.dtype != torch.float32:
                setattr(self, n, t.float())

    @torch.no_grad()
    def quantize(self, x: torch.Tensor) -> QTensor:
        """Update the running range from ``x`` and return its packed copy (training only)."""
        shape, dtype = x.shape, x.dtype
        xs, transposed = _memory_view(x.detach())
        g, inner = self.groups_for(xs.shape)
        if self.range_mode not in ("ema", "batch"):
            raise ValueError(f"{self.describe()}: range_mode must be 'ema' or 'batch', got {self.range_mode!r}")
        self._state_fp32()
        be = get_backend(xs)
        d = float(self.ema_decay)
        # in an activation-checkpoint recomputation the running estimates were already updated
        # by this step's forward: quantize with them, do not update them twice
        params = be.range_update(xs, g, inner, self.clip_val, self.shift, self.iteration, d, 1.0 - d,
                                 self.range_mode == "batch", self.bits, not in_backward())
        if self.check_finite and not bool(params[3].all()):  # a host sync on CUDA
            raise FloatingPointError(
                f"{self.describe()}: the activation of shape {tuple(shape)} holds NaN or Inf; "
                "it would poison the running range (set check_finite=False to skip this "
                "check; the range is then not updated on such steps)")
        inv, step, sh = params[0], params[1], params[2]
        packed = be.quantize(xs, inv, sh, self.bits, g, inner, draw_seed(), bool(self.stochastic))
        return QTensor(packed, step, sh, shape, dtype, self.bits, g, inner, transposed)


def pack_mask(mask_source: torch.Tensor) -> QTensor:
    """1-bit copy of ``mask_source > 0`` (the ReLU mask), through the same packing kernels."""
    x, transposed = _memory_view(mask_source.detach())
    one = torch.ones(1, device=x.device)
    zero = torch.zeros(1, device=x.device)
    packed = get_backend(x).quantize(x, one, zero, 1, 1, x.numel() or 1, 0, False)
    return QTensor(packed, one, zero, mask_source.shape, mask_source.dtype, 1, 1, x.numel() or 1,
                   transposed)


class Quantizer(QuantMixin, torch.nn.Module):
    """A stand-alone quantizer module: the ``quant1`` / ``quant2`` of MatMul and Softmax."""

    def __init__(self, quant_groups=1, tag: str = "fm", enable: bool = False, bits: int = 8):
        torch.nn.Module.__init__(self)
        self._init_quant(quant_groups, tag=tag, enable=enable, bits=bits)


def attach_saved(t: torch.Tensor, qt: QTensor) -> None:
    """Record on ``t`` that ``qt`` is a packed copy of it, so a later Mesa layer that needs the
    same tensor for backward (attn@v after softmax) saves these bytes instead of a second copy."""
    t._mesa_saved = (qt, t._version)


def find_saved(t: torch.Tensor, bits: int) -> QTensor | None:
    """The packed copy attached to ``t`` if it is still valid (not modified in place, same bits)."""
    rec = getattr(t, "_mesa_saved", None)
    if rec is None:
        return None
    qt, version = rec
    if version != t._version or qt.bits != bits or qt.shape != t.shape:
        return None
    return qt


def save_for_backward(ctx, *items) -> None:
    """``ctx.save_for_backward`` for a mix of QTensor, Tensor and None items."""
    flat, layout = [], []
    for it in items:
        if isinstance(it, QTensor):
            layout.append(("q", len(flat), it.meta()))
            flat.extend(it.tensors())
        elif it is None:
            layout.append(("none", 0, None))
        else:
            layout.append(("t", len(flat), None))
            flat.append(it)
    ctx.save_for_backward(*flat)
    ctx.mesa_layout = layout


def saved_tensors(ctx) -> list:
    """The items given to :func:`save_for_backward`, QTensors dequantized."""
    flat = ctx.saved_tensors
    out = []
    for kind, i, meta in ctx.mesa_layout:
        if kind == "q":
            out.append(QTensor.restore(flat[i:i + 3], meta))
        elif kind == "t":
            out.append(flat[i])
        else:
            out.append(None)
    return out
