"""MatMul of (a, b) (q @ k^T and attn @ v): saves both inputs packed, each with its own quantizer
(``quant1`` for a, ``quant2`` for b; head-wise groups along dim 1 of (B, H, N, D)). When ``a`` is
the output of a Mesa Softmax, its packed copy is reused: the tensor is stored once."""
from __future__ import annotations

import torch

from ..amp import compute_dtype, fp16_autocast, no_autocast
from ..packed import release
from ..saved import find_saved, once_differentiable, save_for_backward, saved_record, saved_tensors


def _exact(t: torch.Tensor) -> torch.Tensor:
    """``t`` saved exactly (its quantizer off): a compact copy when it is a view into a larger
    buffer (k or v of a fused qkv output), which would otherwise keep the whole buffer alive."""
    if t.untyped_storage().nbytes() > t.numel() * t.element_size():
        return t.clone(memory_format=torch.contiguous_format)
    return t


class _MatMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, quant1, quant2, cdt, amp16, rec):
        ac, bc = a.to(cdt), b.to(cdt)
        y = torch.matmul(ac, bc)
        # a softmax output already packed the same way is stored once -- also when quant1 is off
        # (a policy enabling only softmax-1): an exact copy besides it would store more than exact
        qa = None if rec is None else find_saved(a, quant1, rec=rec)  # (backward casts it to cdt)
        if qa is None:
            qa = quant1.quantize(ac, amp16) if quant1.enable else _exact(ac)
        save_for_backward(ctx, qa, quant2.quantize(bc, amp16) if quant2.enable else _exact(bc))
        ctx.mesa_name = quant1.describe()
        ctx.shapes, ctx.dtypes, ctx.cdt = (a.shape, b.shape), (a.dtype, b.dtype), cdt
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, gy):
        ah, bh = saved_tensors(ctx)
        g = gy.to(ctx.cdt)
        ga = gb = None
        if ctx.needs_input_grad[0]:
            ga = g.matmul(bh.to(ctx.cdt).transpose(-2, -1)).sum_to_size(ctx.shapes[0]).to(ctx.dtypes[0])
        if ctx.needs_input_grad[1]:
            gb = ah.to(ctx.cdt).transpose(-2, -1).matmul(g).sum_to_size(ctx.shapes[1]).to(ctx.dtypes[1])
        release(ah, bh)
        return ga, gb, None, None, None, None, None


def matmul_fn(a: torch.Tensor, b: torch.Tensor, quant1, quant2) -> torch.Tensor:
    """torch.matmul(a, b) for a (..., n, k), b (..., k, m) (batch dims broadcast)."""
    if a.dim() < 2 or b.dim() < 2:
        raise ValueError(f"mesa MatMul needs inputs of at least 2 dims, got {tuple(a.shape)} @ "
                         f"{tuple(b.shape)}")
    cdt = compute_dtype("matmul", a)
    amp16 = fp16_autocast(a)  # read before autocast is switched off
    with no_autocast(a):
        return _MatMul.apply(a, b, quant1, quant2, cdt, amp16, saved_record(a))
