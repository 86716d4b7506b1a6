"""Mesa's activation quantizer: groups, running range estimates, packing through the backend.

Paper (Pan et al., arXiv 2111.11124, Sec. 3): each activation saved for backward is stored as
b-bit codes with one scale and one offset per group; head-wise in attention (one group per head).
The range is learned by running estimates: on the first training step the batch's per-group
``min`` and ``max - min``; afterwards an EMA with decay ``ema_decay`` (0.9). Codes come from
stochastic (unbiased) rounding; values outside the running range are clamped to [0, 2^b - 1].

State kept in the state dict, with the original Mesa names: ``clip_val`` (G,) the range,
``shift`` (G,) the offset (running min), ``iteration`` (1,) the number of updates.

Group layout of a tensor (``quant_groups`` = G), by the layer kind (``group_dim``):
  * ``'last'`` (Linear, LayerNorm, GELU, ReLU): G contiguous groups along the last dim, whatever
    the rank: (B, C), (B, N, C) and channels-last tokens (B, H, W, C) group over C;
  * ``'channel'`` (Conv2d, BatchNorm2d, and the ``quant1``/``quant2`` of MatMul/Softmax): dim 1
    of 4-D and larger tensors -- (B, C, H, W) maps, (B, H, N, D) attention tensors (G = H is
    head-wise) -- else the last dim.

Non-finite activations (``nonfinite``): ``'raise'`` a FloatingPointError naming the layer;
``'skip'`` leave the running range as it is, mark the stored copy non-finite (so the gradient is
non-finite and a GradScaler skips the step, as in exact training) and warn once; ``'auto'`` (the
default) skips under fp16 autocast and raises otherwise. ``dist_sync`` (default True) all-reduces
the per-group min/max over the ranks of an initialized torch.distributed group before the EMA, so
every rank holds the same ``clip_val``/``shift``.
"""
from __future__ import annotations

import functools
import logging
import math
import threading
from typing import NamedTuple

import torch
from torch.autograd import function as _autograd_function

from . import ops, reference
from .backend import get_backend

_log = logging.getLogger("mesa_ops")
SUPPORTED_BITS = (8, 4, 2)
NONFINITE_MODES = ("auto", "raise", "skip")
GROUP_DIMS = ("last", "channel")


def channel_dim(ndim: int) -> int:
    """The dim that ``'channel'`` groups split: 1 for 4-D and larger tensors, else the last."""
    return 1 if ndim >= 4 else ndim - 1


def compiling() -> bool:
    """True while torch.compile (dynamo) traces."""
    return torch.compiler.is_compiling()


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
        if compiling():
            return _shaped(ops.dequantize(packed, step, shift, bits, groups, inner, shape.numel(),
                                          dtype), shape, transposed)
        be = get_backend(packed)
        # reuse workspace buffers only in a backward that records no graph (create_graph=False)
        if not torch.is_grad_enabled() and getattr(be, "has_dequantize_out", False) and in_backward():
            flat = be.dequantize_out(packed, step, shift, bits, groups, inner,
                                     _workspace().acquire(shape.numel(), dtype))
            if not transposed:
                out = flat.view(shape)
                out._mesa_ws = True
                return out
        else:
            flat = ops.dequantize(packed, step, shift, bits, groups, inner, shape.numel(), dtype)
        return _shaped(flat, shape, transposed)

    def dequantize(self) -> torch.Tensor:
        return QTensor.restore(self.tensors(), self.meta())


class AffineQTensor(NamedTuple):
    """A tensor stored as ``q.dequantize() * weight + bias`` along its last dim (``weight``,
    ``bias``: (C,) or None): a LayerNorm's output, from the packed x-hat its backward keeps."""
    q: QTensor
    weight: torch.Tensor | None
    bias: torch.Tensor | None

    @property
    def shape(self):
        return self.q.shape

    @property
    def bits(self) -> int:
        return self.q.bits

    def tensors(self):
        return self.q.tensors() + (self.weight, self.bias)

    def meta(self):
        return self.q.meta()

    @staticmethod
    def restore(tensors, meta) -> torch.Tensor:
        out = QTensor.restore(tensors[:3], meta)
        w, b = tensors[3], tensors[4]
        if w is not None:
            out = out.mul_(w)
        if b is not None:
            out = out.add_(b)
        return out

    def dequantize(self) -> torch.Tensor:
        return AffineQTensor.restore(self.tensors(), self.meta())


