"""Mesa for a model you did not write: ``mesa_ops.compress(model, policy='mesa8')``.

Converts a stock model (tested: timm's ViT / DeiT, Swin, PVT-v2, and CaiT, XCiT, CoaT, Swin-V2,
EfficientViT) in place, without editing
its code (Pan et al., Mesa, arXiv 2111.11124, Sec. 3-4):

* ``nn.Linear``, ``nn.Conv2d``, ``nn.LayerNorm`` (and timm's ``LayerNorm``), ``nn.BatchNorm2d``,
  ``nn.GELU``, ``nn.Softmax``, ``nn.ReLU`` become Mesa layers through the conversion of
  :mod:`mesa_ops.policy` (same parameter and buffer objects); timm's functional ``GELU`` /
  ``GELUTanh`` modules (``F.gelu`` inside a module) become :class:`mesa_ops.GELU`.
* timm's attention modules (``timm.layers.Attention``, Swin's ``WindowAttention``, PVT-v2's
  ``Attention``) get their functional core compressed: their class is swapped for a subclass
  that runs timm's own ``forward`` and, while Mesa is on (training, grad enabled, one of its
  quantizers enabled), routes ``F.scaled_dot_product_attention`` to the explicit Mesa ops
  ``mm1`` (q @ k^T), ``softmax``, ``mm2`` (attn @ v), each with one group per head (the paper's
  head-wise quantization). Parameter names are kept; the only new state-dict keys are the
  quantizers' (``attn.mm1.quant1.clip_val`` etc., the original Mesa names). Eval mode, and
  training with Mesa off, run timm's forward untouched. CaiT / XCiT class attention and XCiT's
  cross-covariance attention (``XCA``) take the same route.
* attention forms that spell their ops out (:data:`EXPLICIT_ATTENTION`: CaiT's talking heads,
  CoaT's factorised attention, Swin-V2's cosine attention) run timm's forward with their
  head-wise matmuls and softmaxes routed to Mesa ``mesa_mm[i]`` / ``mesa_softmax[i]``; cosine
  attention (:data:`COSINE_OPS`: Swin-V2, XCA) also gets its l2 normalizations of q and k and
  its per-head logit scale / temperature product routed to ``mesa_norm[i]`` (ms.Normalize) and
  ``mesa_scale[i]`` (ms.Scale), and Swin-V2's ``F.linear(x, qkv.weight, ...)`` to its Mesa qkv.
* Groups: ``quant_groups='heads'`` gives the layers inside a block containing an attention
  module one group per head of that block (as this repo's models do); elsewhere one group.

A layer that saves activations for backward but has no Mesa counterpart is listed in the
returned :class:`CompressReport` (and in a warning), never silently skipped; pass
``example_inputs`` to also run :func:`mesa_ops.audit.audit` and list every module whose saved
tensors stay uncompressed.
"""
from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from . import functional as MF
from . import layers as L
from .adapters import convert_lora_layers
from .attention import QUANTIZERS, SDPA, head_layout
from .quant import QuantMixin
from .policy import (PolicyError, convert_by_num_groups, deploy_on_init, mark_prefix_tokens,
                     mesa_layers, set_mesa)

__all__ = ["compress", "CompressReport", "NAMED_POLICIES", "COMPRESSED_ATTENTION", "EXPLICIT_ATTENTION",
           "COSINE_OPS", "attention_core"]

NAMED_POLICIES = {"mesa8": 8, "mesa4": 4, "mesa2": 2}
# tags a named policy enables: the paper's Transformer ops plus the conv-net layers (the first
# conv, which reads the image the caller holds anyway, stays exact: see configs/mesa/pvt_8bit.txt)
POLICY_TAGS = ("fc", "matmul", "gelu", "layernorm", "softmax", "attention", "conv", "bn", "relu",
               "normalize", "scale")

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
# timm modules computing F.gelu(x) / F.gelu(x, approximate='tanh') and nothing else
_GELU_MODULES = {"timm.layers.activations.GELU": "none", "timm.layers.activations.GELUTanh": "tanh"}
# leaf modules that save nothing for backward (or only per-sample scalars)
_SAVE_NOTHING = (nn.Identity, nn.Flatten, nn.Unflatten, nn.Unfold,
                 # containers without a forward of their own (peft's empty lora_embedding_A, ...)
                 nn.ModuleDict, nn.ModuleList, nn.ParameterDict, nn.ParameterList, nn.Sequential)
