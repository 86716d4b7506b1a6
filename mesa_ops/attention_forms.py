"""The attention forms :func:`mesa_ops.compress` converts in place (split from compress.py):
timm's attention modules routed to ``ms.SDPA`` (:class:`MesaAttentionMixin`), the explicit forms
whose q@k / softmax / attn@v are routed to Mesa ops (:class:`MesaExplicitAttentionMixin`), cosine
attention's normalizations and scales; :func:`_compress_attention` swaps a module's class and
adds its Mesa ops. ``mesa_ops.zoo`` builds torchvision's and transformers' forms on these."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from . import functional as MF
from . import layers as L
from .attention import QUANTIZERS, SDPA, head_layout


def _qualname(obj) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


# timm attention classes whose forward calls F.scaled_dot_product_attention on (B, H, N, D)
# q, k, v when ``fused_attn`` is set (qualified names, so timm is not imported here)
COMPRESSED_ATTENTION = (
    "timm.layers.attention.Attention",
    "timm.models.vision_transformer.Attention",
    "timm.models.swin_transformer.WindowAttention",
    "timm.models.pvt_v2.Attention",
    "timm.models.cait.ClassAttn",     # CaiT / XCiT class attention: one query, the class token
    "timm.models.xcit.XCA",           # cross-covariance attention: (B, H, C/H, N), l2-normalized q, k
    "timm.models.beit.Attention",     # BEiT: relative position bias as SDPA's mask
    "timm.models.eva.EvaAttention",   # EVA-02: rotary embedding on q, k before SDPA
)


# ---- attention -----------------------------------------------------------------------------
def _mesa_ops_of(module) -> tuple:
    ops = tuple(getattr(module, n) for n in ("sdpa", "mm1", "softmax", "mm2")
                if isinstance(getattr(module, n, None), (SDPA, L.MatMul, L.Softmax)))
    for n in ("mesa_mm", "mesa_softmax", "mesa_norm", "mesa_scale"):  # (the routed ops)
        ops += tuple(getattr(module, n, ()))
    return ops


def _any_enabled(*mods) -> bool:
    for m in mods:
        if isinstance(m, (L.Normalize, L.Scale)):
            qs = [m]
        else:
            qs = [getattr(m, q) for q in QUANTIZERS] if isinstance(m, SDPA) else [m.quant1, m.quant2]
        if any(bool(q.enable) for q in qs):
            return True
    return False


def _additive_mask(q, k, attn_mask, is_causal: bool):
    """A bool (True = attend) or causal mask as the additive float mask ms.SDPA takes."""
    if is_causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        causal = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill(~keep, float("-inf"))
        attn_mask = causal if attn_mask is None else _additive_mask(q, k, attn_mask, False) + causal
    elif attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device).masked_fill(
            ~attn_mask, float("-inf"))
    return attn_mask


def attention_core(mm1: L.MatMul, softmax: L.Softmax, mm2: L.MatMul, q, k, v, attn_mask=None,
                   dropout_p: float = 0.0, is_causal: bool = False, scale=None,
                   enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` as the explicit Mesa ops (timm's non-fused path, used
    when attention dropout is on, which the fused ms.SDPA does not offer):
    softmax(q * scale @ k^T + mask) @ v with q (B, H, N, D), k and v (B, H, M, D) -> (B, H, N, D)."""
    if enable_gqa and k.shape[-3] != q.shape[-3]:  # grouped-query heads: k, v repeated
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    attn = mm1(q * scale, k.transpose(-2, -1))
    mask = _additive_mask(q, k, attn_mask, is_causal)
    if mask is not None:
        attn = attn + mask
    attn = softmax(attn)
    if dropout_p > 0:
        attn = MF.dropout_fn(attn, dropout_p)  # (F.dropout's draws; a 1-bit mask kept)
    return mm2(attn, v)


# attention forms with cosine attention: qualified name -> (l2 normalizations of (B, H, ., .)
# tensors, products by a learned per-head scale), routed to ms.Normalize / ms.Scale in call order
COSINE_OPS = {
    "timm.models.xcit.XCA": (2, 1),                             # q, k; temperature
    "timm.models.swin_transformer_v2.WindowAttention": (2, 1),  # q, k; logit_scale.exp()
    "torchvision.models.swin_transformer.ShiftedWindowAttentionV2": (2, 1),
}
_MULS = (torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__)