def _gelu_table(levels: torch.Tensor, approximate: str) -> torch.Tensor:
    return torch.nn.functional.gelu(levels, approximate=approximate)


# elementwise functions a stored tensor can be restored through: name -> f(levels, *args)
TABLE_FNS = {"gelu": _gelu_table}


class MappedQTensor(NamedTuple):
    """A tensor stored as f(x) of a packed x, f elementwise (GELU's output, from the packed
    input the GELU keeps for its own backward): restored through a table of f at the 2^bits
    values each group's codes take, so f is computed 2^bits times per group, not per element.
    ``fn``: (name in :data:`TABLE_FNS`, *args)."""
    q: QTensor
    fn: tuple

    @property
    def shape(self):
        return self.q.shape

    @property
    def bits(self) -> int:
        return self.q.bits

    def tensors(self):
        return self.q.tensors()

    def meta(self):
        return self.q.meta() + (self.fn,)

    @staticmethod
    def restore(tensors, meta) -> torch.Tensor:
        packed, step, shift = tensors
        dtype, bits = meta[1], meta[2]
        name, *args = meta[6]
        table = TABLE_FNS[name](levels(step, shift, bits, dtype), *args)
        return apply_table(tensors, meta[:6], table)

    def dequantize(self) -> torch.Tensor:
        return MappedQTensor.restore(self.tensors(), self.meta())


