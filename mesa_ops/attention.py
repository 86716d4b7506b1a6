"""``SDPA``: Mesa attention on PyTorch's fused scaled-dot-product attention kernels.

The paper (Pan et al., arXiv 2111.11124) compresses attention as three layers -- q @ k^T,
softmax, attn @ v -- and so stores the N x M attention matrix (at 8 bits). Exact training with
PyTorch's fused SDPA keeps no such matrix, only q, k, v, the output and the logsumexp. ``SDPA``
combines the two: the forward is the fused kernel PyTorch would run (bit-identical output), and
backward keeps q, k, v and the output packed by four quantizers (head-wise groups) plus the fp32
logsumexp (at 8 bits under range_mode 'union'; below 8 bits or under 'ema' the backward reruns the
forward on the stored q, k, v instead: ``consistent_backward``); see
:mod:`mesa_ops.functional.attention`.

State dict: ``quant_q.*``, ``quant_k.*``, ``quant_v.*``, ``quant_o.*`` (each ``clip_val``,
``shift``, ``iteration`` with one entry per head). Policy tag ``attention`` (``on attention:``
in a policy file); the settings apply to the four quantizers, and a quantizer turned off on its
own (``sdpa.quant_k.enable = False``) stores its tensor exactly.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .functional.attention import head_layout, sdpa_fn, token_layout
from .quant import Quantizer, update_quantization_parameter

__all__ = ["SDPA", "QUANTIZERS"]
QUANTIZERS = ("quant_q", "quant_k", "quant_v", "quant_o")
_PROXIED = ("enable", "bits", "level", "ema_decay", "quant_groups", "stochastic", "range_mode",
            "check_finite", "index", "group_size", "layer_name")


def _proxy(name):
    def get(self):
        return getattr(self.quant_q, name)

    def set_(self, value):
        for q in QUANTIZERS:
            setattr(getattr(self, q), name, value)
    return property(get, set_)


class SDPA(nn.Module):
    """``F.scaled_dot_product_attention`` as a Mesa layer (no parameters).

    Args (the Mesa layers' signature): ``quant_groups`` = number of heads (one group per head),
    ``bits`` 8 / 4 / 2, ``enable`` / ``mesa`` to switch compression on.

    ``forward(q, k, v, attn_mask=None, scale=None, window_mask=None, merge_heads=False)``:
    q (B, H, N, D), k and v (B, H, M, D); ``attn_mask`` an additive float mask broadcastable to
    (B, H, N, M) (it may need a gradient, e.g. a relative position bias); ``window_mask`` (W, N, M)
    added to batch item b's scores for window b % W (B a multiple of W). Returns (B, H, N, D), or
    (B, N, H * D) with ``merge_heads`` (then the following Mesa Linear reuses the packed output).
    Compression acts in training mode when a gradient is needed; otherwise this is exactly
    ``F.scaled_dot_product_attention`` (the window mask passed as the models do: 5-D inputs).
    Attention dropout is not offered: the fused kernels cannot give back the dropout mask for a
    compressed backward (the models use the explicit path when ``attn_drop > 0``).
    """

    tag = "attention"
    __jit_unused_properties__ = list(_PROXIED)  # Python-side settings (see mesa_ops.quant)
    # backward of the fused kernels: rerun the forward on the stored (dequantized) q, k, v for
    # its softmax statistics (True: the exact gradient at the stored inputs, one more attention
    # forward per step) or use the forward's logsumexp (False); None (auto, the default): rerun
    # where the forward's logsumexp is far from the stored q, k's, i.e. where a quantizer of q, k,
    # v clips to its running range (range_mode 'ema': a bias) or stores fewer than 8 bits (P =
    # exp(q~ k~^T s - lse) then strays from summing to one: 2-bit training diverges), not at 8
    # bits under 'union' (issue 20, docs/fidelity.md). A class default: also the setting of
    # modules pickled whole before it existed
    consistent_backward: Optional[bool] = None

    def __init__(self, mesa=False, args=None, logger=None, quant_groups=1, bits=8, enable=False):
        super().__init__()
        on = bool(mesa or enable)
        for name in QUANTIZERS:
            setattr(self, name, Quantizer(quant_groups, tag=f"attention-{name[-1]}", enable=on, bits=bits))

    def reruns_forward(self) -> bool:
        """Whether the fused kernels' backward reruns the forward (see ``consistent_backward``):
        never when q, k and v are all stored exactly (the forward's logsumexp is theirs). (Asked
        once per forward: the quantizers read from ``_modules``, no generator.)"""
        m = self._modules
        q, k, v = m["quant_q"], m["quant_k"], m["quant_v"]
        if self.consistent_backward is not None:
            return bool(self.consistent_backward) and (q.enable or k.enable or v.enable)
        return ((q.enable and (q.range_mode == "ema" or q._bits < 8))
                or (k.enable and (k.range_mode == "ema" or k._bits < 8))
                or (v.enable and (v.range_mode == "ema" or v._bits < 8)))

    def update_quantization_parameter(self, **parameters):
        return update_quantization_parameter(self, **parameters)

    def describe(self) -> str:
        name = getattr(self, "layer_name", None)
        return f"SDPA{f' {name!r}' if name else ''} (tag=attention)"

    def _resize_groups(self, g: int) -> None:
        for q in QUANTIZERS:
            getattr(self, q)._resize_groups(g)

    def extra_repr(self) -> str:
        return (f"enable={self.enable}, bits={self.bits}, quant_groups={self.quant_groups}, "
                f"index={self.index}")

    def active(self, *tensors) -> bool:
        """Whether a forward on ``tensors`` would compress (training, a quantizer on, grad needed)."""
        if not (self.training and torch.is_grad_enabled()):
            return False
        m = self._modules
        if not (m["quant_q"].enable or m["quant_k"].enable or m["quant_v"].enable or m["quant_o"].enable):
            return False
        for t in tensors:
            if t is not None and t.requires_grad:
                return True
        return False

    def forward(self, q, k, v, attn_mask: Optional[torch.Tensor] = None, scale: Optional[float] = None,
                window_mask: Optional[torch.Tensor] = None, merge_heads: bool = False):
        if not torch.jit.is_scripting():  # TorchScript (eval): the exact op
            if self.active(q, k, v, attn_mask):
                return sdpa_fn(q, k, v, attn_mask, window_mask, scale, self, merge=merge_heads)
        out = exact_sdpa(q, k, v, attn_mask, window_mask, scale)
        return token_layout(out) if merge_heads else out


for _n in _PROXIED:
    setattr(SDPA, _n, _proxy(_n))


def exact_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor] = None,
               window_mask: Optional[torch.Tensor] = None, scale: Optional[float] = None,
               dropout_p: float = 0.) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with the models' mask conventions (see :class:`SDPA`):
    with ``window_mask`` (W, N, M) the inputs go in as (B // W, W, H, L, D), the mask as
    (W, H, N, M) = window_mask + bias (bias (H, N, M) or (1, H, N, M)). Returns (B, H, N, D).
    TorchScript-compilable and FX-traceable (no Python branch on a tensor size)."""
    B, H, N, D = q.shape
    if window_mask is None:
        am = None if bias is None else bias.to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=am, dropout_p=dropout_p, scale=scale)
    W = window_mask.shape[0]
    torch._assert(B % W == 0, "exact_sdpa: the batch is not a multiple of the windows of window_mask")
    am = window_mask.unsqueeze(1)
    if bias is not None:  # as functional.attention.build_mask, without a branch on bias.dim()
        am = bias.reshape(-1, N, k.shape[2]).unsqueeze(0) + am
    am = am.to(q.dtype)
    M, Dv = k.shape[2], v.shape[3]
    out = F.scaled_dot_product_attention(
        q.reshape(B // W, W, H, N, D), k.reshape(B // W, W, H, M, D),
        v.reshape(B // W, W, H, M, Dv), attn_mask=am, dropout_p=dropout_p, scale=scale)
    return out.reshape(B, H, N, Dv)


__all__ += ["exact_sdpa", "head_layout", "token_layout"]
