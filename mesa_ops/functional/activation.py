"""GELU (packed input), Softmax (packed output only: its gradient needs nothing else; the original
saves input and output) and ReLU (a 1-bit mask: its gradient is exact)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..amp import autocast_plan, compute_dtype, fp16_autocast, no_autocast
from ..quant import (QTensor, attach_saved, once_differentiable, pack_mask, release, save_for_backward,
                     saved_tensors)


class _GELU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, approximate, quant, cdt, amp16):
        xc = x if x.dtype == cdt else x.to(cdt)
        y = F.gelu(xc, approximate=approximate)
        save_for_backward(ctx, quant.quantize(xc, amp16))
        ctx.mesa_name = quant
        ctx.approximate, ctx.x_dtype, ctx.cdt = approximate, x.dtype, cdt
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, gy):
        (xh,) = saved_tensors(ctx)
        cdt = ctx.cdt
        gx = torch.ops.aten.gelu_backward(gy if gy.dtype == cdt else gy.to(cdt), xh,
                                          approximate=ctx.approximate)
        release(xh)
        return gx if gx.dtype == ctx.x_dtype else gx.to(ctx.x_dtype), None, None, None, None


def gelu_fn(x: torch.Tensor, approximate: str, quant) -> torch.Tensor:
    plan = autocast_plan("gelu", x)
    if plan is None:
        return _GELU.apply(x, approximate, quant, x.dtype, False)
    with no_autocast(x):
        return _GELU.apply(x, approximate, quant, *plan)


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, quant, cdt, amp16):
        y = torch.softmax(x.to(cdt), dim)
        qy = quant.quantize(y, amp16)
        save_for_backward(ctx, qy)
        ctx.dim, ctx.x_dtype, ctx.cdt = dim, x.dtype, cdt
        ctx.mesa_name = quant.describe()
        packed = qy.tensors() if isinstance(qy, QTensor) else ()
        ctx.mark_non_differentiable(*packed)
        return (y,) + packed  # the packed copy goes out too, for attn @ v to reuse

    @staticmethod
    @once_differentiable
    def backward(ctx, gy, *unused):
        (yh,) = saved_tensors(ctx)
        gx = torch._softmax_backward_data(gy.to(ctx.cdt), yh, ctx.dim, ctx.cdt)
        release(yh)
        return gx.to(ctx.x_dtype), None, None, None, None


def softmax_fn(x: torch.Tensor, dim: int, quant) -> torch.Tensor:
    """Softmax along ``dim``; the packed output is attached to it so that a following Mesa MatMul
    (attn @ v) reuses those bytes instead of storing the same tensor again."""
    cdt = compute_dtype("softmax", x)
    amp16 = fp16_autocast(x)
    with no_autocast(x):
        y, *packed = _Softmax.apply(x, dim, quant, cdt, amp16)
    if packed:
        g, inner = quant.groups_for(y.shape)  # y is contiguous: stored as it is
        attach_saved(y, QTensor(*packed, y.shape, y.dtype, quant.bits, g, inner, False),
                     quant.stochastic)
    return y


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
