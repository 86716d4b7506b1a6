"""Linear: saves the packed input (never a copy of the weight; the parameter itself is kept)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..amp import compute_dtype, fp16_autocast, no_autocast
from ..quant import find_saved, once_differentiable, release, save_for_backward, saved_tensors


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, quant, cdt, amp16):
        xc = x.to(cdt)
        y = F.linear(xc, weight.to(cdt), None if bias is None else bias.to(cdt))
        # e.g. the packed output of a Mesa SDPA (stored once) when it is what quant would store
        qx = find_saved(x, quant, dtype=xc.dtype)
        if qx is None:
            qx = quant.quantize(xc, amp16)
        save_for_backward(ctx, qx, weight)
        ctx.mesa_name = quant.describe()
        ctx.cdt, ctx.x_dtype, ctx.has_bias = cdt, x.dtype, bias is not None
        ctx.b_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, gy):
        xh, weight = saved_tensors(ctx)
        g = gy.to(ctx.cdt)
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = g.matmul(weight.to(ctx.cdt)).to(ctx.x_dtype)
        g2 = g.reshape(-1, g.shape[-1])
        if ctx.needs_input_grad[1]:
            gw = g2.t().matmul(xh.reshape(-1, xh.shape[-1]).to(ctx.cdt)).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g2.sum(0).to(ctx.b_dtype)
        release(xh)
        return gx, gw, gb, None, None, None


def linear_fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, quant) -> torch.Tensor:
    """y = x W^T + b for x (..., in) -> (..., out); stores x at ``quant.bits`` bits."""
    cdt = compute_dtype("linear", x)
    amp16 = fp16_autocast(x)  # read before autocast is switched off
    with no_autocast(x):
        return _Linear.apply(x, weight, bias, quant, cdt, amp16)