def levels(step: torch.Tensor, shift: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """(G, 2^bits): the values each group's codes dequantize to, in ``dtype`` (the kernel's
    one call on CPU, reference.levels elsewhere and while compiling)."""
    be = None if compiling() else get_backend(step)
    kernel = getattr(be, "levels", None)
    if kernel is None:
        return reference.levels(step, shift, bits, dtype)
    return kernel(step, shift, bits, dtype)


def apply_table(tensors, meta, table: torch.Tensor, mul: torch.Tensor | None = None) -> torch.Tensor:
    """``table[group][code]`` of a packed tensor (``tensors``/``meta`` of a QTensor), times
    ``mul`` when given, shaped as the stored tensor: (G, 2^bits) ``table`` of the result dtype.
    Without ``mul`` and in a graph-free backward the result is a workspace buffer (release it)."""
    packed, step, shift = tensors
    shape, dtype, bits, groups, inner, transposed = meta
    if transposed:
        raise ValueError("mesa apply_table: a transposed packed copy has no table path")
    numel = shape.numel()
    be = None if compiling() else get_backend(packed)
    kernel = getattr(be, "lut_apply_out", None)
    if kernel is None:
        return reference.lut_apply(packed, table, bits, groups, inner, numel, mul).view(shape)
    ws = mul is None and not torch.is_grad_enabled() and in_backward()
    out = (_workspace().acquire(numel, table.dtype) if ws
           else torch.empty(numel, dtype=table.dtype, device=packed.device))
    out = kernel(packed, table, bits, groups, inner, out,
                 None if mul is None else mul.contiguous()).view(shape)
    if ws:
        out._mesa_ws = True
    return out


def _shaped(flat: torch.Tensor, shape, transposed: bool) -> torch.Tensor:
    if transposed:
        s = list(shape)
        s[-2], s[-1] = s[-1], s[-2]
        return flat.view(s).transpose(-2, -1)
    return flat.view(shape)


def _memory_view(x: torch.Tensor, allow_transposed: bool = True,
                 copy: bool = True) -> tuple[torch.Tensor, bool]:
    """A contiguous tensor holding ``x``'s values without a copy where one exists (a transposed
    view only for dim-1 groups, which a swap of the last two dims leaves in place); with
    ``copy=False`` any other ``x`` is returned as it is (the CPU kernel reads it in place or
    copies it itself)."""
    if x.is_contiguous():
        return x, False
    if allow_transposed and x.dim() >= 4 and x.transpose(-2, -1).is_contiguous():  # k^T
        return x.transpose(-2, -1), True
    return (x.contiguous() if copy else x), False


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
    if not compiling() and in_backward() and not torch.is_grad_enabled():
        ws = _workspace()
        for t in tensors:
            if isinstance(t, torch.Tensor) and getattr(t, "_mesa_ws", False):
                ws.release(t)


def in_backward() -> bool:
    """True while the autograd engine runs a backward (e.g. checkpoint recomputation); False
    while torch.compile traces."""
    if compiling():
        return False
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def _layer_name(ctx) -> str:
    """The layer a Function's ``ctx.mesa_name`` names: a string, or the quantizer / module
    itself (described only when needed: the forward runs once per layer and step)."""
    name = getattr(ctx, "mesa_name", "?")
    return name if isinstance(name, str) else name.describe()


def once_differentiable(fn):
    """``torch.autograd.function.once_differentiable`` with a message naming Mesa: a Mesa
    backward runs without recording a graph (its inputs are lossy packed copies), and a second
    differentiation through it (gradient penalty, ``create_graph=True``) raises."""
    plain = _autograd_function.once_differentiable(fn)

    @functools.wraps(fn)
    def wrapper(ctx, *args):
        if not torch.is_grad_enabled():  # the usual backward (create_graph=False): as plain does
            return fn(ctx, *args)
        if compiling():
            return plain(ctx, *args)
        with torch.no_grad():
            outputs = fn(ctx, *args)
        if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return outputs
        outs = outputs if isinstance(outputs, tuple) else (outputs,)
        err = torch._C._functions.DelayedError(
            f"mesa_ops: double backward through the Mesa layer {_layer_name(ctx)} "
            "is not supported "
            "(it saved a lossy packed copy of its input and its backward is not differentiable); "
            "turn compression off for it (enable=False) to take gradients of gradients".encode(),
            len(outs))
        res = err(*[o.detach().requires_grad_() if o is not None else None for o in outs])
        res = res if isinstance(res, tuple) else (res,)
        return res if isinstance(outputs, tuple) else res[0]
    return wrapper


class QuantMixin:
    """Quantizer state and the one quantization path every Mesa layer stores activations through.

    Attributes set by policy files and read by users (the original's names): ``enable``,
    ``level`` (2**bits), ``bits``, ``ema_decay``, ``quant_groups``, ``tag``, ``index``; plus
    ``stochastic`` (False: round to nearest), ``range_mode`` ('ema' or 'batch': exact per-batch
    min/max, for ablations), ``nonfinite`` ('auto' / 'raise' / 'skip', see the module doc;
    ``check_finite`` = True / False is the older spelling of 'raise' / 'skip'), ``group_size``
    (derive G from the group dim at run time), ``dist_sync`` (all-reduce the range statistics
    across ranks). ``group_dim`` ('last' or 'channel') is fixed by the layer kind.
    """

    group_dim = "channel"

    def _init_quant(self, quant_groups=1, tag: str = "fm", enable: bool = False, bits: int = 8,
                    group_size: int | None = None):
        g = parse_groups(quant_groups)
        self.register_buffer("clip_val", torch.ones(g))
        self.register_buffer("shift", torch.zeros(g))
        self.register_buffer("iteration", torch.zeros(1))
        # stochastic-rounding draws so far (a CPU tensor outside the state dict, resumed from
        # ``iteration`` on load): part of each seed, see ops.make_seed
        self._draws = torch.zeros(1, dtype=torch.int64, device="cpu")
        self.enable = bool(enable)
        self.bits = bits
        self.ema_decay = 0.9
        self.quant_groups = g
        self.group_size = group_size
        self.tag = tag
        self.index = -1
        self.stochastic = True
        self.range_mode = "ema"
        self.nonfinite = "auto"
        self.dist_sync = True
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
    def nonfinite(self) -> str:
        return self._nonfinite

    @nonfinite.setter
    def nonfinite(self, value) -> None:
        if value not in NONFINITE_MODES:
            raise ValueError(f"{self.describe()}: nonfinite must be one of {NONFINITE_MODES}, "
                             f"got {value!r}")
        self._nonfinite = value

    @property
    def check_finite(self) -> bool:
        """The older switch: True raises on NaN/Inf (nonfinite='raise'), False skips ('skip')."""
        return self._nonfinite != "skip"

    @check_finite.setter
    def check_finite(self, value) -> None:
        self.nonfinite = "raise" if value else "skip"

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
        return update_quantization_parameter(self, **parameters)

    # ---- groups ---------------------------------------------------------------------------
    def groups_for(self, shape) -> tuple[int, int]:
        """(G, inner) of the (outer, G, inner) view for an activation of ``shape``."""
        nd = len(shape)
        if nd == 0:
            raise ValueError(f"{self.describe()}: cannot quantize a 0-d tensor")
        d = nd - 1 if self.group_dim == "last" else channel_dim(nd)
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
            raise ValueError(f"{self.describe()}: quant_groups={g} does not divide the group dim "
                             f"{c} (dim {d}, the {self.group_dim} dim) of input shape {tuple(shape)}")
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
        if prefix + "iteration" in state_dict:
            self._draws[0] = int(float(self.iteration.reshape(-1)[0]))

    # ---- the quantization path ------------------------------------------------------------
    def _state_fp32(self) -> None:
        """Keep the running estimates in float32 (model.half() / .to(bf16) cast buffers too)."""
        for n in ("clip_val", "shift", "iteration"):
            t = getattr(self, n)
            if t.dtype != torch.float32:
                setattr(self, n, t.float())

    def _state(self):
        """(clip_val, shift, iteration), float32."""
        bufs = self._buffers
        clip, shift, it = bufs["clip_val"], bufs["shift"], bufs["iteration"]
        if not (clip.dtype == shift.dtype == it.dtype == torch.float32):
            self._state_fp32()
            clip, shift, it = bufs["clip_val"], bufs["shift"], bufs["iteration"]
        return clip, shift, it

    def _nonfinite_mode(self, amp16: bool) -> str:
        if self._nonfinite == "auto":
            return "skip" if amp16 else "raise"
        return self._nonfinite

    def _salt(self) -> int:
        """The CRC-32 salt of this quantizer's seeds (of :meth:`describe`; cached per name)."""
        key = (self.layer_name, self.tag, self.index)
        cached = self.__dict__.get("_salt_cache")
        if cached is not None and cached[0] == key:
            return cached[1]
        salt = ops.salt_of(self.describe())
        self.__dict__["_salt_cache"] = (key, salt)
        return salt

    def quantize(self, x: torch.Tensor, amp16: bool = False) -> QTensor:
        """Update the running range from ``x`` and return its packed copy (training only).
        ``amp16``: the layer runs under fp16 autocast (``nonfinite='auto'`` then skips)."""
        if torch.is_grad_enabled():
            with torch.no_grad():
                return self._quantize(x, amp16)
        return self._quantize(x, amp16)

    def _quantize(self, x: torch.Tensor, amp16: bool) -> QTensor:
        # runs once per stored activation: kept to few Python operations
        shape, dtype = x.shape, x.dtype
        range_mode = self.range_mode
        if range_mode != "ema" and range_mode != "batch":
            raise ValueError(f"{self.describe()}: range_mode must be 'ema' or 'batch', "
                             f"got {range_mode!r}")
        mode = self._nonfinite
        if mode == "auto":
            mode = "skip" if amp16 else "raise"
        d = float(self.ema_decay)
        bits = self._bits
        # in an activation-checkpoint recomputation the running estimates were already updated
        # by this step's forward: quantize with them, do not update them twice
        update = not in_backward()
        be = None if compiling() else get_backend(x)
        # eager CPU: range update + quantize in one kernel call, which reads a row-strided x (q,
        # k, v of a fused qkv projection) in place
        fused = getattr(be, "has_quantize_step", False) and not (
            self.dist_sync and update and ops.dist_world() > 1)
        if fused:
            xs, transposed = _memory_view(x, allow_transposed=self.group_dim == "channel",
                                          copy=False)
            g, inner = self.groups_for(xs.shape)  # (may resize the state: read it after)
            clip, shift, it = self._state()
            stochastic = bool(self.stochastic)
            prefix = ops.signed64(ops.seed_prefix(self._salt())) if stochastic else 0
            packed, step, sh, finite, _ = be.quantize_step(
                xs, g, inner, clip, shift, it, d, 1.0 - d, range_mode == "batch", bits, update,
                prefix, self._draws, stochastic, mode == "skip")
            if not finite:
                name = self.describe()
                if ops.must_report_nonfinite(mode, name):
                    ops._nonfinite(mode, name, tuple(xs.shape))
            return QTensor(packed, step, sh, shape, dtype, bits, g, inner, transposed)
        name = self.describe()
        xs, transposed = _memory_view(x.detach(), allow_transposed=self.group_dim == "channel")
        g, inner = self.groups_for(xs.shape)
        clip, shift, it = self._state()
        params = ops.range_update(xs, clip, shift, it, g, inner, d, range_mode == "batch", bits,
                                  update, mode, name, bool(self.dist_sync))
        inv, step, sh = params[0], params[1], params[2]
        packed = ops.quantize(xs, inv, sh, self._draws, name, bits, g, inner,
                              bool(self.stochastic), update)
        return QTensor(packed, step, sh, shape, dtype, bits, g, inner, transposed)


_NO_DRAWS = torch.zeros(1, dtype=torch.int64)  # round-to-nearest packing draws nothing


def pack_mask(mask_source: torch.Tensor) -> QTensor:
    """1-bit copy of ``mask_source > 0`` (the ReLU mask), through the same packing kernels."""
    x, transposed = _memory_view(mask_source.detach())
    one = torch.ones(1, device=x.device)
    zero = torch.zeros(1, device=x.device)
    packed = ops.quantize(x, one, zero, _NO_DRAWS, "", 1, 1, x.numel() or 1, False, False)
    return QTensor(packed, one, zero, mask_source.shape, mask_source.dtype, 1, 1, x.numel() or 1,
                   transposed)


class Quantizer(QuantMixin, torch.nn.Module):
    """A stand-alone quantizer module: the ``quant1`` / ``quant2`` of MatMul and Softmax."""

    def __init__(self, quant_groups=1, tag: str = "fm", enable: bool = False, bits: int = 8):
        torch.nn.Module.__init__(self)
        self._init_quant(quant_groups, tag=tag, enable=enable, bits=bits)


def attach_saved(t: torch.Tensor, qt: QTensor, stochastic: bool = True) -> None:
    """Record on ``t`` that ``qt`` is a packed copy of it (rounded stochastically or not), so a
    later Mesa layer that needs the same tensor for backward (attn@v after softmax) saves these
    bytes instead of a second copy."""
    t._mesa_saved = (qt, None if compiling() else t._version, bool(stochastic))


def find_saved(t: torch.Tensor, quant, dtype: torch.dtype | None = None,
               derived: bool = False) -> QTensor | AffineQTensor | MappedQTensor | None:
    """The packed copy attached to ``t`` if the quantizer ``quant`` would store the same thing:
    ``t`` not modified in place, same shape, bits, groups (count and layout), rounding mode (and
    ``dtype`` when given). ``quant`` may also be a bit width (then only bits are compared).
    With ``derived`` a copy that restores ``t`` from another layer's packed tensor is also taken
    when bits and rounding match (a LayerNorm's x-hat with its weight and bias:
    :class:`AffineQTensor`; a GELU's input through GELU: :class:`MappedQTensor`): its groups
    are that layer's, and it restores in that layer's compute dtype (the caller casts)."""
    rec = getattr(t, "_mesa_saved", None)
    if rec is None:
        return None
    qt, version, stochastic = rec
    if (version is not None and version != t._version) or qt.shape != t.shape:
        return None
    if isinstance(qt, (AffineQTensor, MappedQTensor)):
        if not derived or isinstance(quant, int):
            return None
        return qt if qt.bits == quant.bits and stochastic == bool(quant.stochastic) else None
    if dtype is not None and qt.dtype != dtype:
        return None
    if isinstance(quant, int):
        return qt if qt.bits == quant else None
    if qt.bits != quant.bits or stochastic != bool(quant.stochastic):
        return None
    if qt.transposed and quant.group_dim != "channel":
        return None
    shape = list(t.shape)
    if qt.transposed:
        shape[-2], shape[-1] = shape[-1], shape[-2]
    if (qt.groups, qt.inner) != quant.groups_for(shape):
        return None
    return qt


def save_for_backward(ctx, *items) -> None:
    """``ctx.save_for_backward`` for a mix of QTensor, AffineQTensor, Tensor and None items."""
    flat, layout = [], []
    for it in items:
        if isinstance(it, QTensor):
            layout.append(("q", len(flat), it.meta()))
            flat.extend(it.tensors())
        elif isinstance(it, AffineQTensor):
            layout.append(("a", len(flat), it.meta()))
            flat.extend(it.tensors())
        elif isinstance(it, MappedQTensor):
            layout.append(("m", len(flat), it.meta()))
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
        elif kind == "a":
            out.append(AffineQTensor.restore(flat[i:i + 5], meta))
        elif kind == "m":
            out.append(MappedQTensor.restore(flat[i:i + 3], meta))
        else:
            out.append(None)
    return out


def saved_packed(ctx) -> list:
    """The items given to :func:`save_for_backward` as they were: QTensors packed (for a
    backward that reads its stored tensor through a table, without dequantizing it)."""
    flat = ctx.saved_tensors
    out = []
    for kind, i, meta in ctx.mesa_layout:
        if kind == "q":
            out.append(QTensor(*flat[i:i + 3], *meta))
        elif kind == "t":
            out.append(flat[i])
        elif kind == "none":
            out.append(None)
        else:
            raise ValueError(f"mesa saved_packed: item kind {kind!r} has no packed form here")
    return out


# ---- policy settings: validation and application (policy.py parses files and dispatches) ------
class PolicyError(ValueError):
    """A policy file or policy setting that cannot be applied."""


def _bool(v):
    if isinstance(v, bool):
        return v
    s = str(v).strip()
    if s in ("True", "true", "1"):
        return True
    if s in ("False", "false", "0"):
        return False
    raise ValueError(f"expected True or False, got {v!r}")


def _int(v) -> int:
    if isinstance(v, bool):
        raise ValueError(f"expected an integer, got {v!r}")
    if isinstance(v, float):
        if v != int(v):
            raise ValueError(f"expected an integer, got {v!r}")
        return int(v)
    try:
        return int(str(v).strip())
    except ValueError:
        raise ValueError(f"expected an integer, got {v!r}") from None


def _level(v):
    n = _int(v)
    if n not in [1 << b for b in SUPPORTED_BITS]:
        raise ValueError(f"expected 256, 16 or 4 (8, 4 or 2 bits), got {v!r}")
    return n


def _bits(v):
    n = _int(v)
    if n not in SUPPORTED_BITS:
        raise ValueError(f"expected one of {SUPPORTED_BITS}, got {v!r}")
    return n


def _decay(v):
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"expected a decay in [0, 1), got {v!r}") from None
    if not 0.0 <= x < 1.0:
        raise ValueError(f"expected a decay in [0, 1), got {v!r}")
    return x


