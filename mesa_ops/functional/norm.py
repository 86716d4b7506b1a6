"""LayerNorm (packed input + fp32 mean/rstd) and BatchNorm2d (packed input + per-channel batch
statistics), with aten's own backward kernels on the dequantized input."""
from __future__ import annotations

import torch

from ..amp import compute_dtype, fp16_autocast, no_autocast
from ..quant import once_differentiable, release, save_for_backward, saved_tensors


def _cast_params(cdt, x, *params):
    """Autocast casts the parameters of an op only when it casts its input (fp32-list ops)."""
    if cdt == x.dtype:
        return params
    return tuple(None if p is None else p.to(cdt) for p in params)


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, normalized_shape, weight, bias, eps, quant, cdt, amp16):
        xc = x.to(cdt)
        w, b = _cast_params(cdt, x, weight, bias)
        y, mean, rstd = torch.native_layer_norm(xc, normalized_shape, w, b, eps)
        save_for_backward(ctx, quant.quantize(xc, amp16), mean, rstd, w, b)
        ctx.mesa_name = quant.describe()
        ctx.normalized_shape, ctx.x_dtype, ctx.cdt = list(normalized_shape), x.dtype, cdt
        ctx.p_dtypes = (None if weight is None else weight.dtype, None if bias is None else bias.dtype)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, gy):
        xh, mean, rstd, w, b = saved_tensors(ctx)
        need = ctx.needs_input_grad
        gx, gw, gb = torch.ops.aten.native_layer_norm_backward(
            gy.to(ctx.cdt), xh, ctx.normalized_shape, mean, rstd, w, b,
            [need[0], w is not None and need[2], b is not None and need[3]])
        release(xh)
        gx = gx.to(ctx.x_dtype) if gx is not None else None
        gw = gw.to(ctx.p_dtypes[0]) if gw is not None else None
        gb = gb.to(ctx.p_dtypes[1]) if gb is not None else None
        return gx, None, gw, gb, None, None, None, None


def layer_norm_fn(x, normalized_shape, weight, bias, eps, quant) -> torch.Tensor:
    """LayerNorm over the trailing ``normalized_shape`` dims of x (..., C)."""
    cdt = compute_dtype("layer_norm", x)
    amp16 = fp16_autocast(x)  # read before autocast is switched off
    with no_autocast(x):
        return _LayerNorm.apply(x, tuple(normalized_shape), weight, bias, eps, quant, cdt,
                                amp16)


class _BatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps, quant, cdt, amp16):
        xc = x.to(cdt)
        w, b = _cast_params(cdt, x, weight, bias)
        y, save_mean, save_var, reserve, impl = torch._batch_norm_impl_index(
            xc, w, b, running_mean, running_var, True, momentum, eps,
            torch.backends.cudnn.enabled)
        # training-mode backward reads the batch statistics only, not the running ones
        save_for_backward(ctx, quant.quantize(xc, amp16), w, save_mean, save_var, reserve)
        ctx.mesa_name = quant.describe()
        ctx.impl, ctx.eps, ctx.x_dtype, ctx.cdt = impl, eps, x.dtype, cdt
        ctx.p_dtypes = (None if weight is None else weight.dtype, None if bias is None else bias.dtype)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, gy):
        xh, w, save_mean, save_var, reserve = saved_tensors(ctx)
        need = ctx.needs_input_grad
        gx, gw, gb = torch.ops.aten._batch_norm_impl_index_backward(
            ctx.impl, xh, gy.to(ctx.cdt).contiguous(), w, None, None, save_mean, save_var, True,
            ctx.eps, [need[0], w is not None and need[1], w is not None and need[2]], reserve)
        release(xh)
        gx = gx.to(ctx.x_dtype) if gx is not None else None
        gw = gw.to(ctx.p_dtypes[0]) if gw is not None else None
        gb = gb.to(ctx.p_dtypes[1]) if gb is not None else None
        return gx, gw, gb, None, None, None, None, None, None, None


def batch_norm_fn(x, weight, bias, running_mean, running_var, momentum, eps, quant) -> torch.Tensor:
    """Training-mode batch norm of x (B, C, H, W) with batch statistics (updates running stats)."""
    cdt = compute_dtype("batch_norm", x)
    amp16 = fp16_autocast(x)  # read before autocast is switched off
    with no_autocast(x):
        return _BatchNorm.apply(x, weight, bias, running_mean, running_var, momentum, eps, quant, cdt,
                                amp16)