def _route_cosine(mode, func, args, kwargs):
    """The result of ``func`` run by the owner's next ``mesa_norm`` / ``mesa_scale`` when it is
    an ``F.normalize`` / product by a per-head scale of a (B, H, ., .) tensor, or by a child Mesa
    Linear when it is ``F.linear`` with that layer's weight; None otherwise."""
    o = mode.owner
    if func is F.linear:  # Swin-V2's F.linear(x, self.qkv.weight, cat(q_bias, 0, v_bias))
        call = dict(zip(("input", "weight", "bias"), args), **kwargs)
        w = call.get("weight")
        for lin in o.children():
            if isinstance(lin, L.Linear) and w is lin.weight and w.requires_grad:
                if lin._active(call["input"], w, call.get("bias")):
                    return MF.linear_fn(call["input"], w, call.get("bias"), lin)
        return None
    norms, scales = getattr(o, "mesa_norm", ()), getattr(o, "mesa_scale", ())
    heads = getattr(o, "num_heads", None)
    if func is F.normalize and mode.norms < len(norms):
        names = ("input", "p", "dim", "eps", "out")
        call = dict(zip(names, args), **kwargs)
        x, m = call["input"], norms[mode.norms]
        if (x.dim() == 4 and x.shape[1] == heads and float(call.get("p", 2.0)) == 2.0
                and call.get("out") is None and call.get("dim", 1) % 4 == m.dim % 4
                and call.get("eps", 1e-12) == m.eps):
            mode.norms += 1
            return m(x)
    if func in _MULS and mode.scales < len(scales) and not kwargs and len(args) == 2:
        x, s = args
        if isinstance(s, torch.Tensor) and isinstance(x, torch.Tensor):
            if s.dim() == 4 and x.dim() < 4:
                x, s = s, x
            if (x.dim() == 4 and x.shape[1] == heads and s.numel() <= heads and s.requires_grad
                    and torch.broadcast_shapes(x.shape, s.shape) == x.shape):
                mode.scales += 1
                return scales[mode.scales - 1](x, s)
    return None