def _range_mode(v):
    s = str(v).strip().strip("'\"")
    if s not in ("ema", "batch"):
        raise ValueError(f"expected 'ema' or 'batch', got {v!r}")
    return s


def _pos_int(v):
    n = _int(v)
    if n < 1:
        raise ValueError(f"expected a positive integer, got {v!r}")
    return parse_groups(n)


def _nonfinite(v):
    s = str(v).strip().strip("'\"")
    if s not in NONFINITE_MODES:
        raise ValueError(f"expected one of {', '.join(NONFINITE_MODES)}, got {v!r}")
    return s


KEYS = {"enable": _bool, "level": _level, "bits": _bits, "ema_decay": _decay,
        "quant_groups": _pos_int, "group_size": _pos_int, "stochastic": _bool,
        "range_mode": _range_mode, "check_finite": _bool, "nonfinite": _nonfinite,
        "dist_sync": _bool}
# keys of the original code (and of its demo projects' policies) with no effect here: the forward
# is always the exact op (``fp_forward``), ranges are always running min/max estimates
IGNORED_KEYS = ("stable", "correlate", "non_negative_only", "half_range", "global_buffer",
                "progressive", "method", "quant_loss_function", "fp_forward", "level_num")
_META_KEYS = ("by_index", "by_tag", "index", "_ignored")


