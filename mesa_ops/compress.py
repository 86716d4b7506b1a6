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

* torchvision's and Hugging Face transformers' attention (``nn.MultiheadAttention``, torchvision's
  Swin window attention, every transformers attention module on the attention-function registry)
  and transformers' ``Conv1D``: :mod:`mesa_ops.zoo`, :mod:`mesa_ops.hf_layers`.
* products with a module's own per-channel parameter written inline (a layer scale
  ``self.lambda_1 * x``): stored packed, :mod:`mesa_ops.products`.

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

from . import layers as L
from .adapters import convert_lora_layers
from .attention import SDPA
from .attention_forms import (COMPRESSED_ATTENTION, COSINE_OPS, EXPLICIT_ATTENTION, MesaAttentionMixin,
                              _compress_attention, _is_timm_attention, _mesa_ops_of, _qualname,
                              attention_core, heads_of)
from .quant import QuantMixin
from .products import convert_products
from .zoo import compress_zoo_attention
from .policy import (PolicyError, convert_by_num_groups, deploy_on_init, mark_prefix_tokens,
                     mesa_layers, set_mesa)

__all__ = ["compress", "CompressReport", "NAMED_POLICIES", "COMPRESSED_ATTENTION", "EXPLICIT_ATTENTION",
           "COSINE_OPS", "attention_core"]

NAMED_POLICIES = {"mesa8": 8, "mesa4": 4, "mesa2": 2}
# tags a named policy enables: the paper's Transformer ops plus the conv-net layers (the first
# conv, which reads the image the caller holds anyway, stays exact: see configs/mesa/pvt_8bit.txt)
POLICY_TAGS = ("fc", "matmul", "gelu", "layernorm", "softmax", "attention", "conv", "bn", "relu",
               "normalize", "scale")

# timm modules computing F.gelu(x) / F.gelu(x, approximate='tanh') and nothing else
# (transformers': GELUActivation when it calls F.gelu; NewGELU / FastGELU spell the tanh form out
# in separate ops: F.gelu(approximate='tanh') differs from them by at most 2.4e-7 at |x| < 10)
_GELU_MODULES = {"timm.layers.activations.GELU": "none", "timm.layers.activations.GELUTanh": "tanh",
                 "transformers.activations.GELUActivation": "none",
                 "transformers.activations.PytorchGELUTanh": "tanh", "transformers.activations.GELUTanh": "tanh",
                 "transformers.activations.NewGELUActivation": "tanh",
                 "transformers.activations.FastGELUActivation": "tanh"}
# leaf modules that save nothing for backward (or only per-sample scalars)
_SAVE_NOTHING = (nn.Identity, nn.Flatten, nn.Unflatten, nn.Unfold,
                 # containers without a forward of their own (peft's empty lora_embedding_A, ...)
                 nn.ModuleDict, nn.ModuleList, nn.ParameterDict, nn.ParameterList, nn.Sequential)
_SAVE_NOTHING_NAMES = ("timm.layers.drop.DropPath", "timm.layers.adaptive_avgmax_pool.FastAdaptiveAvgPool",
                       "timm.layers.format.Format",
                       # mmcv / mmseg (MesaCompressed): per-sample drop-path scalars; F.pad
                       "mmcv.cnn.bricks.drop.DropPath", "mmseg.models.utils.embed.AdaptivePadding",
                       # torchvision / transformers: a permute; per-sample drop-path scalars
                       "torchvision.ops.misc.Permute", "torchvision.ops.stochastic_depth.StochasticDepth",
                       "transformers.models.swin.modeling_swin.SwinDropPath",
                       "transformers.models.beit.modeling_beit.BeitDropPath")


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
    idle: list = field(default_factory=list)           # enabled Mesa layers the audited training
    # forward never used (e.g. a Linear whose weight the parent passes to F.linear itself)

    def summary(self) -> str:
        conv = ", ".join(f"{k} {v}" for k, v in sorted(self.converted.items()))
        lines = [f"mesa compress ({self.policy}): {conv}; {len(self.attention)} attention modules"
                 + (f"; {self.lora} LoRA layers" if self.lora else "")]
        if self.groups:
            lines.append(f"groups changed ({len(self.groups)} layers: the head count does not divide "
                         "their channels):")
            lines += [f"  {n}: {a} groups do not divide {c} channels: {g}" for n, a, c, g in self.groups]
        if self.idle:
            lines.append(f"converted but never used by the audited training forward ({len(self.idle)}: "
                         "not counted above; whatever their parent computes with them stays exact):")
            lines += [f"  {n}" for n in self.idle]
        if self.unsupported:
            lines.append(f"not compressed ({len(self.unsupported)} modules):")
            lines += [f"  {n or '(root)'} ({c}): {why}" for n, c, why in self.unsupported]
        if self.verify is not None:
            lines.append(self.verify.summary())
        return "\n".join(lines)


# ---- conversion ----------------------------------------------------------------------------
def _convert_gelu_modules(model: nn.Module, groups_of) -> None:
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            approx = _GELU_MODULES.get(_qualname(child))
            if approx is not None and getattr(child, "act", F.gelu) is F.gelu:
                full = f"{parent_name}.{name}" if parent_name else name
                new = L.GELU(approximate=approx, quant_groups=groups_of(full))
                new.train(child.training)
                setattr(parent, name, new)


