"""Packed copies of activations and how Mesa's autograd Functions store and restore them.

A :class:`QTensor` is what the quantizer (:mod:`mesa_ops.quant`) returns: b-bit codes packed in
uint8 with one fp32 step and shift per group. Two derived kinds restore a tensor from another
layer's packed copy, so that data two layers would store is stored once:
:class:`AffineQTensor` (a LayerNorm's output from its packed x-hat: x-hat * weight + bias) and
:class:`MappedQTensor` (a GELU's output from its packed input, through a table of GELU at the
2^bits values of each group). Restored tensors come from :func:`restore` (one native call
each); those of a backward from a reusable workspace (:func:`release`). How the Functions save,
share and hand on such copies: :mod:`mesa_ops.saved`."""
from __future__ import annotations

import threading
from typing import NamedTuple

import torch

from . import ops, reference
from .compat import current_graph_task_id, is_dynamo_compiling
from .backend import BACKEND_VAR, DEPENDENT_CACHES, ENV, get_backend, kernel_for, native_for

# compiling() is True while torch.compile (dynamo) traces: torch's own function under a short
# name, not a wrapper around it (a Mesa layer asks once per call: one Python frame)
compiling = is_dynamo_compiling


# the id of the backward pass the autograd engine runs on this thread, -1 outside one
_graph_task_id = current_graph_task_id
_tnew = tuple.__new__  # (a NamedTuple made without its Python __new__: once per packed copy)


class QTensor(NamedTuple):
    """A packed activation: ``packed`` uint8 codes, per-group ``step`` and ``shift`` (fp32);
    ``head``: None, or the first P rows along dim -2 (the prefix tokens: class / distillation
    tokens of (B, N, C) token tensors, (B, H, N, D) head tensors) kept exactly, in ``dtype``,
    shaped ``x.narrow(-2, 0, P)``; restored over the dequantized rows (issue 22.8: one range
    per channel group over all tokens left the class token ~23% error)."""
    packed: torch.Tensor
    step: torch.Tensor
    shift: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    bits: int
    groups: int
    inner: int
    transposed: int  # memory order stored: 0 as x; 1 (True) x.transpose(-2, -1) (a transposed
    # input); CHANNELS_LAST: x.permute(0, 2, 3, 1) (a channels-last 4-D input)
    head: torch.Tensor | None = None

    def tensors(self):
        """(packed, step, shift), and ``head`` when there is one (what is saved for backward)."""
        if self.head is None:
            return (self.packed, self.step, self.shift)
        return (self.packed, self.step, self.shift, self.head)

    @staticmethod
    def of(tensors, shape, dtype, bits, groups, inner, transposed) -> "QTensor":
        """The QTensor of :meth:`tensors` (3 or 4) and :meth:`meta`."""
        return QTensor(tensors[0], tensors[1], tensors[2], shape, dtype, bits, groups, inner,
                       transposed, tensors[3] if len(tensors) > 3 else None)

    def meta(self):
        return (self.shape, self.dtype, self.bits, self.groups, self.inner, self.transposed)

    @staticmethod
    def restore(tensors, meta) -> torch.Tensor:
        """The tensor :meth:`tensors` (3 or 4) and :meth:`meta` store (:func:`restore`; into a
        workspace buffer in a backward that records no graph)."""
        traced = compiling()
        return restore(tensors[0], tensors[1], tensors[2], tensors[3] if len(tensors) > 3 else None,
                       meta, traced, not traced and not torch.is_grad_enabled() and _graph_task_id() != -1)

    @staticmethod
    def restore_many(items, traced: bool | None = None) -> list:
        """:meth:`restore` of each (tensors, meta), in one kernel call where their backend has
        one for several (on CUDA one launch for the q, k, v of an attention)."""
        traced = compiling() if traced is None else traced
        be = None if traced or len(items) < 2 else restorer(items[0][0][0], items[0][1][1], items[0][1][2])
        if not getattr(be, "has_many", False) or any(
                restorer(t[0], m[1], m[2]) is not be for t, m in items[1:]):
            return [restore(t[0], t[1], t[2], t[3] if len(t) > 3 else None, m, traced) for t, m in items]
        calls, dones = zip(*(_restore_call(t, m) for t, m in items))
        be.dequantize_out_many(list(calls))
        return [_restored(d) for d in dones]

    def dequantize(self) -> torch.Tensor:
        return QTensor.restore(self.tensors(), self.meta())