def _index_list(by_index):
    """``by_index`` as 'all' or a list of ints (from a file, the original's strings, or code)."""
    if isinstance(by_index, str):
        if by_index.strip() == "all":
            return "all"
        by_index = by_index.replace(",", " ").split()
    elif isinstance(by_index, int):
        by_index = [by_index]
    try:
        return [_int(i) for i in by_index]
    except (TypeError, ValueError):
        raise PolicyError(f"by_index: expected 'all' or layer indices, got {by_index!r}") from None


def _tag_list(by_tag):
    if by_tag is None:
        return None
    if isinstance(by_tag, str):
        return by_tag.replace(",", " ").split()
    return [str(t) for t in by_tag]


def _verbose(layer):
    v = layer.__dict__.get("verbose")
    if v is None and hasattr(layer, "quant1"):
        v = layer.quant1.__dict__.get("verbose")
    return v if callable(v) else _log.info


def _apply(target, layer, parameters) -> None:
    """Set the policy keys of ``parameters`` on ``target`` (the layer or one of its quantizers)."""
    for key, value in parameters.items():
        if key in _META_KEYS or key in IGNORED_KEYS:
            continue
        if key not in KEYS:
            raise PolicyError(f"{layer.describe()}: unknown policy key {key!r}; expected one of "
                              f"{', '.join(KEYS)}")
        try:
            value = KEYS[key](value)
        except ValueError as exc:
            raise PolicyError(f"{layer.describe()}: bad value for {key!r}: {exc}") from exc
        if key == "quant_groups":
            if value != target.quant_groups:
                _set_groups(target, value)
        else:
            setattr(target, key, value)
        name = getattr(target, "tag", layer.tag)
        _verbose(layer)(f"update {name}_{key} to {value} for index {layer.index}")


