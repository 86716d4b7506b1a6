"""LayerNorm (packed normalized input x-hat + fp32 rstd, shared with the next Mesa Linear) and
BatchNorm2d (packed input + per-channel batch statistics), with aten's own backward kernels on
the dequantized tensors."""
from __future__ import annotations

import functools

import torch

from ..amp import (WIDE_DTYPES as _WIDE, apply_without_autocast, as_dtype, autocast_dtype, compute_dtype,
                   fp16_autocast, no_autocast)
from ..backend import BACKEND_VAR, ENV, native_for
from ..packed import AffineQTensor, _tnew, compiling, disarm, release
from ..saved import (attach_saved, graph_backward, hand_on, once_differentiable, output_copy,
                     save_for_backward, saved_tensors)


def _cast_params(cdt, x, *params):
    """Autocast casts the parameters of an op only when it casts its input (fp32-list ops)."""
    if cdt == x.dtype:
        return params
    return tuple(None if p is None else p.to(cdt) for p in params)


def centre(xh: torch.Tensor, dims) -> torch.Tensor:
    """The mean of a restored x-hat over ``dims`` (a LayerNorm's row, a batch norm's channel),
    float32 or wider, kept dims: what backward subtracts so that the x-hat it works with has
    mean 0 there, as exact's has. The input gradient then sums to zero over ``dims`` as exact's
    does, so a bias or shift before the norm gets exact's (zero) gradient instead of the packing
    error's projection (issue 49). (A scale before the norm needs the gradient orthogonal to the
    true input, which Mesa does not store: that one keeps the packing noise, see
    tests/test_invariances.py.)"""
    return xh.mean(dims, keepdim=True, dtype=None if xh.dtype in _WIDE else torch.float32)


class _LayerNorm(torch.autograd.Function):
    """y = x-hat * weight + bias, x-hat = (x - mean) * rstd over the normalized dims.

    Saves x-hat (packed; computed in float32 or wider) and rstd, which is all the backward
    needs: with x-hat as the input, mean 0 and rstd 1, aten's backward gives the weight and bias
    gradients as they are and the input gradient divided by rstd. The packed x-hat also goes out
    (as Softmax's packed output does, so torch.compile sees it) for the Linear fed by y, which
    then stores no second copy: it restores y as x-hat * weight + bias. In eager mode the
    Function has one output, which carries the packed x-hat as an attribute
    (:func:`~mesa_ops.saved.hand_on`)."""

    @staticmethod
    def forward(ctx, x, normalized_shape, weight, bias, eps, quant, cdt, amp16, out_packed=False):
        # (aten's LayerNorm reads a contiguous copy of a strided x, PVT's patch-embedding
        # tokens (B, C, N).transpose: taken once here, it serves the kernel that packs x too)
        xc = (x if x.dtype is cdt else x.to(cdt)).contiguous()
        w, b = (weight, bias) if cdt is x.dtype else _cast_params(cdt, x, weight, bias)
        y, mean, rstd = torch.native_layer_norm(xc, normalized_shape, w, b, eps)
        ctx.stats_dtype = mean.dtype
        if mean.dtype not in _WIDE:  # (CPU, fp16/bf16 parameters: statistics rounded to that
            # dtype, whose error would be a whole-row offset of x-hat): fp32 statistics
            dims = tuple(range(-len(normalized_shape), 0))
            var, mean = torch.var_mean(xc.float(), dim=dims, correction=0, keepdim=True)
            rstd = torch.rsqrt(var.add_(eps))
        # x-hat = (x - mean) * rstd in float32 or wider (normalized by the kernel as it reads x)
        qx = quant.quantize(xc, amp16, (mean, rstd), out_packed)
        save_for_backward(ctx, qx, rstd, w, b, traced=out_packed)
        ctx.mesa_name = quant
        ctx.normalized_shape, ctx.x_dtype, ctx.cdt = list(normalized_shape), x.dtype, cdt
        ctx.p_dtypes = (None if weight is None else weight.dtype, None if bias is None else bias.dtype)
        ctx.traced = out_packed
        if out_packed:  # dynamo lets attributes be set on a single-output op's result only
            y = y.view_as(y)
        # the next Mesa Linear restores y from the same bytes: x-hat * w + b; the consumer's
        # backward restores x-hat once for both (item 0 is shared)
        return hand_on(ctx, y, qx, out_packed, None if out_packed else _tnew(AffineQTensor, (qx, w, b)),
                       quant, 0)

    @staticmethod
    def backward(ctx, gy, *unused):  # (once_differentiable, spelt out: saved.once_differentiable)
        if torch.is_grad_enabled():
            return graph_backward(_LayerNorm.backward, ctx, gy, *unused)
        if gy is None:  # (grads are not materialized: the output took no gradient)
            return (None,) * 9
        try:
            xh, rstd, w, b = saved_tensors(ctx, False, 0, ctx.traced)
            need = ctx.needs_input_grad
            shape = ctx.normalized_shape
            # on the CPU in float32/64, the weight and bias gradients as column sums, reduced in an
            # order that does not depend on the thread count (aten's CPU kernel sums per-thread
            # partials: another thread count changed their last bits, which stochastic rounding then
            # amplified: tests/test_determinism.py); elsewhere aten's kernel gives all three
            need_w, need_b = w is not None and need[2], b is not None and need[3]
            own = (gy.device.type == "cpu" and ctx.cdt in _WIDE and (need_w or need_b)
                   and gy.dim() > len(shape))  # (an unbatched input: nothing to sum over)
            native = None if ctx.traced else native_for(ENV.get(BACKEND_VAR), gy.is_cuda)
            # (mean 0 and rstd 1: x-hat is its own normalized input; made once per shape)
            # (x-hat's own row mean, not 0: the x-hat the backward works with is centred, see centre)
            _, one = _unit_stats(rstd.shape, ctx.stats_dtype, rstd.device)
            zero = centre(xh, tuple(range(-len(shape), 0))).to(ctx.stats_dtype)
            gx, gw, gb = (layer_norm_grads if native is None else native.layer_norm_backward)(
                gy, xh, rstd, zero, one, w, b, shape, need[0], need_w, need_b, own, ctx.cdt, ctx.x_dtype,
                *ctx.p_dtypes)
            if getattr(xh, "_mesa_ws", None) is not None:  # (a workspace buffer: given back)
                release(xh)
            return gx, None, gw, gb, None, None, None, None, None
        except BaseException:
            disarm()  # (the engine drops its callbacks: the workspace would stay held)
            raise