_SAVE_NOTHING_NAMES = ("timm.layers.drop.DropPath", "timm.layers.adaptive_avgmax_pool.FastAdaptiveAvgPool",
                       "timm.layers.format.Format",
                       # mmcv / mmseg (MesaCompressed): per-sample drop-path scalars; F.pad
                       "mmcv.cnn.bricks.drop.DropPath", "mmseg.models.utils.embed.AdaptivePadding")


def _qualname(obj) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclass
class CompressReport:
    """What :func:`compress` did. ``unsupported``: (module name, class, why) of the modules that
    save activations for backward exactly because Mesa has no counterpart for them."""
    converted: dict = field(default_factory=dict)      # Mesa layer class -> count
    attention: list = field(default_factory=list)      # names of the compressed attention modules
    unsupported: list = field(default_factory=list)    # (name, class, reason)
    policy: str = ""
    audit: object = None                               # an AuditReport when example_inputs given
    verify: object = None                              # a VerifyReport when verify= is given
    lora: int = 0                                      # peft LoRA layers (mesa_ops.adapters)
    groups: list = field(default_factory=list)         # (name, asked, channels, given): head counts
    # that do not divide a layer's channels, and the largest divisor below them the layer took

    def summary(self) -> str:
        conv = ", ".join(f"{k} {v}" for k, v in sorted(self.converted.items()))
        lines = [f"mesa compress ({self.policy}): {conv}; {len(self.attention)} attention modules"
                 + (f"; {self.lora} LoRA layers" if self.lora else "")]
        if self.groups:
            lines.append(f"groups changed ({len(self.groups)} layers: the head count does not divide "
                         "their channels):")
            lines += [f"  {n}: {a} groups do not divide {c} channels: {g}" for n, a, c, g in self.groups]
        if self.unsupported:
            lines.append(f"not compressed ({len(self.unsupported)} modules):")
            lines += [f"  {n or '(root)'} ({c}): {why}" for n, c, why in self.unsupported]
        if self.verify is not None:
            lines.append(self.verify.summary())
        return "\n".join(lines)


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
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        raise NotImplementedError("mesa compress: grouped-query attention has no Mesa path")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    attn = mm1(q * scale, k.transpose(-2, -1))
    mask = _additive_mask(q, k, attn_mask, is_causal)
    if mask is not None:
        attn = attn + mask
    attn = softmax(attn)
    if dropout_p > 0:
        attn = F.dropout(attn, dropout_p, training=True)
    return mm2(attn, v)


