"""Linear: saves the packed input (never a copy of the weight; the parameter itself is kept)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..amp import autocast_plan, no_autocast
from ..packed import find_saved, once_differentiable, release, save_for_backward, saved_tensors


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, quant, cdt, amp16):
        xc = x if x.dtype == cdt else x.to(cdt)
        w = weight if weight.dtype == cdt else weight.to(cdt)
        y = F.linear(xc, w, bias if bias is None or bias.dtype == cdt else bias.to(cdt))
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
        g = gy if gy.dtype == cdt else gy.to(cdt)
        gx = gw = gb = None
        need = ctx.needs_input_grad
        g2 = g.reshape(-1, g.shape[-1])  # (tokens, out): mm on 2-D views, as addmm's backward
        if need[0]:
            gx = g2.mm(weight if weight.dtype == cdt else weight.to(cdt))
            gx = gx.view(*g.shape[:-1], gx.shape[-1])
            gx = gx if gx.dtype == ctx.x_dtype else gx.to(ctx.x_dtype)
        if need[1]:
            x2 = xh.reshape(-1, xh.shape[-1])
            gw = g2.t().mm(x2 if x2.dtype == cdt else x2.to(cdt))
            gw = gw if gw.dtype == weight.dtype else gw.to(weight.dtype)
        if ctx.has_bias and need[2]:
            gb = g2.sum(0)
            gb = gb if gb.dtype == ctx.b_dtype else gb.to(ctx.b_dtype)
        release(xh)
        return gx, gw, gb, None, None, None


def linear_fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, quant) -> torch.Tensor:
    """y = x W^T + b for x (..., in) -> (..., out); stores x at ``quant.bits`` bits."""
    plan = autocast_plan("linear", x)
    if plan is None:
        return _Linear.apply(x, weight, bias, quant, x.dtype, False)
    with no_autocast(x):
        return _Linear.apply(x, weight, bias, quant, *plan)