class _SDPAToMesa(TorchFunctionMode):
    """Routes the ``F.scaled_dot_product_attention`` call of one timm attention forward to its
    Mesa ops. With ms.SDPA the result is computed in the merged (B, N, H*D) layout, which carries
    the output's packed copy; timm's following ``x.transpose(1, 2).reshape(B, N, C)`` is given
    that very tensor back (same values, a view of the same storage), so the projection Linear
    stores the same bytes instead of a second copy. Every other torch function runs as it is."""

    def __init__(self, owner):
        super().__init__()
        self.owner, self.norms, self.scales = owner, 0, 0
        self.merged = None   # the (B, N, H*D) output of ms.SDPA
        self.handed = ()     # the views of it handed back to timm's code

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self._attend(*args, **kwargs)
        routed = _route_cosine(self, func, args, kwargs)
        if routed is not None:
            return routed
        out = func(*args, **kwargs)
        m = self.merged
        mine = m is not None and args and any(args[0] is h for h in self.handed)
        if mine and isinstance(out, torch.Tensor):
            if out.shape == m.shape and out.data_ptr() == m.data_ptr() and out.stride() == m.stride():
                return m  # x.transpose(1, 2).reshape(B, N, C): the tensor carrying the packed copy
            if out.data_ptr() == m.data_ptr():
                self.handed = self.handed + (out,)
        return out

    def _attend(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        o = self.owner
        sdpa = getattr(o, "sdpa", None)
        if sdpa is None:
            return attention_core(o.mm1, o.softmax, o.mm2, q, k, v, attn_mask, dropout_p, is_causal,
                                  scale, enable_gqa)
        if dropout_p > 0:
            raise NotImplementedError(f"mesa compress: {type(o).__name__} was compressed with the fused "
                                      "ms.SDPA (attention dropout 0 at compress time); attention dropout "
                                      f"{dropout_p} needs the explicit path: set attn_drop before compress")
        if enable_gqa and k.shape[-3] != q.shape[-3]:  # grouped-query heads: k, v repeated
            rep = q.shape[-3] // k.shape[-3]
            k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
        self.merged = sdpa(q, k, v, attn_mask=_additive_mask(q, k, attn_mask, is_causal), scale=scale,
                           merge_heads=True)
        y = head_layout(self.merged, q.shape[1])
        self.handed = (y,)
        return y


class MesaAttentionMixin:
    """Mixed in front of a timm attention class: timm's forward, a Mesa attention core when on
    (training, grad enabled, one of its quantizers enabled)."""

    def mesa_active(self) -> bool:
        return self.training and torch.is_grad_enabled() and _any_enabled(*_mesa_ops_of(self))

    def forward(self, *args, **kwargs):
        if not self.mesa_active():
            return super().forward(*args, **kwargs)
        if self._mesa_base == _WINDOW_ATTENTION and hasattr(self, "sdpa"):
            return _window_attention_forward(self, *args, **kwargs)
        fused = self.fused_attn
        self.fused_attn = True  # timm's forward then calls SDPA, which the mode routes to Mesa
        try:
            with _SDPAToMesa(self):
                return super().forward(*args, **kwargs)
        finally:
            self.fused_attn = fused


_WINDOW_ATTENTION = "timm.models.swin_transformer.WindowAttention"


def _window_attention_forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """timm 1.0's ``WindowAttention.forward`` (fused path) with ms.SDPA taking the relative
    position bias (1, H, N, N) and the shifted-window mask (W, N, N) apart, so that no
    (B*W, H, N, N) mask is built and stored. x: (B*W, N, C) -> (B*W, N, C)."""
    b_, n, _ = x.shape
    qkv = self.qkv(x).reshape(b_, n, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)
    x = self.sdpa(q, k, v, attn_mask=self._get_rel_pos_bias(), window_mask=mask, merge_heads=True)
    x = self.proj(x)
    return self.proj_drop(x)


# attention forms that spell q@k / softmax / attn@v out as tensor ops in their own forward:
# qualified name -> (how many 4-D head-wise matmuls, the dims of the softmaxes called as functions)
EXPLICIT_ATTENTION = {
    "timm.models.cait.TalkingHeadAttn": (2, (-1,)),              # CaiT: talking heads
    "timm.models.coat.FactorAttnConvRelPosEnc": (2, (2,)),       # CoaT: factorised attention
    "timm.models.swin_transformer_v2.WindowAttention": (2, ()),  # Swin-V2: cosine attention
    # torchvision's Swin V1 / V2: shifted_window_attention(x, self.qkv.weight, ...) spells q@k,
    # F.softmax and attn@v out; its F.linear calls with qkv / proj weights go to the Mesa Linears
    "torchvision.models.swin_transformer.ShiftedWindowAttention": (2, (-1,)),
    "torchvision.models.swin_transformer.ShiftedWindowAttentionV2": (2, (-1,)),
}
_MATMULS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)
_SOFTMAXES = (torch.softmax, torch.Tensor.softmax, F.softmax)


class _OpsToMesa(TorchFunctionMode):
    """Routes, in one forward of an explicit attention form, its i-th matmul of two (B, H, ., .)
    tensors to the Mesa ``mesa_mm[i]`` and its i-th functional softmax to ``mesa_softmax[i]`` (of
    the same dim), in call order; anything else (and a call beyond those) runs as it is."""

    def __init__(self, owner):
        super().__init__()
        self.owner, self.mm, self.sm, self.norms, self.scales = owner, 0, 0, 0, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        o = self.owner
        if func in _MATMULS and self.mm < len(o.mesa_mm) and not kwargs and len(args) == 2:
            a, b = args
            if a.dim() == 4 and b.dim() == 4 and a.shape[1] == b.shape[1] == o.num_heads:
                self.mm += 1
                return o.mesa_mm[self.mm - 1](a, b)
        if func in _SOFTMAXES and self.sm < len(getattr(o, "mesa_softmax", ())):
            x = args[0]
            dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
            sm = o.mesa_softmax[self.sm]
            if (dim is not None and x.dim() == 4 and x.shape[1] == o.num_heads
                    and dim % 4 == sm.dim % 4 and kwargs.get("dtype") is None and len(args) <= 2):
                self.sm += 1
                return sm(x)
        routed = _route_cosine(self, func, args, kwargs)
        return func(*args, **kwargs) if routed is None else routed