def layer_norm_grads(gy, xh, rstd, zero, one, w, b, normalized_shape, need_x: bool, need_w: bool,
                     need_b: bool, own_sums: bool, cdt, x_dtype, w_dtype, b_dtype):
    """(gx, gw, gb) of a LayerNorm from its stored x-hat (float32 or wider) and rstd: aten's
    backward with mean ``zero`` (x-hat's own row mean: :func:`centre`) and rstd ``one`` (x-hat
    less that mean is its own normalized input) and the input gradient times rstd; with ``own_sums`` the weight and bias gradients as column sums;
    None where not needed. The specification of the extension's ``layer_norm_backward``
    (cuda/layer_grads.cpp: the same ops in one native call), and what runs while torch.compile
    traces."""
    g = as_dtype(gy, cdt)
    xc = as_dtype(xh, cdt)
    gx, gw, gb = torch.ops.aten.native_layer_norm_backward(
        g, xc, normalized_shape, zero, one, w, b, [need_x, False, False] if own_sums else [need_x, need_w, need_b])
    if own_sums:
        dims = tuple(range(g.dim() - len(normalized_shape)))
        gw = (g * (xc - zero)).sum(dims) if need_w else None
        gb = g.sum(dims) if need_b else None
    if gx is not None:
        gx = as_dtype(gx.mul_(rstd), x_dtype)
    return gx, as_dtype(gw, w_dtype), as_dtype(gb, b_dtype)


@functools.lru_cache(maxsize=32)
def _unit_stats(shape, dtype, device):
    """Mean 0 and rstd 1 of the given statistics shape (read-only inputs of the backward op)."""
    return torch.zeros(shape, dtype=dtype, device=device), torch.ones(shape, dtype=dtype, device=device)