def _block_heads(model: nn.Module) -> dict[str, int]:
    """{name of a module whose direct child is an attention module: its num_heads}."""
    out = {}
    for name, m in model.named_modules():
        for child in m.children():
            h = heads_of(child)
            if h is not None and (_is_timm_attention(child) or isinstance(child, MesaAttentionMixin)):
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
    if isinstance(m, (L.Linear, L.LinearFn, L.LinearBase)):
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
            if m.p > 0 and not (isinstance(m, L.Dropout) and m.enable):
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
def _convert_dropouts(model: nn.Module) -> int:
    """nn.Dropout (exact type, p > 0, not in place) -> :class:`mesa_ops.layers.Dropout` (the same
    draws; a 1-bit mask for backward once enabled); returns how many."""
    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Dropout and child.p > 0 and not child.inplace:
                new = L.Dropout(child.p)
                new.train(child.training)
                setattr(parent, name, new)
                n += 1
    return n


def _apply_policy(model: nn.Module, policy) -> str:
    # 1-bit dropout masks under the named policies and dicts (unless their tags leave "dropout" out)
    tags = policy.get("tags") if isinstance(policy, dict) else None
    on = (isinstance(policy, str) and policy in NAMED_POLICIES) or (isinstance(policy, dict) and (tags is None or "dropout" in tags))
    for m in model.modules():
        if isinstance(m, L.Dropout):
            m.enable = bool(on)
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
             leave_exact: bool = False, verify_noise_threshold: float = 0.5):
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
            error is above ``verify_noise_threshold`` times the minibatch noise (batches of 4 or
            more; smaller ones: relative error above ``verify_threshold``) are named with the
            stored copy causing it, in the warning too; ``leave_exact=True`` switches those
            layers to exact.

    Weights are the same tensor objects; outputs in eval mode and with Mesa off are those of the
    original forward; in training with Mesa on the forward is the exact explicit attention
    (equal to timm's fused SDPA up to float rounding).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"compress: expected an nn.Module, got {type(model).__name__}")
    hf_sdpa = next((bool(type(m)._supports_sdpa) for m in model.modules() if hasattr(type(m), "_supports_sdpa")),
                   True)  # (transformers: whether the model supports its sdpa attention)
    for _, m in list(model.named_modules()):
        if _is_timm_attention(m) and not isinstance(m, MesaAttentionMixin):
            _compress_attention(m)
        else:  # nn.MultiheadAttention, transformers' attention modules (mesa_ops.zoo)
            compress_zoo_attention(m, hf_sdpa)
    _convert_layers(model, quant_groups)
    dropouts = _convert_dropouts(model)
    convert_products(model, _groups_resolver(model, quant_groups))  # x * gamma inline (products.py)
    lora = convert_lora_layers(model)  # peft LoRA: A reuses the stored copy under autocast too
    groups = _fit_groups(model)
    mark_prefix_tokens(model)
    name = _apply_policy(model, policy)
    report = CompressReport(policy=name, groups=groups, lora=lora)
    for _, m in mesa_layers(model):
        report.converted[type(m).__name__] = report.converted.get(type(m).__name__, 0) + 1
    if dropouts:
        report.converted["Dropout"] = dropouts
    report.attention = [n for n, m in model.named_modules() if isinstance(m, MesaAttentionMixin)]
    report.unsupported = _unsupported(model)
    if example_inputs is not None:
        report.audit, report.idle = _audit_use(model, example_inputs)
        for n in report.idle:
            kind = type(model.get_submodule(n)).__name__
            report.converted[kind] -= 1
        listed = {n for n, _, _ in report.unsupported}
        for row in report.audit.modules:
            if row.exact_bytes > 0 and row.name not in listed and not row.is_mesa:
                report.unsupported.append((row.name, row.type, f"saved {row.exact_bytes} bytes "
                                           "uncompressed in a training forward"))
    if verify is not None:
        from .verify import verify as check

        report.verify = check(model, verify, threshold=verify_threshold, leave_exact=leave_exact,
                              noise_threshold=verify_noise_threshold)
    if warn and (report.unsupported or report.groups or (report.verify is not None and report.verify.flagged)):
        warnings.warn(report.summary(), stacklevel=2)
    return (model, report) if return_report else model


def _audit_use(model: nn.Module, example_inputs):
    """(the audit of one training forward, the enabled Mesa layers it neither called nor used
    through a routed op: their quantizers' iteration unchanged)."""
    from .audit import audit

    called, layers = set(), [(n, m) for n, m in mesa_layers(model) if m.enable]
    before = {n: [q.iteration.clone() for q in m.modules() if isinstance(q, QuantMixin)] for n, m in layers}
    hooks = [m.register_forward_pre_hook(lambda mod, _a: called.add(id(mod))) for _, m in layers]
    try:
        rep = audit(model, example_inputs, verbose=False)
    finally:
        for h in hooks:
            h.remove()
    idle = [n for n, m in layers if id(m) not in called and all(
        torch.equal(a, q.iteration) for a, q in zip(before[n], (q for q in m.modules() if isinstance(q, QuantMixin))))]
    return rep, idle