class MesaExplicitAttentionMixin(MesaAttentionMixin):
    """An explicit attention form (:data:`EXPLICIT_ATTENTION`): timm's own forward with its
    head-wise matmuls and softmaxes routed to Mesa ops while Mesa is on."""

    def forward(self, *args, **kwargs):
        if not self.mesa_active():
            return super(MesaAttentionMixin, self).forward(*args, **kwargs)
        with _OpsToMesa(self):
            return super(MesaAttentionMixin, self).forward(*args, **kwargs)


_SUBCLASSES: dict = {}


def _mesa_attention_class(cls: type, mixin: type | None = None) -> type:
    """A subclass of ``cls`` with ``mixin`` (default :class:`MesaAttentionMixin`, or, for an
    explicit form, :class:`MesaExplicitAttentionMixin`) first (cached per class)."""
    if cls not in _SUBCLASSES:
        if mixin is None:
            mixin = MesaExplicitAttentionMixin if _qualname(cls) in EXPLICIT_ATTENTION else MesaAttentionMixin
        _SUBCLASSES[cls] = type(f"Mesa{cls.__name__}", (mixin, cls),
                                {"__module__": __name__, "_mesa_base": _qualname(cls),
                                 "__doc__": f"{cls.__qualname__} with a Mesa attention core "
                                            "(mesa_ops.compress)."})
    return _SUBCLASSES[cls]


def _ref_tensor(module: nn.Module):
    return next(iter(list(module.parameters()) + list(module.buffers())), None)


def heads_of(m: nn.Module) -> int | None:
    """A module's head count: ``num_heads`` (timm, torchvision, GPT-2) or ``num_attention_heads``
    (transformers); None when it has neither."""
    for a in ("num_heads", "num_attention_heads"):
        h = getattr(m, a, None)
        if isinstance(h, int) and not isinstance(h, bool):
            return h
    return None


def _compress_attention(module: nn.Module, mixin: type | None = None, heads: int | None = None,
                        drop: float | None = None) -> None:
    """Swap ``module``'s class for its Mesa subclass (``mixin`` first) and give it head-wise Mesa
    attention ops: ``sdpa`` (ms.SDPA, the fused kernel) or, when its attention dropout ``drop``
    (timm's ``attn_drop.p`` by default) is on, ``mm1`` / ``softmax`` / ``mm2`` (the explicit
    path, which keeps the dropout mask)."""
    heads = int(module.num_heads if heads is None else heads)
    if drop is None:
        drop = getattr(getattr(module, "attn_drop", None), "p", 0.0)
    explicit = EXPLICIT_ATTENTION.get(_qualname(module))
    cosine = COSINE_OPS.get(_qualname(module))
    module.__class__ = _mesa_attention_class(type(module), mixin)
    if cosine is not None:  # (routed in either form's forward)
        module.mesa_norm = nn.ModuleList(L.Normalize(dim=-1, quant_groups=heads) for _ in range(cosine[0]))
        module.mesa_scale = nn.ModuleList(L.Scale(quant_groups=heads) for _ in range(cosine[1]))
    if explicit is not None:
        n_mm, dims = explicit
        module.mesa_mm = nn.ModuleList(L.MatMul(quant_groups=heads) for _ in range(n_mm))
        if dims:  # (none in Swin-V2: its nn.Softmax child is converted as a layer)
            module.mesa_softmax = nn.ModuleList(L.Softmax(dim=d, quant_groups=heads) for d in dims)
    elif drop > 0:
        module.mm1 = L.MatMul(quant_groups=heads)
        module.mm2 = L.MatMul(quant_groups=heads)
        module.softmax = L.Softmax(dim=-1, quant_groups=heads)  # Swin's nn.Softmax had no state
    else:
        module.sdpa = SDPA(quant_groups=heads)
    ref = _ref_tensor(module)
    for m in _mesa_ops_of(module):
        if ref is not None and ref.device.type != "meta":
            m.to(ref.device)
        m.train(module.training)


def _is_timm_attention(module) -> bool:
    return _qualname(module) in COMPRESSED_ATTENTION or _qualname(module) in EXPLICIT_ATTENTION