# (kind of tensor, device, dtype, bits, MESA_BACKEND) -> the backend restoring such copies
_RESTORERS: dict = {}
DEPENDENT_CACHES.append(_RESTORERS)  # (emptied with the backends it caches: backend.clear_caches)


def restorer(packed: torch.Tensor, dtype: torch.dtype, bits: int):
    """The backend that restores a copy packed in ``packed`` (its device; fake tensors apart) at
    ``bits`` bits into ``dtype``: :func:`~mesa_ops.backend.kernel_for` of the tensor's backend,
    decided once per key."""
    key = (type(packed), packed.device, dtype, bits,
           ENV.get(BACKEND_VAR))
    be = _RESTORERS.get(key)
    if be is None:
        be = _RESTORERS[key] = kernel_for(get_backend(packed), packed, dtype, bits)
    return be


def restore(packed: torch.Tensor, step: torch.Tensor, shift: torch.Tensor, head: torch.Tensor | None,
            meta: tuple, traced: bool = False, ws: bool = False, heads: int = 0) -> torch.Tensor:
    """The tensor a packed copy stores (``meta``: :meth:`QTensor.meta`), its exact prefix rows
    ``head`` (or None) written over the dequantized ones: one ``restore`` call into a new tensor,
    or with ``ws`` (a backward that records no graph) into a workspace buffer where page faults
    would cost (:data:`WORKSPACE_MIN_BYTES`); the reference's op while ``traced``
    (torch.compile) or where the backend has no such call. With ``heads`` a (B, L, H * D)
    token layout comes back as its (B, H, L, D) heads (a view). Runs once per restored
    activation: no further Python call on the usual path."""
    shape, dtype, bits, groups, inner, transposed = meta
    if traced:
        be = None
    else:
        key = (type(packed), packed.device, dtype, bits,
               ENV.get(BACKEND_VAR))
        be = _RESTORERS.get(key)
        if be is None:
            be = restorer(packed, dtype, bits)
    if be is None or not be.has_dequantize_out:
        out = with_head(_shaped(ops.dequantize(packed, step, shift, bits, groups, inner,
                                               shape.numel(), dtype), shape, transposed), head)
        return split_heads(out, heads) if heads else out
    # the kernel writes the exact rows (of a copy stored in x's order: not across a transpose)
    kh = head if head is not None and not transposed and head.dtype is dtype else None
    numel = shape.numel()
    if not (ws and packed.is_cpu and numel * dtype.itemsize >= WORKSPACE_MIN_BYTES):
        if not transposed and (kh is not None or head is None):  # (a new tensor, in one call)
            return be.restore(packed, step, shift, bits, groups, inner, shape, dtype, kh, heads)
        flat, buf = torch.empty(numel, dtype=dtype, device=packed.device), None
    else:
        flat, buf = _workspace().acquire(numel, dtype, packed.device)
    be.dequantize_out(packed, step, shift, bits, groups, inner, flat, kh)
    if transposed:  # (a view of the buffer, which it carries: the consumer's release hands it back)
        out = _shaped(flat, shape, transposed)
        out._mesa_ws = buf
        out = with_head(out, head)
    else:
        out = flat.view(shape)
        out._mesa_ws = buf
        if kh is None and head is not None:
            out = with_head(out, head)
    return split_heads(out, heads) if heads else out


