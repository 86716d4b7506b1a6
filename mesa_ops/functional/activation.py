"""GELU (packed input, read through tables in backward and by the next Linear), Softmax (packed
output only: its gradient needs nothing else; the original saves input and output) and ReLU (a
1-bit mask: its gradient is exact)."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..amp import apply_without_autocast, autocast_dtype, compute_dtype, fp16_autocast, no_autocast
from ..backend import BACKEND_VAR, ENV, native_for
from ..packed import (MappedQTensor, QTensor, _tnew, apply_table, compiling, disarm, gelu_table, levels,
                      pack_mask, release)
from ..saved import (attach_saved, graph_backward, hand_on, once_differentiable, output_copy,
                     save_for_backward, saved_packed, saved_tensors)


@functools.lru_cache(maxsize=32)
def _ones(shape, dtype, device, mode):
    """A read-only (G, 2^bits) tensor of ones: the gradient GELU' at the levels is taken with
    (made once per shape, not by a fill launch in every backward); ``mode``: the fake tensor
    mode of the levels (None for real tensors), so that one mode's fake tensor never reaches
    another mode or a real backward."""
    return torch.ones(shape, dtype=dtype, device=device)


class _GELU(torch.autograd.Function):
    """GELU storing its input x packed. The backward reads GELU'(x) off a table of GELU' at
    the 2^bits values each group's codes take (no per-element erf/exp, no dequantized copy);
    the packed x also goes out, so that the next Linear restores its input GELU(x) through a
    table of GELU instead of storing a second copy (in eager mode the Function has one output,
    which carries the copy as an attribute: :func:`~mesa_ops.saved.hand_on`)."""

    @staticmethod
    def forward(ctx, x, approximate, quant, cdt, amp16, out_packed=False):
        xc = x if x.dtype is cdt else x.to(cdt)
        y = F.gelu(xc, approximate=approximate)
        qx = quant.quantize(xc, amp16, None, out_packed)
        save_for_backward(ctx, qx, traced=out_packed)
        ctx.mesa_name = quant
        ctx.approximate, ctx.x_dtype, ctx.cdt, ctx.traced = approximate, x.dtype, cdt, out_packed
        # the next Mesa Linear restores y = GELU(x) from the same bytes, through a table
        return hand_on(ctx, y, qx, out_packed,
                       None if out_packed else _tnew(MappedQTensor, (qx, ("gelu", approximate))),
                       quant)

    @staticmethod
    def backward(ctx, gy, *unused):  # (once_differentiable, spelt out: saved.once_differentiable)
        if torch.is_grad_enabled():
            return graph_backward(_GELU.backward, ctx, gy, *unused)
        if gy is None:  # (grads are not materialized: the output took no gradient)
            return None, None, None, None, None, None
        try:
            (xq,) = saved_packed(ctx)
            cdt, traced = ctx.cdt, ctx.traced
            g = gy if gy.dtype is cdt else gy.to(cdt)
            if type(xq) is QTensor:
                lv = levels(xq.step, xq.shift, xq.bits, xq.dtype, traced)
                one = (torch.ones_like(lv) if traced
                       else _ones(lv.shape, lv.dtype, lv.device, getattr(lv, "fake_mode", None)))
                native = None if traced else native_for(ENV.get(BACKEND_VAR), lv.is_cuda)
                # (G, 2^bits) GELU' at the levels (packed.gelu_table; the native call directly)
                deriv = (gelu_table(lv, ctx.approximate, one) if native is None
                         else native.gelu_table(lv, one, ctx.approximate, lv.dtype))
                head = None
                if xq.head is not None:  # the exact prefix rows (QTensor.head)
                    head = gelu_table(xq.head, ctx.approximate, g.narrow(-2, 0, xq.head.shape[-2]), native)
                gx = apply_table(xq, (xq[3], xq[4], xq[5], xq[6], xq[7], xq[8]), deriv, g, head, traced)
            else:  # a stand-in quantizer that stored x as it is (tests)
                gx = torch.ops.aten.gelu_backward(g, xq, approximate=ctx.approximate)
            return gx if gx.dtype is ctx.x_dtype else gx.to(ctx.x_dtype), None, None, None, None, None
        except BaseException:
            disarm()  # (the engine drops its callbacks: the workspace would stay held)
            raise


def gelu_fn(x: torch.Tensor, approximate: str, quant) -> torch.Tensor:
    """GELU of x (..., C); the output carries the packed input for the next Mesa Linear."""
    # under torch.compile the packed input comes out of the Function (dynamo keeps no Python
    # attributes on its nodes); in eager mode the Function's output carries it
    traced = compiling()
    dev = x.device.type
    if not torch.is_autocast_enabled(dev):
        cdt = x.dtype
        y = _GELU.apply(x, approximate, quant, cdt, False, traced)
    else:
        amp = torch.get_autocast_dtype(dev)  # (what autocast would compute in)
        cdt = autocast_dtype("gelu", dev, amp, x.dtype) if x.is_floating_point() else x.dtype
        y = apply_without_autocast(dev, traced, _GELU.apply, x, approximate, quant, cdt, amp == torch.float16,
                                   traced)
    if not traced:
        return y
    y, qx = output_copy(y, quant, cdt)
    if qx is None:
        return y
    return attach_saved(y, MappedQTensor(qx, ("gelu", approximate)), quant.stochastic)


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, quant, cdt, amp16, out_packed=False):
        y = torch.softmax(x if x.dtype is cdt else x.to(cdt), dim)
        qy = quant.quantize(y, amp16, None, out_packed)
        save_for_backward(ctx, qy)
        ctx.dim, ctx.x_dtype, ctx.cdt, ctx.traced = dim, x.dtype, cdt, out_packed
        ctx.mesa_name = quant
        return hand_on(ctx, y, qy, out_packed, None, quant)  # (attn @ v reuses the copy)

    @staticmethod
    @once_differentiable
    def backward(ctx, gy, *unused):
        if gy is None:  # (grads are not materialized: the output took no gradient)
            return None, None, None, None, None, None
        (held,) = saved_tensors(ctx, False, 0, ctx.traced)
        # each restored row renormalised to sum to one, as exact's does: the input gradient then
        # sums to zero along dim, so a shift of the logits (a key bias) gets no gradient (issue 49)
        # (a row restored to all zeros, e.g. masked at 2 bits, stays zero: no 0 / 0)
        total = held.sum(ctx.dim, keepdim=True)
        yh = torch.where(total > 0, held / total, held)
        gx = torch._softmax_backward_data(gy.to(ctx.cdt), yh, ctx.dim, ctx.cdt)
        release(held)
        return gx.to(ctx.x_dtype), None, None, None, None, None


def softmax_fn(x: torch.Tensor, dim: int, quant) -> torch.Tensor:
    """Softmax along ``dim``; the packed output is attached to it so that a following Mesa MatMul
    (attn @ v) reuses those bytes instead of storing the same tensor again."""
    cdt = compute_dtype("softmax", x)
    amp16 = fp16_autocast(x)
    traced = compiling()
    with no_autocast(x):
        y = _Softmax.apply(x, dim, quant, cdt, amp16, traced)
    if not traced:
        return y
    y, qy = output_copy(y, quant, cdt)  # (y is contiguous: stored as it is)
    if qy is None:
        return y
    return attach_saved(y, qy, quant.stochastic)


class _ReLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = torch.relu(x)
        save_for_backward(ctx, pack_mask(y))
        ctx.mesa_name = "ReLU"
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, gy):
        (mask,) = saved_tensors(ctx)
        gx = gy * mask.to(gy.dtype)
        release(mask)
        return gx


# devices whose dropout is the fused kernel (aten's is_fused_kernel_acceptable; the CPU draws a
# noise tensor instead: _dropout_impl)
_FUSED_DROPOUT = ("cuda", "xpu", "lazy", "privateuseone")


class _Dropout(torch.autograd.Function):
    """``F.dropout(x, p, training=True)`` drawn as aten draws it (the same generator calls: the
    output is bit for bit nn.Dropout's under the same seed), keeping the 1-bit mask for backward
    instead of the mask (CUDA: bool) or the scaled noise (CPU: x's dtype)."""

    @staticmethod
    def forward(ctx, x, p: float):
        fused = x.device.type in _FUSED_DROPOUT
        if fused:
            y, mask = torch.native_dropout(x, p, True)
            kept = pack_mask(mask.to(x.dtype))
        else:  # (aten: empty_like(x).bernoulli_(1 - p).div_(1 - p); x * noise)
            noise = torch.empty_like(x).bernoulli_(1 - p)
            noise.div_(1 - p)
            y = x * noise
            kept = pack_mask(noise)
        save_for_backward(ctx, kept)
        ctx.p, ctx.fused, ctx.mesa_name = p, fused, "Dropout"
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, gy):
        (m,) = saved_tensors(ctx)
        p = ctx.p
        if ctx.fused:
            gx = torch.ops.aten.native_dropout_backward(gy, m > 0, 1.0 / (1.0 - p))
        else:  # exact's gy * noise: the noise rebuilt from the mask, its kept value as div_ made it
            gx = gy * m.to(gy.dtype).mul_(torch.ones((), dtype=gy.dtype, device=gy.device).div_(1 - p))
        release(m)
        return gx, None


def dropout_fn(x: torch.Tensor, p: float) -> torch.Tensor:
    """Dropout of x with probability ``p`` (training) whose backward keeps a 1-bit mask: the
    output and the gradient are nn.Dropout's bit for bit (the same draws)."""
    if p <= 0.0 or x.numel() == 0 or not x.is_floating_point():
        return F.dropout(x, p, True)
    if p >= 1.0:
        return x * 0.0
    return _Dropout.apply(x, float(p))


def relu_fn(x: torch.Tensor) -> torch.Tensor:
    """ReLU whose backward keeps only the 1-bit mask y > 0 (exact gradient)."""
    return _ReLU.apply(x)
