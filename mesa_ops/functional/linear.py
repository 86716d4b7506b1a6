"""Linear: saves the packed input (never a copy of the weight; the parameter itself is kept)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..amp import as_dtype, autocast_plan, no_autocast
from ..packed import find_saved, once_differentiable, release, save_for_backward, saved_tensors


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, quant, cdt, amp16):
        xc = as_dtype(x, cdt)
        y = F.linear(xc, as_dtype(weight, cdt), as_dtype(bias, cdt))
        # the packed output of a Mesa SDPA, the packed x-hat of a Mesa LayerNorm or the packed
        # input of a Mesa GELU (stored once) when it is what quant would store
        qx = find_saved(x, quant, dtype=xc.dtype, derived=True)
        if qx is None:
            qx = quant.quantize(xc, amp16)
        save_for_backward(ctx, qx, weight)
        ctx.mesa_name = quant  # (described only for an error message)
        ctx.cdt, ctx.x_dtype, ctx.has_bias = cdt, x.dtype, bias is not None
        ctx.b_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, gy):
        xh, weight = saved_tensors(ctx)
        cdt = ctx.cdt
        g = as_dtype(gy, cdt)
        gx = gw = gb = None
        need = ctx.needs_input_grad
        g2 = g.reshape(-1, g.shape[-1])  # (tokens, out): mm on 2-D views, as addmm's backward
        if need[0]:
            gx = g2.mm(as_dtype(weight, cdt))
            gx = gx.view(*g.shape[:-1], gx.shape[-1])
            gx = as_dtype(gx, ctx.x_dtype)
        if need[1]:
            x2 = xh.reshape(-1, xh.shape[-1])
            gw = as_dtype(g2.t().mm(as_dtype(x2, cdt)), weight.dtype)
        if ctx.has_bias and need[2]:
            gb = as_dtype(g2.sum(0), ctx.b_dtype)
        release(xh)
        return gx, gw, gb, None, None, None


def linear_fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, quant) -> torch.Tensor:
    """y = x W^T + b for x (..., in) -> (..., out); stores x at ``quant.bits`` bits."""
    plan = autocast_plan("linear", x)
    if plan is None:
        return _Linear.apply(x, weight, bias, quant, x.dtype, False)
    with no_autocast(x):
        return _Linear.apply(x, weight, bias, quant, *plan)