def update_quantization_parameter(layer, **parameters) -> dict:
    """Apply one policy block to a Mesa layer (the original's method, validated).

    ``index`` (an int, or a dict by tag) sets the layer's index; a block (``by_index`` with
    settings, optionally ``by_tag``) is applied when the layer's index and tag match. For
    MatMul/Softmax a ``by_tag`` of ``matmul-1`` etc. sets that one quantizer only."""
    if "index" in parameters:
        idx = parameters["index"]
        if isinstance(idx, dict):
            idx = idx.get(layer.tag, layer.index)
        layer.index = _int(idx)
    if "by_index" not in parameters:
        return {}
    by_index = _index_list(parameters["by_index"])
    if by_index != "all" and layer.index not in by_index:
        return {}
    by_tag = _tag_list(parameters.get("by_tag"))
    if by_tag is None or layer.tag in by_tag:
        _apply(layer, layer, parameters)
    elif hasattr(layer, "quant1"):
        for q in (layer.quant1, layer.quant2):
            if q.tag in by_tag:
                _apply(q, layer, parameters)
    return {}


def _set_groups(target, g):
    targets = (target.quant1, target.quant2) if hasattr(target, "quant1") else (target,)
    for q in targets:
        try:
            q._resize_groups(g)
        except ValueError as exc:
            raise PolicyError(str(exc)) from exc


def set_dist_sync(model: torch.nn.Module, enabled: bool) -> int:
    """Switch the cross-rank all-reduce of the range statistics on or off for every quantizer of
    ``model``; returns the number of quantizers set."""
    n = 0
    for m in model.modules():
        if isinstance(m, QuantMixin):
            m.dist_sync = bool(enabled)
            n += 1
    return n
