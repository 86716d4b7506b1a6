"""Attention of the other model zoos under :func:`mesa_ops.compress` (issue 49).

* ``nn.MultiheadAttention`` (torchvision's ViT, and any model built on it): its class is swapped
  for a subclass whose training forward, while Mesa is on, runs the in-projection through a Mesa
  :class:`~mesa_ops.layers.LinearFn` (``mesa_in_proj``: the input stored packed, head-wise groups;
  self-attention projects q, k, v in one call), attention through ``ms.SDPA`` (q, k, v and the
  output packed head-wise; or, with attention dropout, the explicit ``mm1`` / ``softmax`` /
  ``mm2``), and ``out_proj`` as a Mesa Linear that reuses SDPA's packed output. Batch-first or
  not, unbatched inputs, boolean or float ``attn_mask`` ((L, S) or (B * H, L, S)) and
  ``key_padding_mask`` ((B, S)), ``is_causal``. What Mesa cannot store this way runs PyTorch's
  own forward and says so once (a warning naming the module and why): ``need_weights=True``
  (the averaged attention weights are returned, which the fused path never forms: pass
  ``need_weights=False``, as torchvision's ViT does), ``add_bias_kv``, ``add_zero_attn``, and
  key / value widths other than ``embed_dim``.
* Hugging Face transformers' attention modules: every module whose forward calls transformers'
  attention-function registry (``ALL_ATTENTION_FUNCTIONS``: ViT, DeiT, Dinov2, BEiT, Swin, BERT,
  GPT-2, CLIP, Segformer, ... encoder, decoder and cross attention). While Mesa is on, its
  forward runs with the registry's ``sdpa`` function (whatever the model's
  ``_attn_implementation``, read through a view of its config for that call only), whose
  ``F.scaled_dot_product_attention`` is routed to ``ms.SDPA`` (or the explicit ops when the
  attention dropout is on) as for timm's modules: masks (boolean, additive, causal, a relative
  position bias with its gradient), scaling and grouped-query heads (k, v repeated) included.
  ``output_attentions`` runs the module's own forward (exact) and says so once.
"""
from __future__ import annotations

import inspect
import warnings

import torch
import torch.nn as nn

from . import layers as L
from .attention_forms import (MesaAttentionMixin, _SDPAToMesa, _any_enabled, _compress_attention, _mesa_ops_of,
                              _ref_tensor, attention_core, heads_of)
from .functional.attention import token_layout

__all__ = ["compress_zoo_attention", "is_hf_attention"]


def is_hf_attention(m: nn.Module) -> bool:
    """A transformers attention module: its forward calls the attention-function registry."""
    f = getattr(type(m), "forward", None)
    code = getattr(inspect.unwrap(f), "__code__", None) if f is not None else None  # (decorated)
    return code is not None and "ALL_ATTENTION_FUNCTIONS" in code.co_names and heads_of(m) is not None


def _dropout_of(m: nn.Module) -> float:
    """The attention-probability dropout a transformers module passes to its attention: the
    largest its own attributes name, else its config's (a miss would make the fused path refuse
    it in the first training step)."""
    found = []
    for a in ("attention_dropout", "attn_dropout", "dropout", "dropout_p", "dropout_prob", "attn_drop",
              "attention_probs_dropout_prob"):
        v = getattr(m, a, None)
        if isinstance(v, nn.Dropout):
            found.append(float(v.p))
        elif isinstance(v, float):
            found.append(v)
    if not found:
        cfg = getattr(m, "config", None)
        found = [v for v in (getattr(cfg, a, None) for a in ("attention_probs_dropout_prob", "attention_dropout",
                                                            "attn_pdrop")) if isinstance(v, float)]
    return max(found, default=0.0)


_NOTED: set = set()


def _note_exact(module: nn.Module, why: str) -> None:
    """Warn once per (module, reason) that a training forward ran exact, and why."""
    key = (id(module), why)
    if key not in _NOTED:
        _NOTED.add(key)
        ops = [m for m in module.children() if isinstance(m, L.MESA_LAYERS)]
        name = getattr(ops[0], "layer_name", None) if ops else None
        where = name.rsplit(".", 1)[0] if name and "." in name else type(module).__name__
        warnings.warn(f"mesa: {where} ({type(module).__name__}) ran its attention exact: {why}",
                      stacklevel=3)


