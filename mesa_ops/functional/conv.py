"""Conv2d: saves the packed input (B, C, H, W), groups along C; backward by aten's
convolution_backward on the dequantized input."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..amp import compute_dtype, fp16_autocast, no_autocast
from ..packed import release
from ..saved import once_differentiable, save_for_backward, saved_tensors


class _Conv2d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, groups, quant, cdt, amp16):
        xc = x.to(cdt)
        y = F.conv2d(xc, weight.to(cdt), None if bias is None else bias.to(cdt), stride, padding,
                     dilation, groups)
        # the input is needed only for the weight gradient: a frozen weight stores nothing
        save_for_backward(ctx, quant.quantize(xc, amp16) if weight.requires_grad else None, weight)
        ctx.x_shape = xc.shape
        ctx.mesa_name = quant.describe()
        ctx.conf = (list(stride), list(padding), list(dilation), groups)
        ctx.cdt, ctx.x_dtype = cdt, x.dtype
        ctx.bias_meta = None if bias is None else (list(bias.shape), bias.dtype)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, gy):
        xh, weight = saved_tensors(ctx)
        if xh is None:  # only its shape is read (no weight gradient)
            xh = gy.new_zeros(()).expand(ctx.x_shape)
        stride, padding, dilation, groups = ctx.conf
        need = ctx.needs_input_grad
        bias_sizes = ctx.bias_meta[0] if ctx.bias_meta else None
        gx, gw, gb = torch.ops.aten.convolution_backward(
            gy.to(ctx.cdt), xh.to(ctx.cdt), weight.to(ctx.cdt), bias_sizes, stride, padding,
            dilation, False, [0, 0], groups, [need[0], need[1], bool(ctx.bias_meta) and need[2]])
        release(xh)
        gx = gx.to(ctx.x_dtype) if gx is not None else None
        gw = gw.to(weight.dtype) if gw is not None else None
        gb = gb.to(ctx.bias_meta[1]) if gb is not None else None
        return gx, gw, gb, None, None, None, None, None, None, None


def conv2d_fn(x, weight, bias, stride, padding, dilation, groups, quant) -> torch.Tensor:
    """2-D convolution with integer padding; x (B, C, H, W) stored at ``quant.bits`` bits."""
    cdt = compute_dtype("conv2d", x)
    amp16 = fp16_autocast(x)  # read before autocast is switched off
    with no_autocast(x):
        return _Conv2d.apply(x, weight, bias, tuple(stride), tuple(padding), tuple(dilation),
                             groups, quant, cdt, amp16)
