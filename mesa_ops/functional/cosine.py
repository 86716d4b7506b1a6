"""The two ops cosine attention adds to q @ k^T: the l2 normalization of q and k (Swin-V2's
``F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)``; XCiT's cross-covariance
attention on (B, H, D, N)) and the product by a learned per-head scale (Swin-V2's clamped
``logit_scale.exp()`` of shape (H, 1, 1), XCiT's ``temperature``). Both run the plain op in the
forward (same bits); for backward they store a low-bit copy of one (B, H, ., .) tensor, head-wise
groups, as every Mesa layer does (Pan et al., Mesa, arXiv 2111.11124, Sec. 3.2).

* normalize: y = x / max(||x||, eps) along ``dim``; backward gx = (g - y <g, y>) / ||x|| where
  ||x|| > eps, g / eps elsewhere. Stored: y packed, and the row norms ||x|| (one float per row).
* scale: y = x * s with s broadcast over x; backward gx = g * s (exact: s is kept as it is) and
  gs = sum(g * x) over the broadcast dims. Stored: x packed, s.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..amp import fp16_autocast
from ..packed import release
from ..saved import once_differentiable, save_for_backward, saved_tensors


class _Normalize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, eps, quant, amp16):
        # (autocast is on here as outside: the same F.normalize, the same bits and dtype)
        y = F.normalize(x, 2.0, dim, eps)
        n = torch.linalg.vector_norm(x, 2, dim, keepdim=True, dtype=y.dtype)
        qy = quant.quantize(y, amp16)
        save_for_backward(ctx, qy, n)
        ctx.dim, ctx.eps, ctx.x_dtype = dim, eps, x.dtype
        ctx.mesa_name = quant.describe()
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, gy):
        yh, n = saved_tensors(ctx)
        g = gy.to(yh.dtype)
        inner = (g * yh).sum(ctx.dim, keepdim=True)
        # the rows at or below eps were divided by the constant eps: their y-term is absent
        gx = torch.where(n > ctx.eps, g - yh * inner, g) / n.clamp_min(ctx.eps)
        release(yh)
        return gx.to(ctx.x_dtype), None, None, None, None


def normalize_fn(x: torch.Tensor, dim: int, eps: float, quant) -> torch.Tensor:
    """``F.normalize(x, 2, dim, eps)``, storing its output packed and the row norms."""
    return _Normalize.apply(x, dim, eps, quant, fp16_autocast(x))


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, s, quant, amp16):
        y = x * s
        qx = quant.quantize(x, amp16) if ctx.needs_input_grad[1] else None
        save_for_backward(ctx, qx, s)
        ctx.x_dtype = x.dtype
        ctx.mesa_name = quant.describe()
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, gy):
        xh, s = saved_tensors(ctx)
        gx = (gy * s).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        gs = None
        if xh is not None:
            gs = (gy * xh.to(gy.dtype)).sum_to_size(s.shape).to(s.dtype)
            release(xh)
        return gx, gs, None, None


def scale_fn(x: torch.Tensor, s: torch.Tensor, quant) -> torch.Tensor:
    """``x * s`` for x (B, H, ., .) and a small s broadcast over it (same shape as the product),
    storing x packed (for s's gradient) and s."""
    return _Scale.apply(x, s, quant, fp16_autocast(x))


__all__ = ["normalize_fn", "scale_fn"]