# ---- nn.MultiheadAttention -------------------------------------------------------------------
def _float_mask(m: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """nn.MultiheadAttention's mask convention (bool: True = not attended) as an additive mask."""
    if m is None or m.is_floating_point():
        return None if m is None else m.to(dtype)
    return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(m, float("-inf"))


class MesaMultiheadAttentionMixin(MesaAttentionMixin):
    """In front of ``nn.MultiheadAttention``: see the module docstring."""

    def mesa_active(self) -> bool:
        return self.training and torch.is_grad_enabled() and (
            _any_enabled(*_mesa_ops_of(self)) or self.mesa_in_proj.enable or bool(self.out_proj.enable))

    def _exact_reason(self, query, need_weights, attn_mask, is_causal) -> str | None:
        if need_weights:
            return ("need_weights=True returns the attention weights, which Mesa's fused attention "
                    "never forms (pass need_weights=False)")
        if self.bias_k is not None or self.add_zero_attn:
            return "add_bias_kv / add_zero_attn have no Mesa path"
        if not self._qkv_same_embed_dim:
            return "kdim / vdim other than embed_dim have no Mesa path"
        if query.dim() not in (2, 3) or query.is_nested:
            return f"a {query.dim()}-D {'nested ' if query.is_nested else ''}query has no Mesa path"
        if is_causal and attn_mask is None:
            return "is_causal without attn_mask (PyTorch's forward raises)"
        return None

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        args = (query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
                is_causal)
        base = super(MesaAttentionMixin, self).forward
        if not self.mesa_active():
            return base(*args)
        why = self._exact_reason(query, need_weights, attn_mask, is_causal)
        if why is not None:
            _note_exact(self, why)
            return base(*args)
        return self._mesa_forward(query, key, value, key_padding_mask, attn_mask), None

    def _mesa_forward(self, query, key, value, key_padding_mask, attn_mask):
        """(L, E) / (L, B, E) / (B, L, E) in, the same layout out (the attention output only)."""
        unbatched = query.dim() == 2
        self_attn, same_kv = query is key and key is value, key is value

        def batch_first(t):
            return t.unsqueeze(0) if unbatched else (t if self.batch_first else t.transpose(0, 1))

        xq = batch_first(query)
        xk = xq if query is key else batch_first(key)
        xv = xk if same_kv else batch_first(value)
        E, H = self.embed_dim, self.num_heads
        w, b, lin = self.in_proj_weight, self.in_proj_bias, self.mesa_in_proj
        if self_attn:
            q, k, v = lin(xq, w, b).chunk(3, dim=-1)
        else:
            bq, bk, bv = (None, None, None) if b is None else b.chunk(3)
            q = lin(xq, w[:E], bq)
            if same_kv:
                k, v = lin(xk, w[E:], None if b is None else b[E:]).chunk(2, dim=-1)
            else:
                k, v = lin(xk, w[E:2 * E], bk), lin(xv, w[2 * E:], bv)
        B, N, S = xq.shape[0], xq.shape[1], xk.shape[1]
        q, k, v = (t.reshape(B, t.shape[1], H, E // H).transpose(1, 2) for t in (q, k, v))
        mask = _float_mask(attn_mask, q.dtype)
        if mask is not None and mask.dim() == 3:
            mask = mask.view(B, H, N, S)
        pad = _float_mask(key_padding_mask, q.dtype)
        if pad is not None:
            pad = pad.view(B, 1, 1, S)
            mask = pad if mask is None else mask + pad
        drop = self.dropout if self.training else 0.0
        if hasattr(self, "sdpa"):
            if drop > 0:
                raise NotImplementedError(f"mesa compress: this MultiheadAttention was compressed with the "
                                          f"fused ms.SDPA (dropout 0 at compress time); dropout {drop} "
                                          "needs the explicit path: set dropout before compress")
            out = self.sdpa(q, k, v, attn_mask=mask, merge_heads=True)   # (B, N, E), packed copy
        else:
            out = token_layout(attention_core(self.mm1, self.softmax, self.mm2, q, k, v, mask, drop))
        y = self.out_proj(out)
        if unbatched:
            return y.squeeze(0)
        return y if self.batch_first else y.transpose(0, 1)


# ---- transformers ----------------------------------------------------------------------------
class _SdpaConfig:
    """A model config read as it is except ``_attn_implementation`` ('sdpa')."""
    _attn_implementation = "sdpa"

    def __init__(self, config):
        object.__setattr__(self, "_config", config)

    def __getattr__(self, name):
        return getattr(self._config, name)


class MesaHFAttentionMixin(MesaAttentionMixin):
    """In front of a transformers attention module: see the module docstring."""

    def forward(self, *args, **kwargs):
        base = super(MesaAttentionMixin, self).forward
        if not self.mesa_active():
            return base(*args, **kwargs)
        config = self.__dict__.get("config")
        if kwargs.get("output_attentions") or getattr(config, "output_attentions", False):
            _note_exact(self, "output_attentions asks for the attention weights, which Mesa's fused "
                              "attention never forms")
            return base(*args, **kwargs)
        swap = config is not None and getattr(config, "_attn_implementation", "sdpa") != "sdpa"
        if swap:
            self.__dict__["config"] = _SdpaConfig(config)
        try:
            with _SDPAToMesa(self):
                return base(*args, **kwargs)
        finally:
            if swap:
                self.__dict__["config"] = config


def compress_zoo_attention(m: nn.Module, hf_sdpa: bool = True) -> bool:
    """Compress ``m`` if it is an ``nn.MultiheadAttention`` or a transformers attention module
    (class swapped in place, Mesa ops added); returns whether it was one. A transformers module
    is taken only on the eager or sdpa implementation, eager only where the model supports sdpa
    (``hf_sdpa``: its ``_supports_sdpa``): flash / flex attention prepare masks of their own, and a
    model without sdpa may pass what sdpa ignores; left alone it is listed as exact."""
    if isinstance(m, MesaAttentionMixin):
        return False
    if isinstance(m, nn.MultiheadAttention):
        _compress_attention(m, MesaMultiheadAttentionMixin, m.num_heads, float(m.dropout))
        m.mesa_in_proj = L.LinearFn(m.embed_dim, quant_groups=m.num_heads)
        ref = _ref_tensor(m)
        if ref is not None and ref.device.type != "meta":
            m.mesa_in_proj.to(ref.device)
        m.mesa_in_proj.train(m.training)
        return True
    if is_hf_attention(m):
        impl = getattr(getattr(m, "config", None), "_attn_implementation", None) or "sdpa"
        if impl not in ("sdpa", "eager") or (impl == "eager" and not hf_sdpa):
            return False
        _compress_attention(m, MesaHFAttentionMixin, heads_of(m), _dropout_of(m))
        return True
    return False
