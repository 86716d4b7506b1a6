"""Linear: saves the packed input (never a copy of the weight; the parameter itself is kept)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..amp import compute_dtype, no_autocast
from ..quant import find_saved, release, save_for_backward, saved_tensors


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, quant, cdt):
        xc = x.to(cdt)
        y = F.linear(xc, weight.to(cdt), None if bias is None else bias.to(cdt))
        qx = find_saved(x, quant.bits)  # e.g. the packed output of a Mesa SDPA (stored once)
        if qx is None or qx.dtype != xc.dtype or qx.groups != quant.groups_for(xc.shape)[0]:
            qx = quant.quantize(xc)
        save_for_backward(ctx, qx, weight)
        ctx.cdt, ctx.x_dtype, ctx.has_bias = cdt, x.dtype, bias is not None
        ctx.b_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
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
        return gx, gw, gb, None, None


def linear_fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, quant) -> torch.Tensor:
    """y = x W^T + b for x (..., in) -> (..., out); stores x at ``quant.bits`` bits."""
    cdt = compute_dtype("linear", x)
    with no_autocast(x):
        return _Linear.apply(x, weight, bias, quant, cdt)