# attention forms with cosine attention: qualified name -> (l2 normalizations of (B, H, ., .)
# tensors, products by a learned per-head scale), routed to ms.Normalize / ms.Scale in call order
COSINE_OPS = {
    "timm.models.xcit.XCA": (2, 1),                             # q, k; temperature
    "timm.models.swin_transformer_v2.WindowAttention": (2, 1),  # q, k; logit_scale.exp()
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
        if enable_gqa and k.shape[-3] != q.shape[-3]:
            raise NotImplementedError("mesa compress: grouped-query attention has no Mesa path")
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


def _mesa_attention_class(cls: type) -> type:
    """A subclass of ``cls`` with :class:`MesaAttentionMixin` (or, for an explicit form,
    :class:`MesaExplicitAttentionMixin`) first (cached per class)."""
    if cls not in _SUBCLASSES:
        mixin = MesaExplicitAttentionMixin if _qualname(cls) in EXPLICIT_ATTENTION else MesaAttentionMixin
        _SUBCLASSES[cls] = type(f"Mesa{cls.__name__}", (mixin, cls),
                                {"__module__": __name__, "_mesa_base": _qualname(cls),
                                 "__doc__": f"{cls.__qualname__} with a Mesa attention core "
                                            "(mesa_ops.compress)."})
    return _SUBCLASSES[cls]


def _ref_tensor(module: nn.Module):
    return next(iter(list(module.parameters()) + list(module.buffers())), None)


def _compress_attention(module: nn.Module) -> None:
    """Swap ``module``'s class for its Mesa subclass and give it head-wise Mesa attention ops:
    ``sdpa`` (ms.SDPA, the fused kernel) or, when its attention dropout is on,
    ``mm1`` / ``softmax`` / ``mm2`` (the explicit path, which keeps the dropout mask)."""
    heads = int(module.num_heads)
    drop = getattr(getattr(module, "attn_drop", None), "p", 0.0)
    explicit = EXPLICIT_ATTENTION.get(_qualname(module))
    cosine = COSINE_OPS.get(_qualname(module))
    module.__class__ = _mesa_attention_class(type(module))
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


# ---- conversion ----------------------------------------------------------------------------
def _convert_gelu_modules(model: nn.Module, groups_of) -> None:
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            approx = _GELU_MODULES.get(_qualname(child))
            if approx is not None:
                full = f"{parent_name}.{name}" if parent_name else name
                new = L.GELU(approximate=approx, quant_groups=groups_of(full))
                new.train(child.training)
                setattr(parent, name, new)


def _block_heads(model: nn.Module) -> dict[str, int]:
    """{name of a module whose direct child is an attention module: its num_heads}."""
    out = {}
    for name, m in model.named_modules():
        for child in m.children():
            h = getattr(child, "num_heads", None)
            if isinstance(h, int) and (_is_timm_attention(child) or isinstance(child, MesaAttentionMixin)):
                out[name] = h
    return out


def _groups_resolver(model: nn.Module, quant_groups):
    if quant_groups != "heads":
        g = int(quant_groups)
        return lambda name: g
    blocks = sorted(_block_heads(model).items(), key=lambda kv: -len(kv[0]))

    def groups_of(name: str) -> int:
        for bname, h in blocks:
            if not bname or name == bname or name.startswith(bname + "."):
                return h
        return 1
    return groups_of


def _static_channels(parent: nn.Module, name: str, m: nn.Module) -> int | None:
    """The width a Mesa layer groups, known before a forward (None where only the input tells):
    a GELU's from the layer before it in its parent (an MLP's fc1) or the one after it (fc2)."""
    if isinstance(m, L.Linear):
        return m.in_features
    if isinstance(m, L.Conv2d):
        return m.in_channels
    if isinstance(m, L.LayerNorm):
        return int(m.normalized_shape[-1])
    if isinstance(m, (L.BatchNorm2d, L.BatchNorm3d)) or (isinstance(m, L.BatchNormBase)
                                                          and type(m) not in L.MESA_LAYERS):
        return m.num_features  # (4-D and larger: groups along C; BatchNorm1d / Sync: by input)
    if isinstance(m, L.GELU):
        names = [n for n, _ in parent.named_children()]
        i = names.index(name)
        before = [getattr(parent, n) for n in names[:i]]
        after = [getattr(parent, n) for n in names[i + 1:]]
        for c in reversed(before):
            if isinstance(c, nn.Linear):
                return c.out_features
        for c in after:
            if isinstance(c, nn.Linear):
                return c.in_features
    return None


def _fit_groups(model: nn.Module) -> list:
    """Give each Mesa layer whose group count does not divide its (statically known) channels
    the largest divisor below that count (1 at worst); returns (name, asked, channels, given)."""
    changed = []
    for pname, parent in model.named_modules():
        for name, m in parent.named_children():
            if not isinstance(m, L.MESA_LAYERS) or isinstance(m, (L.MatMul, L.Softmax)):
                continue
            g, c = int(m.quant_groups), _static_channels(parent, name, m)
            if getattr(m, "group_size", None) or c is None or c % g == 0:
                continue
            fit = max(d for d in range(1, g + 1) if c % d == 0)
            m._resize_groups(fit)
            changed.append((f"{pname}.{name}" if pname else name, g, c, fit))
    return changed


def _convert_layers(model: nn.Module, quant_groups) -> None:
    groups_of = _groups_resolver(model, quant_groups)
    _convert_gelu_modules(model, groups_of)
    if quant_groups != "heads":
        convert_by_num_groups(model, int(quant_groups))
        return
    # blocks (innermost first) with the heads of their attention, then the rest with one group
    for bname, h in sorted(_block_heads(model).items(), key=lambda kv: -len(kv[0])):
        convert_by_num_groups(model.get_submodule(bname) if bname else model, h)
    convert_by_num_groups(model, 1)


# ---- listing what is not compressed ----------------------------------------------------------
_ATTN_NAME = re.compile(r"att(n|ention)", re.IGNORECASE)


def _attention_like(m: nn.Module) -> bool:
    """A module that computes attention itself: ``num_heads``, or 'Attn' / 'Attention' in its
    class name (Swin-V2's WindowAttention, CaiT's TalkingHeadAttn / ClassAttn, XCiT's XCA,
    CoaT's FactorAttnConvRelPosEnc, EfficientViT's CascadedGroupAttention, ...), with children."""
    return bool(list(m.children())) and (isinstance(getattr(m, "num_heads", None), int)
                                          or bool(_ATTN_NAME.search(type(m).__name__)))


def _unsupported(model: nn.Module) -> list:
    out = []
    for name, m in model.named_modules():
        if isinstance(m, L.MESA_LAYERS + (MesaAttentionMixin, QuantMixin)):
            continue
        if any(isinstance(c, (SDPA, L.MatMul)) for c in m.children()):
            continue  # an attention module already built from Mesa ops (this repo's models)
        qn = _qualname(m)
        if _attention_like(m) and not any(_attention_like(c) for c in m.modules() if c is not m):
            # (the innermost: a block named '...AttentionBlock' is not listed beside its attn)
            out.append((name, qn, "attention module of an unknown class: its q@k / softmax / "
                        "attn@v (or SDPA), computed in its forward, stay exact"))
            continue
        if list(m.children()):
            continue
        if isinstance(m, _SAVE_NOTHING) or qn in _SAVE_NOTHING_NAMES:
            continue
        if isinstance(m, nn.Dropout):
            if m.p > 0:
                out.append((name, qn, f"dropout p={m.p} saves its mask (1 byte per element)"))
            continue
        if isinstance(m, (nn.Linear, nn.Conv2d, nn.LayerNorm, nn.modules.batchnorm._BatchNorm, nn.GELU,
                          nn.Softmax, nn.ReLU)):
            why = "a subclass with its own forward (or parametrized): left exact"
        else:
            why = "no Mesa counterpart: what it saves for backward stays exact"
        out.append((name, qn, why))
    return out


# ---- policy --------------------------------------------------------------------------------
def _apply_policy(model: nn.Module, policy) -> str:
    if policy is None or policy is False or policy in ("off", "exact"):
        return "off"
    if isinstance(policy, dict):
        set_mesa(model, **{"enable": True, **policy})
        return f"dict {policy}"
    if isinstance(policy, str) and policy in NAMED_POLICIES:
        set_mesa(model, enable=True, bits=NAMED_POLICIES[policy], tags=POLICY_TAGS)
        convs = [m for _, m in mesa_layers(model) if isinstance(m, L.Conv2d)]
        if convs:
            convs[0].enable = False  # the stem conv reads the image: kept exact
        return policy
    if isinstance(policy, (str, os.PathLike)) and os.path.isfile(policy):
        deploy_on_init(model, os.fspath(policy), verbose=lambda *a: None)
        return os.fspath(policy)
    raise PolicyError(f"compress: policy={policy!r}: expected 'mesa8', 'mesa4', 'mesa2', 'off', a dict "
                      "of mesa_ops.policy.set_mesa arguments or the path of an existing policy file")


def compress(model: nn.Module, policy="mesa8", quant_groups="heads", example_inputs=None,
             return_report: bool = False, warn: bool = True, verify=None, verify_threshold: float = 0.05,
             leave_exact: bool = False):
    """Make ``model`` train with Mesa, in place; returns the model (and the report).

    Args:
        model: a ``timm.create_model(...)`` ViT/DeiT, Swin, PVT-v2 (or any model made of the
            layers Mesa knows; its own attention code then stays exact and is listed).
        policy: 'mesa8' / 'mesa4' / 'mesa2' (fc, matmul, gelu, layernorm, softmax, conv, bn,
            relu at that many bits; the first conv exact), 'off' (converted, compression off),
            a policy file path (:func:`mesa_ops.policy.deploy_on_init`) or a dict of
            :func:`mesa_ops.policy.set_mesa` arguments (e.g. ``{'bits': 4, 'tags': ['fc']}``).
        quant_groups: 'heads' (one group per head inside attention blocks, one elsewhere) or an
            int for every layer. Attention tensors are always grouped head-wise.
        example_inputs: a tensor or tuple; when given, one training forward is audited
            (:func:`mesa_ops.audit.audit`) and modules saving uncompressed tensors are listed.
        return_report: return ``(model, CompressReport)`` instead of the model.
        warn: emit a warning listing the modules left uncompressed.
        verify: a batch (tensor or tuple of inputs): Mesa's gradients on it are checked against
            exact ones (:func:`mesa_ops.verify.verify`, ``report.verify``); parameters whose
            relative error is above ``verify_threshold`` are named with the stored copy causing
            it, in the warning too; ``leave_exact=True`` switches those layers to exact.

    Weights are the same tensor objects; outputs in eval mode and with Mesa off are those of the
    original forward; in training with Mesa on the forward is the exact explicit attention
    (equal to timm's fused SDPA up to float rounding).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"compress: expected an nn.Module, got {type(model).__name__}")
    for _, m in list(model.named_modules()):
        if _is_timm_attention(m) and not isinstance(m, MesaAttentionMixin):
            _compress_attention(m)
    _convert_layers(model, quant_groups)
    lora = convert_lora_layers(model)  # peft LoRA: A reuses the stored copy under autocast too
    groups = _fit_groups(model)
    mark_prefix_tokens(model)
    name = _apply_policy(model, policy)
    report = CompressReport(policy=name, groups=groups, lora=lora)
    for _, m in mesa_layers(model):
        report.converted[type(m).__name__] = report.converted.get(type(m).__name__, 0) + 1
    report.attention = [n for n, m in model.named_modules() if isinstance(m, MesaAttentionMixin)]
    report.unsupported = _unsupported(model)
    if example_inputs is not None:
        from .audit import audit
        report.audit = audit(model, example_inputs, verbose=False)
        listed = {n for n, _, _ in report.unsupported}
        for row in report.audit.modules:
            if row.exact_bytes > 0 and row.name not in listed and not row.is_mesa:
                report.unsupported.append((row.name, row.type, f"saved {row.exact_bytes} bytes "
                                           "uncompressed in a training forward"))
    if verify is not None:
        from .verify import verify as check

        report.verify = check(model, verify, threshold=verify_threshold, leave_exact=leave_exact)
    if warn and (report.unsupported or report.groups or (report.verify is not None and report.verify.flagged)):
        warnings.warn(report.summary(), stacklevel=2)
    return (model, report) if return_report else model


def build_model(name: str, policy="mesa8", img_size: int | None = None, **kwargs) -> nn.Module:
    """A model by name, with Mesa on per ``policy``: this repo's models (registered in timm as
    ``mesa_<name>`` once ``models`` is imported) through their own ``ms_policy``; any other timm
    model (or ``timm:<name>``, e.g. ``timm:deit_small_patch16_224`` for timm's DeiT) created by
    ``timm.create_model`` (random init) and converted by :func:`compress`. ``img_size`` is passed
    to models that take it (PVT-v2 does not: it runs at any size)."""
    import timm

    own = not name.startswith("timm:") and timm.is_model(f"mesa_{name}")
    if name.startswith("timm:"):
        name = name[len("timm:"):]
    if not timm.is_model(f"mesa_{name}" if own else name):
        raise ValueError(f"unknown model {name!r} (neither this repo's nor timm's)")
    full = f"mesa_{name}" if own else name
    extra = dict(kwargs, **({"ms_policy": None if policy in ("off", "exact") else policy} if own else {}))
    if img_size is not None:
        try:
            model = timm.create_model(full, img_size=img_size, **extra)
        except TypeError as exc:
            if "img_size" not in str(exc):
                raise
            model = timm.create_model(full, **extra)
    else:
        model = timm.create_model(full, **extra)
    if not own:
        compress(model, policy, warn=False)
    return model


def bench(name: str, policy="mesa8", batch_size: int = 4, img_size: int = 224, steps: int = 3) -> dict:
    """Saved bytes and train-step time of model ``name`` (see :func:`build_model`) with Mesa per
    ``policy`` vs exact (the same model with every Mesa layer off: for a timm model its original
    forward). Steps (forward, sum loss, backward; fp32) alternate exact / Mesa; medians."""
    import statistics

    from .audit import audit
    from .bench import train_step_time

    model = build_model(name, policy, img_size=img_size).train()
    on = {n: m.enable for n, m in mesa_layers(model)}
    x = torch.randn(batch_size, 3, img_size, img_size)

    def set_on(flag):
        for n, m in mesa_layers(model):
            m.enable = on[n] and flag

    res = {"model": name, "policy": str(policy), "batch": batch_size, "img_size": img_size,
           "params_m": sum(p.numel() for p in model.parameters()) / 1e6}
    times = {True: [], False: []}
    for flag in (False, True):
        set_on(flag)
        res["saved_mesa" if flag else "saved_exact"] = audit(model, x, verbose=False).total_bytes
        train_step_time(model, (x,))  # warm-up
    for _ in range(steps):
        for flag in (False, True):
            set_on(flag)
            times[flag].append(train_step_time(model, (x,)))
    res["step_exact"] = statistics.median(times[False])
    res["step_mesa"] = statistics.median(times[True])
    return res