def layer_norm_fn(x, normalized_shape, weight, bias, eps, quant) -> torch.Tensor:
    """LayerNorm over the trailing ``normalized_shape`` dims of x (..., C). The output carries
    the packed x-hat (with weight and bias) for the next Mesa Linear to reuse."""
    # under torch.compile the packed x-hat comes out of the Function (dynamo keeps no Python
    # attributes on its nodes); in eager mode the Function's output carries it
    traced = compiling()
    shape = tuple(normalized_shape)
    dev = x.device.type
    if not torch.is_autocast_enabled(dev):
        cdt = x.dtype
        y = _LayerNorm.apply(x, shape, weight, bias, eps, quant, cdt, False, traced)
    else:
        amp = torch.get_autocast_dtype(dev)  # (what autocast would compute in)
        cdt = autocast_dtype("layer_norm", dev, amp, x.dtype) if x.is_floating_point() else x.dtype
        y = apply_without_autocast(dev, traced, _LayerNorm.apply, x, shape, weight, bias, eps, quant, cdt,
                                   amp == torch.float16, traced)
    if not traced:
        return y
    y, qx = output_copy(y, quant, cdt if cdt in _WIDE else torch.float32)
    if qx is None:
        return y
    return attach_saved(y, AffineQTensor(qx, *_cast_params(cdt, x, weight, bias)), quant.stochastic)


# fewer values per channel than this (batch x spatial size): a batch norm stores its input exactly
BN_MIN_PER_CHANNEL = 16


def _channel_stats(save_mean: torch.Tensor, save_invstd: torch.Tensor, dim: int):
    """A batch norm's (C,) batch mean and inverse std as float32 (1, C, 1, ...) for a ``dim``-D
    input (what every aten batch-norm kernel returns as save_mean / save_var: the inverse std)."""
    shape = (1, -1) + (1,) * (dim - 2)
    return save_mean.float().reshape(shape), save_invstd.float().reshape(shape)


class _BatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps, quant, cdt, amp16):
        xc = x.to(cdt)
        w, b = _cast_params(cdt, x, weight, bias)
        y, save_mean, save_var, reserve, impl = torch._batch_norm_impl_index(
            xc, w, b, running_mean, running_var, True, momentum, eps,
            torch.backends.cudnn.enabled)
        # stored: x-hat = (x - mean_c) * invstd_c, whose channels share one scale, not x: one range
        # over channels of very different scales (issue 35: 1e-2..1e1 gave a gradient error of 2x
        # to 7x) stores the narrow ones as a few levels, and backward divides that error by their
        # std. The training-mode backward reads the batch statistics only, not the running ones.
        # Few values per channel (a 1x1 map at batch 2: EfficientViT's last stage) make the
        # backward ill-conditioned: with M values gx is gy minus its projections on 1 and x-hat,
        # exactly ~0 at M = 2, so any error of x-hat is amplified (M = 2: a global gradient error
        # of 0.32 from one such layer). Such inputs are small: stored exactly.
        exact = xc.numel() < BN_MIN_PER_CHANNEL * xc.shape[1]
        stored = xc if exact else quant.quantize(xc, amp16, norm=_channel_stats(save_mean, save_var, x.dim()))
        save_for_backward(ctx, stored, w, save_mean, save_var, reserve)
        ctx.exact = exact
        ctx.mesa_name = quant.describe()
        ctx.impl, ctx.eps, ctx.x_dtype, ctx.cdt = impl, eps, x.dtype, cdt
        ctx.p_dtypes = (None if weight is None else weight.dtype, None if bias is None else bias.dtype)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, gy):
        xhat, w, save_mean, save_var, reserve = saved_tensors(ctx)
        if ctx.exact:
            xh = xhat
        else:
            mean, invstd = _channel_stats(save_mean, save_var, xhat.dim())
            # x as aten's kernel reads it, from the stored x-hat: its error is now relative to
            # each channel's own std, and the kernel's (x - mean) * invstd recovers the x-hat
            # (centred per channel as exact's x-hat is: see centre)
            xf = xhat.float()
            xf = xf - centre(xf, (0,) + tuple(range(2, xhat.dim())))
            xh = torch.addcdiv(mean, xf, invstd).to(ctx.cdt)
            release(xhat)
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