def split_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """A (B, L, H * D) token layout as its (B, H, L, D) heads (a view that carries the workspace
    buffer ``t`` came in, if any: :func:`release` of the view hands it back)."""
    out = t.view(t.shape[0], t.shape[1], heads, -1).transpose(1, 2)
    buf = getattr(t, "_mesa_ws", None)
    if buf is not None:
        out._mesa_ws, t._mesa_ws = buf, None
        out._mesa_boxed = getattr(t, "_mesa_boxed", False)
    return out


def _restore_call(tensors, meta):
    """(the dequantize_out arguments that restore a QTensor's ``tensors``/``meta`` into a new
    buffer, what :func:`_restored` makes of it): one call of several restored together."""
    packed, step, shift = tensors[0], tensors[1], tensors[2]
    head = tensors[3] if len(tensors) > 3 else None
    shape, dtype, bits, groups, inner, transposed = meta
    flat = torch.empty(shape.numel(), dtype=dtype, device=packed.device)
    kh = head if head is not None and not transposed and head.dtype == dtype else None
    return ((packed, step, shift, bits, groups, inner, flat, kh),
            (flat, shape, transposed, None if kh is not None else head))


def _restored(done) -> torch.Tensor:
    flat, shape, transposed, head = done
    return with_head(_shaped(flat, shape, transposed), head)


def with_head(out: torch.Tensor, head: torch.Tensor | None) -> torch.Tensor:
    """``out`` with its first rows along dim -2 overwritten by the exact ``head`` (in place)."""
    if head is None:
        return out
    if compiling():  # (functional: an in-place copy into a slice made AOT save a full-size buffer)
        return torch.slice_scatter(out, head.to(out.dtype), -2, 0, head.shape[-2])
    out.narrow(-2, 0, head.shape[-2]).copy_(head)
    return out


def _over_q(cls):
    """``shape`` and ``bits`` of a packed copy that wraps a QTensor ``q`` (a NamedTuple takes no
    mixin base, so they are added here, once for both)."""
    cls.shape = property(lambda self: self.q.shape)
    cls.bits = property(lambda self: self.q.bits)
    return cls


@_over_q
class AffineQTensor(NamedTuple):
    """A tensor stored as ``q.dequantize() * weight + bias`` along its last dim (``weight``,
    ``bias``: (C,) or None): a LayerNorm's output, from the packed x-hat its backward keeps."""
    q: QTensor
    weight: torch.Tensor | None
    bias: torch.Tensor | None

    def tensors(self):
        """The QTensor's (3 or 4), then weight and bias."""
        return self.q.tensors() + (self.weight, self.bias)

    def meta(self):
        return self.q.meta()

    @staticmethod
    def restore(tensors, meta) -> torch.Tensor:
        return _affine(QTensor.restore(tensors[:-2], meta), tensors[-2], tensors[-1])

    def dequantize(self) -> torch.Tensor:
        return AffineQTensor.restore(self.tensors(), self.meta())


