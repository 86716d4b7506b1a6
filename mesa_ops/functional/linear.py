"""Linear: saves the packed input and the weight as the forward used it: the parameter itself, or
under autocast its cast copy (as exact autocast keeps it for its backward: not recast there)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..amp import WIDE_DTYPES, apply_without_autocast, as_dtype, autocast_dtype
from ..backend import BACKEND_VAR, ENV, native_for
from ..packed import compiling, disarm, release
from ..saved import adopt_saved, graph_backward, save_for_backward, saved_tensors


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, quant, cdt, amp16, rec, traced=None):
        if traced is None:  # (linear_fn passes it: asked once per call there)
            traced = compiling()
        xc = x if x.dtype is cdt else x.to(cdt)
        # F.linear(x, w, b) (the same call, the same bits) as an output that is not a view: aten
        # returns the addmm of the flattened rows of a 3-D or larger input as a view of it, and a
        # custom Function's output that is a view may not be modified in place (an
        # nn.ReLU(inplace=True) after the layer raised "Output 0 of _Linear is a view and is being
        # modified inplace"). ``detach`` makes a tensor of its own over the same memory, no copy
        wc = weight if weight.dtype is cdt else weight.to(cdt)
        y = F.linear(xc, wc, bias if bias is None or bias.dtype is cdt else bias.to(cdt)).detach()
        # the packed output of a Mesa SDPA, the packed x-hat of a Mesa LayerNorm or the packed
        # input of a Mesa GELU (stored once) when it is what quant would store; the x-hat and
        # the SDPA output this backward restores are then handed on to those layers' backwards
        qx = None if rec is None else adopt_saved(ctx, x, quant, dtype=xc.dtype, derived=True, rec=rec)
        if qx is None:
            qx = quant.quantize(xc, amp16, None, traced)
        save_for_backward(ctx, qx, wc, traced=traced)
        ctx.mesa_name = quant  # (described only for an error message)
        ctx.cdt, ctx.x_dtype, ctx.has_bias, ctx.traced = cdt, x.dtype, bias is not None, traced
        ctx.w_dtype = weight.dtype
        ctx.b_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, gy):  # (once_differentiable, spelt out: saved.once_differentiable)
        if torch.is_grad_enabled():
            return graph_backward(_Linear.backward, ctx, gy)
        try:
            xh, weight = saved_tensors(ctx, True, 0, ctx.traced)
            need = ctx.needs_input_grad
            affine = type(xh) is tuple  # (x-hat, a, c) of a LayerNorm's output
            x, a, c = xh if affine else (xh, None, None)
            native = None if ctx.traced else native_for(ENV.get(BACKEND_VAR), gy.is_cuda)
            gx, gw, gb = (linear_grads if native is None else native.linear_backward)(
                gy, x, weight, affine, a, c, need[0], need[1], ctx.has_bias and need[2], ctx.cdt, ctx.x_dtype,
                ctx.w_dtype, ctx.b_dtype)
            if getattr(x, "_mesa_ws", None) is not None:  # (a workspace buffer: given back)
                release(x)
            return gx, gw, gb, None, None, None, None, None
        except BaseException:
            disarm()  # (the engine drops its callbacks: the workspace would stay held)
            raise


def linear_grads(gy, x, weight, affine: bool, a, c, need_x: bool, need_w: bool, need_b: bool, cdt, x_dtype,
                 w_dtype, b_dtype):
    """(gx, gw, gb) of y = x W^T + b for the output gradient ``gy`` (..., out) from the stored
    input ``x`` (..., in) restored, or with ``affine`` its LayerNorm's x-hat with x = x-hat * a
    + c (``a``, ``c``: (in,) or None), and the weight as the forward used it (``weight``; the
    parameter's dtype ``w_dtype``); None where not needed. The specification of the
    extension's ``linear_backward`` (cuda/layer_grads.cpp: the same ops in one native call),
    and what runs while torch.compile traces."""
    g = as_dtype(gy, cdt)
    gx = gw = gb = gsum = None
    g2 = g.reshape(-1, g.shape[-1])  # (tokens, out): mm on 2-D views, as addmm's backward
    if need_x:
        gx = g2.mm(as_dtype(weight, cdt))
        gx = as_dtype(gx.view(*g.shape[:-1], gx.shape[-1]), x_dtype)
    if need_b:
        # (aten's sum: bits that do not depend on the thread count, unlike a BLAS ones @ g2,
        # which splits its sum across threads on AVX-512 machines: tests/test_determinism.py)
        gsum = g2.sum(0)
    if need_w:
        if affine and g2.shape[0] < g2.shape[1]:  # fewer tokens than outputs (small batches):
            # x = x-hat * a + c restored (tokens x in) costs less than the fold's two passes
            # over the (out x in) gradient below
            gw = _gw(g2, _affine(x, a, c, cdt), cdt)
        elif affine:  # x = x-hat * a + c along its last dim (a LayerNorm's output):
            # gW = (g^T x-hat) * a + outer(sum g, c), no token-sized restore of x
            gw = _gw(g2, x, cdt)
            if gw.dtype not in WIDE_DTYPES:  # the fold in float32
                gw = gw.float()
            if a is not None:
                gw = gw.mul_(as_dtype(a, gw.dtype))
            if c is not None:
                gsum = g2.sum(0) if gsum is None else gsum
                gw = gw.addr_(as_dtype(gsum, gw.dtype), as_dtype(c, gw.dtype))
        else:
            gw = _gw(g2, x, cdt)
        gw = as_dtype(gw, w_dtype)
    if need_b:
        gb = as_dtype(gsum, b_dtype)
    return gx, gw, gb


def _affine(xh, a, c, dtype):
    """x-hat * a + c along the last dim as a new tensor of ``dtype`` (the Linear's compute
    dtype; ``xh`` may be shared with the LayerNorm's backward: never modified): one op, computed
    in x-hat's dtype (float32 or wider) and rounded once to ``dtype`` (issue 36: one launch where
    the product, the sum and the cast were three)."""
    if a is None and c is None:
        return as_dtype(xh, dtype)
    out = torch.empty(xh.shape, dtype=dtype, device=xh.device)
    if c is None:
        return torch.mul(xh, as_dtype(a, xh.dtype), out=out)
    if a is None:
        return torch.add(xh, as_dtype(c, xh.dtype), out=out)
    return torch.addcmul(as_dtype(c, xh.dtype), xh, as_dtype(a, xh.dtype), out=out)


def _gw(g2, x, cdt):
    """g2^T x for g2 (tokens, out) and x (..., in): (out, in). On the CPU for few outputs (a
    classifier head) as (x^T g2)^T: the BLAS splits the token sum of a thin g2^T x across threads, so its
    last bits changed with the thread count (and stochastic rounding amplified them); the other
    orientation and wide outputs were the same for 1 and 2 threads (tests/test_determinism.py)."""
    x2 = as_dtype(x.reshape(-1, x.shape[-1]), cdt)
    if g2.shape[1] < _THIN_OUT and g2.device.type == "cpu":
        return x2.t().mm(g2).t().contiguous()
    return g2.t().mm(x2)


_THIN_OUT = 64  # output features below which _gw takes the (x^T g)^T orientation


def linear_fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, quant) -> torch.Tensor:
    """y = x W^T + b for x (..., in) -> (..., out); stores x at ``quant.bits`` bits."""
    traced = compiling()
    rec = getattr(x, "_mesa_saved", None)  # (the packed copy another layer attached to x)
    dev = x.device.type
    if not torch.is_autocast_enabled(dev):
        return _Linear.apply(x, weight, bias, quant, x.dtype, False, rec, traced)
    amp = torch.get_autocast_dtype(dev)  # (what autocast would compute in)
    cdt = autocast_dtype("linear", dev, amp, x.dtype) if x.is_floating_point() else x.dtype
    return apply_without_autocast(dev, traced, _Linear.apply, x, weight, bias, quant, cdt, amp == torch.float16,
                                  rec, traced)
