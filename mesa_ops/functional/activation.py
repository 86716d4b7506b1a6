"""GELU (packed input, read through tables in backward and by the next Linear), Softmax (packed
output only: its gradient needs nothing else; the original saves input and output) and ReLU (a
1-bit mask: its gradient is exact)."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..amp import apply_without_autocast, autocast_plan, compute_dtype, fp16_autocast, no_autocast
from ..backend import BACKEND_VAR, ENV, native_for
from ..packed import (MappedQTensor, QTensor, _tnew, apply_table, attach_saved, compiling, gelu_table, hand_on, levels,
                      once_differentiable, output_copy, pack_mask, release, save_for_backward,
                      saved_packed, saved_tensors)


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
    table of GELU instead of storing a second copy (in eager mode it stays on the node,
    one output: :func:`~mesa_ops.packed.hand_on`)."""

    @staticmethod
    def forward(ctx, x, approximate, quant, cdt, amp16, out_packed=False):
        xc = x if x.dtype is cdt else x.to(cdt)
        y = F.gelu(xc, approximate=approximate)
        qx = quant.quantize(xc, amp16, None, out_packed)
        save_for_backward(ctx, qx)
        ctx.mesa_name = quant
        ctx.approximate, ctx.x_dtype, ctx.cdt, ctx.traced = approximate, x.dtype, cdt, out_packed
        # the next Mesa Linear restores y = GELU(x) from the same bytes, through a table
        return hand_on(ctx, y, qx, out_packed,
                       None if out_packed else _tnew(MappedQTensor, (qx, ("gelu", approximate))),
                       quant)

    @staticmethod
    @once_differentiable
    def backward(ctx, gy, *unused):
        if gy is None:  # (grads are not materialized: the output took no gradient)
            return None, None, None, None, None, None
        (xq,) = saved_packed(ctx)
        cdt, traced = ctx.cdt, ctx.traced
        g = gy if gy.dtype is cdt else gy.to(cdt)
        if type(xq) is QTensor:
            lv = levels(xq.step, xq.shift, xq.bits, xq.dtype, traced)
            one = (torch.ones_like(lv) if traced
                   else _ones(lv.shape, lv.dtype, lv.device, getattr(lv, "fake_mode", None)))
            native = None if traced else native_for(ENV.get(BACKEND_VAR))
            deriv = gelu_table(lv, ctx.approximate, one, native)  # (G, 2^bits) GELU' at the levels
            head = None
            if xq.head is not None:  # the exact prefix rows (QTensor.head)
                head = gelu_table(xq.head, ctx.approximate, g.narrow(-2, 0, xq.head.shape[-2]), native)
            gx = apply_table(xq, xq[3:9], deriv, g, head, traced)
        else:  # a stand-in quantizer that stored x as it is (tests)
            gx = torch.ops.aten.gelu_backward(g, xq, approximate=ctx.approximate)
        return gx if gx.dtype is ctx.x_dtype else gx.to(ctx.x_dtype), None, None, None, None, None


def gelu_fn(x: torch.Tensor, approximate: str, quant) -> torch.Tensor:
    """GELU of x (..., C); the output carries the packed input for the next Mesa Linear."""
    # under torch.compile the packed input comes out of the Function (dynamo keeps no Python
    # attributes on its nodes); in eager mode the Function's output carries it
    traced = compiling()
    plan = autocast_plan("gelu", x) if torch.is_autocast_enabled(x.device.type) else None
    if plan is None:
        cdt = x.dtype
        y = _GELU.apply(x, approximate, quant, cdt, False, traced)
    else:
        cdt = plan[0]
        y = apply_without_autocast(x.device.type, traced, _GELU.apply, x, approximate, quant, *plan, traced)
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
        (yh,) = saved_tensors(ctx, False, 0, ctx.traced)
        gx = torch._softmax_backward_data(gy.to(ctx.cdt), yh, ctx.dim, ctx.cdt)
        release(yh)
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


def relu_fn(x: torch.Tensor) -> torch.Tensor:
    """ReLU whose backward keeps only the 1-bit mask y > 0 (exact gradient)."""
    return _ReLU.apply(x)