def _affine(out: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor:
    """``out * w + b`` along the last dim, in place (``out``: a restored x-hat of its own)."""
    if w is not None:
        out = out.mul_(w)
    if b is not None:
        out = out.add_(b)
    return out


def gelu_table(x: torch.Tensor, approximate: str, grad: torch.Tensor | None = None, native=None) -> torch.Tensor:
    """GELU of ``x`` (with ``grad``: its backward, grad * GELU'(x)) in ``x``'s dtype (``grad``'s
    with a grad): the tables of GELU and GELU' at the 2^bits values of each group that a Mesa
    GELU's packed input is restored through, and its exact prefix rows. On the CPU computed in
    float64 and rounded once (ATen's own kernel: float32 GELU there goes to a library primitive
    with ~6 us of set-up per call), elsewhere in the dtype itself (one kernel). ``native``: the
    extension's composites (:func:`~mesa_ops.backend.native_for`: the same ops in one call), or
    None for these ops (while torch.compile traces, or without the extension)."""
    dtype = x.dtype if grad is None else grad.dtype
    if native is not None:
        return native.gelu_table(x, grad, approximate, dtype)
    if x.device.type == "cpu":
        x, grad = x.double(), None if grad is None else grad.double()
    if grad is None:
        return torch.nn.functional.gelu(x, approximate=approximate).to(dtype)
    return torch.ops.aten.gelu_backward(grad, x, approximate=approximate).to(dtype)


# elementwise functions a stored tensor can be restored through: name -> f(values, *args, None,
# native) (None: f itself, not its gradient; native: the extension's composites or None, as
# gelu_table takes them)
TABLE_FNS = {"gelu": gelu_table}


@_over_q
class MappedQTensor(NamedTuple):
    """A tensor stored as f(x) of a packed x, f elementwise (GELU's output, from the packed
    input the GELU keeps for its own backward): restored through a table of f at the 2^bits
    values each group's codes take, so f is computed 2^bits times per group, not per element.
    ``fn``: (name in :data:`TABLE_FNS`, *args)."""
    q: QTensor
    fn: tuple

    def tensors(self):
        return self.q.tensors()

    def meta(self):
        return self.q.meta() + (self.fn,)

    @staticmethod
    def restore(tensors, meta, traced: bool | None = None) -> torch.Tensor:
        step, shift = tensors[1], tensors[2]
        dtype, bits = meta[1], meta[2]
        name, *args = meta[6]
        traced = compiling() if traced is None else traced
        native = None if traced else native_for(ENV.get(BACKEND_VAR), step.is_cuda)
        fn = TABLE_FNS[name]
        table = fn(levels(step, shift, bits, dtype, traced), *args, None, native)
        # the exact prefix rows, through f itself
        head = (fn(tensors[3], *args, None, native)
                if len(tensors) > 3 and tensors[3] is not None else None)
        return apply_table(tensors[:3], meta[:6], table, head=head, traced=traced)

    def dequantize(self) -> torch.Tensor:
        return MappedQTensor.restore(self.tensors(), self.meta())


def levels(step: torch.Tensor, shift: torch.Tensor, bits: int, dtype: torch.dtype,
           traced: bool | None = None) -> torch.Tensor:
    """(G, 2^bits): the values each group's codes dequantize to, in ``dtype`` (the kernel's
    one call on CPU, reference.levels elsewhere and while compiling: ``traced``, None to ask).
    Read-only: in a backward the result is kept on ``step`` for the next call with the same
    arguments, neither tensor modified since (a GELU's backward and the next Linear's both take
    the levels of the GELU's packed input: one launch)."""
    if compiling() if traced is None else traced:
        return reference.levels(step, shift, bits, dtype)
    memo = getattr(step, "_mesa_levels", None)
    key = (bits, dtype, id(shift), step._version, shift._version)
    if memo is not None and memo[0] == key and memo[1] is shift:
        return memo[2]
    be = _RESTORERS.get((type(step), step.device, dtype, bits, ENV.get(BACKEND_VAR)))  # (restorer's key)
    kernel = getattr(be if be is not None else restorer(step, dtype, bits), "levels", None)
    lv = reference.levels(step, shift, bits, dtype) if kernel is None else kernel(step, shift, bits, dtype)
    if _graph_task_id() != -1:  # in a backward (tensors of a finished graph: freed with it)
        step._mesa_levels = (key, shift, lv)
    return lv


def apply_table(tensors, meta, table: torch.Tensor, mul: torch.Tensor | None = None,
                head: torch.Tensor | None = None, traced: bool | None = None) -> torch.Tensor:
    """``table[group][code]`` of a packed tensor (``tensors``/``meta`` of a QTensor), times
    ``mul`` when given, shaped as the stored tensor: (G, 2^bits) ``table`` of the result dtype.
    Without ``mul`` and in a graph-free backward the result may be a workspace buffer (release
    it). ``head``: the result's first rows along dim -2 (the exact prefix rows, shaped
    ``result.narrow(-2, 0, P)``), written over them as they are (by the kernel where it can);
    a QTensor's own ``head`` (a 4th tensor) is ignored: only the caller knows f of it.
    ``traced``: torch.compile traces (the native op ``mesa::lut_apply`` then; None to ask)."""
    packed = tensors[0]
    shape, dtype, bits, groups, inner, transposed = meta
    if transposed:
        raise ValueError("mesa apply_table: a transposed packed copy has no table path")
    numel = shape.numel()
    if compiling() if traced is None else traced:
        be = None
    else:
        be = _RESTORERS.get((type(packed), packed.device, dtype, bits, ENV.get(BACKEND_VAR)))  # (restorer's key)
        if be is None:
            be = restorer(packed, dtype, bits)
    kernel = getattr(be, "lut_apply_out", None)
    if kernel is None:  # (traced: the native op mesa::lut_apply; else the reference)
        flat = (ops.lut_apply(packed, table, bits, groups, inner, numel, mul) if be is None
                else reference.lut_apply(packed, table, bits, groups, inner, numel, mul))
        return with_head(flat.view(shape), head)
    buf = None
    if (mul is None and packed.is_cpu and numel * table.dtype.itemsize >= WORKSPACE_MIN_BYTES
            and not torch.is_grad_enabled() and _graph_task_id() != -1):
        out, buf = _workspace().acquire(numel, table.dtype, packed.device)
    else:
        out = torch.empty(numel, dtype=table.dtype, device=packed.device)
    kh = head if head is not None and head.dtype == table.dtype else None
    kernel(packed, table, bits, groups, inner, out, None if mul is None else mul.contiguous(),
           None if kh is None else kh.contiguous())
    out = out.view(shape)
    if buf is not None:
        out._mesa_ws = buf
    return out if kh is not None or head is None else with_head(out, head)


CHANNELS_LAST = 2  # QTensor.transposed of a copy stored in (B, H, W, C) order


def _shaped(flat: torch.Tensor, shape, transposed: int) -> torch.Tensor:
    if transposed == CHANNELS_LAST:
        b, c, h, w = shape
        return flat.view(b, h, w, c).permute(0, 3, 1, 2)
    if transposed:
        s = list(shape)
        s[-2], s[-1] = s[-1], s[-2]
        return flat.view(s).transpose(-2, -1)
    return flat.view(shape)


def _memory_view(x: torch.Tensor, allow_transposed: bool = True, copy: bool = True,
                 allow_channels_last: bool = False) -> tuple[torch.Tensor, int]:
    """A contiguous tensor holding ``x``'s values without a copy where one exists, and its
    layout code (:class:`QTensor`.transposed): a transposed view only for dim-1 groups, which a
    swap of the last two dims leaves in place; with ``allow_channels_last`` the (B, H, W, C)
    view of a channels-last 4-D ``x`` (PVT's spatial-reduction conv input). With
    ``copy=False`` any other ``x`` is returned as it is (the CPU kernel reads it in place or
    copies it itself)."""
    if x.is_contiguous():
        return x, 0
    if allow_transposed and x.dim() >= 4 and x.transpose(-2, -1).is_contiguous():  # k^T
        return x.transpose(-2, -1), 1
    if allow_channels_last and x.dim() == 4 and x.permute(0, 2, 3, 1).is_contiguous():
        return x.permute(0, 2, 3, 1), CHANNELS_LAST
    return (x.contiguous() if copy else x), 0


# dequantized CPU tensors of at least this many bytes come from the backward workspace
# (:class:`_Workspace`): below it an allocation costs no page faults (glibc's heap, not mmap)
WORKSPACE_MIN_BYTES = 256 * 1024


class _Workspace:
    """Reusable buffers for the dequantized activations of one backward pass (per device).

    A fresh multi-MB CPU allocation costs a page fault per 4 KiB on first touch, which made
    dequantization dominate Mesa's CPU overhead. During a backward, Mesa's Functions take their
    dequantized CPU tensors of at least :data:`WORKSPACE_MIN_BYTES` from here and hand them back
    (:func:`release`) once their gradients are computed; the buffers are dropped when the
    backward ends, so nothing is held during forward. Smaller tensors come from the allocator
    (no page faults: glibc serves them from its heap) and CUDA tensors from the caching
    allocator, without the workspace's bookkeeping. ``free`` maps (numel, dtype, device) to the free 1-D buffers of that size (a
    model restores a few sizes over and over: one dict lookup finds one); a request no free
    buffer matches exactly takes the smallest larger one (a slice of it) or a new buffer.

    The buffers are dropped by a callback queued on the backward (``armed``), which the engine
    runs only when the backward succeeds: a backward that raises disarms the workspace in the
    Mesa backward the exception passes (:func:`~mesa_ops.saved.once_differentiable`, or the
    same spelt out in the hot backwards), or else in the next Mesa
    forward or backward on this thread (an arm left by another backward is stale)."""

    MAX_FREE = 8  # buffers kept for reuse at most

    def __init__(self):
        self.free: dict = {}
        self.count = 0
        self.armed = False
        self.task = -1  # the backward (graph task id) that armed it

    def acquire(self, numel: int, dtype: torch.dtype, device: torch.device):
        """(an uninitialised 1-D tensor of ``numel`` elements, the buffer it lies in): a view of
        the tensor handed out carries the buffer as ``_mesa_ws`` (never the buffer itself: that
        would be a reference cycle)."""
        task = _graph_task_id()
        if self.armed and self.task != task:  # armed by a backward that raised (no callback ran)
            self.clear()
        if not self.armed:
            torch.autograd.Variable._execution_engine.queue_callback(self.clear)
            self.armed = True
            self.task = task
        bucket = self.free.get((numel, dtype, device))
        if bucket:
            self.count -= 1
            buf = bucket.pop()
            return buf, buf
        best = None
        for (n, dt, dev), bufs in self.free.items():
            if bufs and dt == dtype and dev == device and n > numel and (best is None or n < best[0]):
                best = (n, dt, dev)
        if best is None:
            buf = torch.empty(numel, dtype=dtype, device=device)
            return buf, buf
        self.count -= 1
        buf = self.free[best].pop()
        return buf[:numel], buf

    def release(self, buf: torch.Tensor) -> None:
        """Take back a buffer (the ``_mesa_ws`` of a tensor :meth:`acquire` gave out)."""
        if self.count < self.MAX_FREE:
            self.free.setdefault((buf.numel(), buf.dtype, buf.device), []).append(buf)
            self.count += 1

    def clear(self) -> None:
        self.free.clear()
        self.count = 0
        self.armed = False


_local = threading.local()


def _workspace() -> _Workspace:
    ws = getattr(_local, "ws", None)
    if ws is None:
        ws = _local.ws = _Workspace()
    return ws


def disarm() -> None:
    """Drop this thread's workspace buffers now (a backward raised: its callback never runs)."""
    ws = getattr(_local, "ws", None)
    if ws is not None and ws.armed:
        ws.clear()


def release(*tensors) -> None:
    """Give dequantized tensors back to the backward workspace (call after their last use).
    Only tensors from the workspace carry ``_mesa_ws`` (their buffer: restored in a graph-free
    backward, this one); one waiting in a :class:`Share` box is kept."""
    for t in tensors:
        buf = getattr(t, "_mesa_ws", None)
        if buf is not None and not getattr(t, "_mesa_boxed", False):
            t._mesa_ws = None  # (released once)
            _local.ws.release(buf)


def in_backward() -> bool:
    """True while the autograd engine runs a backward (e.g. checkpoint recomputation); False
    while torch.compile traces."""
    if compiling():
        return False
    return _graph_task_id() != -1


def pack_mask(mask_source: torch.Tensor) -> QTensor:
    """1-bit copy of ``mask_source > 0`` (the ReLU mask), through the same packing kernels."""
    x, transposed = _memory_view(mask_source.detach())
    one = torch.ones(1, device=x.device)
    zero = torch.zeros(1, device=x.device)
    packed = ops.pack(x, one, zero, 1, 1, x.numel() or 1)
    return QTensor(packed, one, zero, mask_source.shape, mask_source.dtype, 1, 1, x.numel() or 1,
                   transposed)
