"""Building blocks shared by the DeiT, Swin and PVT models, made of ``mesa_ops`` layers.

Every block takes its layer classes as arguments (``linear_layer``, ``norm_layer``, ``act_layer``,
``conv_layer``, ``matmul_layer``, ``softmax_layer``), as timm does; the defaults are the Mesa
layers, which behave exactly like their ``nn`` counterparts until a policy enables them. Plain
``nn`` classes work too: the quantization-group argument is passed only to layers that take it.

Shapes: tokens (B, N, C); attention tensors (B, H, N, D) with D = C / H. Mesa groups: one group
per head for q@k^T, softmax and attn@v (the paper's head-wise quantization); for the other layers
:class:`QuantGroups` decides (by default also one group per head of the block).
"""
from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import DropPath, to_2tuple, trunc_normal_

import mesa_ops as ms
from mesa_ops.attention import exact_sdpa, token_layout

__all__ = ["QuantGroups", "build_layer", "make_head", "PyramidHeadMixin", "init_prenorm_block",
           "accepts_kwarg",
           "Mlp", "AttentionOps", "Attention",
           "ATTN_IMPLS", "compresses", "set_attn_impl",
           "PatchEmbed", "DropPath", "to_2tuple", "trunc_normal_", "init_weights"]


@dataclass(frozen=True)
class QuantGroups:
    """Number of Mesa quantization groups for an activation with ``channels`` channels.

    ``groups='heads'`` (default): one group per attention head of the block (the original DeiT
    demo); ``groups=<int>``: that many groups everywhere; ``group_size=<int>``: channels // size
    groups (the original Swin demo uses 32). Attention tensors always use one group per head.
    """
    groups: int | str = "heads"
    group_size: int | None = None

    def __post_init__(self):
        if self.group_size is not None and (int(self.group_size) != self.group_size or self.group_size < 1):
            raise ValueError(f"quant_group_size must be a positive integer, got {self.group_size!r}")
        if self.groups != "heads" and (not isinstance(self.groups, int) or self.groups < 1):
            raise ValueError(f"quant_groups must be 'heads' or a positive integer, got {self.groups!r}")

    def __call__(self, channels: int, num_heads: int = 1, where: str = "") -> int:
        if self.group_size:
            if channels % self.group_size:
                raise ValueError(f"{where or 'layer'}: quant_group_size={self.group_size} does not "
                                 f"divide its {channels} channels")
            return channels // self.group_size
        g = num_heads if self.groups == "heads" else self.groups
        if channels % g:
            raise ValueError(f"{where or 'layer'}: {g} quantization groups do not divide its "
                             f"{channels} channels")
        return g


def accepts_kwarg(layer, name: str) -> bool:
    """Whether calling ``layer`` (a class or functools.partial) takes keyword ``name``."""
    try:
        params = inspect.signature(layer).parameters
    except (TypeError, ValueError):
        return False
    return name in params


def build_layer(layer, *args, quant_groups: int | None = None, **kwargs) -> nn.Module:
    """``layer(*args, **kwargs)``, adding ``quant_groups`` when the layer takes it."""
    if quant_groups is not None and accepts_kwarg(layer, "quant_groups"):
        kwargs["quant_groups"] = quant_groups
    return layer(*args, **kwargs)


def make_head(linear_layer, features: int, num_classes: int, qgroups, heads: int) -> nn.Module:
    """The classifier head (features -> num_classes), or Identity when num_classes <= 0."""
    if num_classes <= 0:
        return nn.Identity()
    return build_layer(linear_layer, features, num_classes,
                       quant_groups=qgroups(features, heads, "head"))


def init_prenorm_block(block: nn.Module, dim: int, num_heads: int, make_attn, mlp_ratio: float,
                       drop: float, drop_path: float, act_layer, norm_layer, linear_layer,
                       qgroups) -> None:
    """Give ``block`` the pre-norm layout x + attn(norm1(x)); x + mlp(norm2(x)) shared by the
    DeiT and PVT blocks: ``norm1``, ``attn = make_attn()``, ``drop_path``, ``norm2``, ``mlp``
    (registered in that order, which fixes the per-tag policy indices)."""
    block.norm1 = build_layer(norm_layer, dim, quant_groups=qgroups(dim, num_heads, "norm1"))
    block.attn = make_attn()
    block.drop_path = DropPath(drop_path) if drop_path > 0. else nn.Identity()
    block.norm2 = build_layer(norm_layer, dim, quant_groups=qgroups(dim, num_heads, "norm2"))
    block.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=act_layer, linear_layer=linear_layer,
                    drop=drop, num_heads=num_heads, qgroups=qgroups)


class PyramidHeadMixin:
    """Classifier head of the pyramid models (Swin, PVT): ``num_features`` -> classes, with the
    quantization groups of the last stage's ``last_heads``."""

    def _make_head(self, num_classes):
        return make_head(self.linear_layer, self.num_features, num_classes, self.qgroups, self.last_heads)

    def get_classifier(self):
        return self.head

    def reset_classifier(self, num_classes: int):
        """A new (randomly initialised) head for ``num_classes`` classes (fine-tuning)."""
        self.num_classes = num_classes
        self.head = self._make_head(num_classes)
        self.head.apply(init_weights)


def init_weights(m: nn.Module) -> None:
    """The DeiT / Swin / PVT init: Linear weights trunc_normal(0.02), biases 0, LayerNorm 1/0."""
    if isinstance(m, nn.Linear):
        trunc_normal_(m.weight, std=.02)
        if m.bias is not None:
            nn.init.constant_(m.bias, 0)
    elif isinstance(m, nn.LayerNorm):
        if m.bias is not None:
            nn.init.constant_(m.bias, 0)
        if m.weight is not None:
            nn.init.constant_(m.weight, 1.0)


class Mlp(nn.Module):
    """fc1 -> act -> drop -> fc2 -> drop on (B, N, C_in) -> (B, N, C_out)."""

    def __init__(self, in_features, hidden_features=None, out_features=None, act_layer=ms.GELU,
                 linear_layer=ms.Linear, drop=0., num_heads=1, qgroups: QuantGroups = QuantGroups()):
        super().__init__()
        out_features = out_features or in_features
        hidden_features = hidden_features or in_features
        self.fc1 = build_layer(linear_layer, in_features, hidden_features,
                               quant_groups=qgroups(in_features, num_heads, "mlp.fc1"))
        self.act = build_layer(act_layer, quant_groups=qgroups(hidden_features, num_heads, "mlp.act"))
        self.fc2 = build_layer(linear_layer, hidden_features, out_features,
                               quant_groups=qgroups(hidden_features, num_heads, "mlp.fc2"))
        self.drop = Dropout(drop)

    def forward(self, x):
        x = self.fc1(x)
        x = self.act(x)
        x = self.drop(x)
        x = self.fc2(x)
        x = self.drop(x)
        return x


class Dropout(nn.Dropout):
    """``nn.Dropout`` that returns its input itself where it is the identity (p = 0 or eval), so
    the packed copy the input carries reaches the next Mesa layer (GELU -> fc2, softmax -> attn@v);
    under torch.compile a traced identity dropout would give a new tensor without it, and the next
    layer would store a second copy (issue 22.6). Same state dict and repr as ``nn.Dropout``; a
    method of a module rather than a free function so that TorchScript compiles it (eval models,
    timm's ``test_model_forward_torchscript``)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.training and self.p > 0:
            return F.dropout(input, self.p, self.training, self.inplace)
        return input


def compresses(m: nn.Module) -> bool:
    """Whether a Mesa layer would store anything compressed: any of its quantizers is enabled
    (MatMul / Softmax: ``quant1`` or ``quant2``; SDPA: any of ``quant_q/k/v/o``)."""
    qs = [q for q in m.children() if isinstance(q, ms.QuantMixin)]
    if qs:
        return any(q.enable for q in qs)
    return bool(getattr(m, "enable", False))


ATTN_IMPLS = ("fused", "explicit")
_warned_dropout: set = set()


class AttentionOps(nn.Module):
    """Base of the attention modules: owns ``mm1`` (q @ k^T), ``softmax``, ``attn_drop`` and
    ``mm2`` (attn @ v) under the original Mesa code's names, and ``sdpa`` (:class:`ms.SDPA`,
    policy tag ``attention``), and runs them in :meth:`attend`.

    Paths (:meth:`attention_path`):
      * ``'mesa-sdpa'``: training with ``sdpa`` enabled, ``attn_impl='fused'`` (the default) and
        ``fused_attn``: PyTorch's fused SDPA, q/k/v/out stored packed (no N x M matrix is kept);
      * ``'mesa-explicit'``: training with any quantizer of mm1 / softmax / mm2 enabled (and not the
        above): q @ k^T, softmax, attn @ v as Mesa modules, the paper's configuration; also taken
        when ``attn_drop > 0`` (the fused kernels cannot hand back the dropout mask);
      * ``'sdpa'``: exact ``F.scaled_dot_product_attention`` (with ``fused_attn``), else
        ``'explicit'`` (exact q @ k^T / softmax / attn @ v).
    Every path's forward output is the exact op's; all four modules always exist, so checkpoints
    load with either ``attn_impl``.
    """

    def init_attention_ops(self, num_heads: int, scale: float, attn_drop: float = 0.,
                           matmul_layer=ms.MatMul, softmax_layer=ms.Softmax, fused_attn: bool = True,
                           attn_impl: str = "fused", sdpa_layer=ms.SDPA):
        if attn_impl not in ATTN_IMPLS:
            raise ValueError(f"attn_impl must be one of {ATTN_IMPLS}, got {attn_impl!r}")
        self.num_heads = num_heads
        self.scale = scale
        self.fused_attn = fused_attn
        self.attn_impl = attn_impl
        self.attn_drop = Dropout(attn_drop)
        self.mm1 = build_layer(matmul_layer, quant_groups=num_heads)
        self.mm2 = build_layer(matmul_layer, quant_groups=num_heads)
        self.softmax = build_layer(softmax_layer, dim=-1, quant_groups=num_heads)
        self.sdpa = build_layer(sdpa_layer, quant_groups=num_heads)

    def attention_path(self) -> str:
        """Which path the next forward takes: 'mesa-sdpa', 'mesa-explicit', 'sdpa' or 'explicit'."""
        if self.training and torch.is_grad_enabled():
            if self.attn_impl == "fused" and self.fused_attn and compresses(self.sdpa):
                if self.attn_drop.p == 0:
                    return "mesa-sdpa"
                name = type(self).__name__
                if name not in _warned_dropout:
                    _warned_dropout.add(name)
                    warnings.warn(f"{name}: attn_drop={self.attn_drop.p} > 0: the fused SDPA kernels "
                                  "cannot give back their dropout mask for a compressed backward; "
                                  "using the explicit q@k / softmax / attn@v path (compressed by the "
                                  "matmul / softmax policy)", stacklevel=3)
            if any(compresses(m) for m in (self.mm1, self.softmax, self.mm2)):
                return "mesa-explicit"
        return "sdpa" if self.fused_attn else "explicit"

    def training_path(self) -> tuple[str, bool]:
        """The path a training forward takes (as :meth:`attention_path` in train mode with grad
        on, without its warning) and whether it stores the (B, H, N, M) softmax output at full
        precision: the explicit Mesa path with the softmax quantizer off (attn@v stores the
        softmax's packed copy when it is on, also with its own first quantizer off; more bytes than exact fused SDPA, which stores no N x N matrix)."""
        if self.attn_impl == "fused" and self.fused_attn and compresses(self.sdpa) and self.attn_drop.p == 0:
            return "mesa-sdpa", False
        if any(compresses(m) for m in (self.mm1, self.softmax, self.mm2)):
            return "mesa-explicit", not compresses(self.softmax)  # (attn@v reuses its copy)
        return ("sdpa" if self.fused_attn else "explicit"), not self.fused_attn

    def uses_fused(self) -> bool:
        """Whether the next forward runs an SDPA kernel (exact or Mesa)."""
        return self.attention_path() in ("sdpa", "mesa-sdpa")

    def attend(self, q, k, v, bias: Optional[torch.Tensor] = None, mask: Optional[torch.Tensor] = None,
               merge_heads: bool = False):
        """softmax(q k^T * scale + bias + mask) v.

        Args:
            q: (B, H, N, D); k, v: (B, H, M, D).
            bias: optional (H, N, M), added for every batch item (Swin's relative position bias).
            mask: optional (W, N, M) with B = B' * W, added per window (Swin's shifted windows).
            merge_heads: return the (B, N, H * D) token layout (on the Mesa SDPA path it carries
                the packed output, which the following Mesa Linear then stores no second time).
        Returns:
            (B, H, N, D), or (B, N, H * D) with ``merge_heads``.

        Under TorchScript (eval models) the path is 'sdpa' or 'explicit' by ``fused_attn``.
        """
        if torch.jit.is_scripting():
            fused = self.fused_attn
        else:
            path = self.attention_path()
            if path == "mesa-sdpa":
                am = None if bias is None else bias.unsqueeze(0)
                return self.sdpa(q, k, v, attn_mask=am, scale=self.scale, window_mask=mask,
                                 merge_heads=merge_heads)
            fused = path == "sdpa"
        if fused:
            drop = self.attn_drop.p if self.training else 0.
            out = exact_sdpa(q, k, v, None if bias is None else bias.unsqueeze(0), mask, self.scale, drop)
        else:
            out = self._explicit(q, k, v, bias, mask)
        return token_layout(out) if merge_heads else out

    def _explicit(self, q, k, v, bias: Optional[torch.Tensor], mask: Optional[torch.Tensor]):
        q = q * self.scale
        attn = self.mm1(q, k.transpose(-2, -1))
        if bias is not None:
            attn = attn + bias.unsqueeze(0)
        if mask is not None:
            B, H, N, M = attn.shape
            W = mask.shape[0]
            attn = attn.view(B // W, W, H, N, M) + mask.unsqueeze(1).unsqueeze(0)
            attn = attn.view(-1, H, N, M)
        attn = self.softmax(attn)
        attn = self.attn_drop(attn)
        return self.mm2(attn, v)


def set_attn_impl(model: nn.Module, attn_impl: str) -> int:
    """Set ``attn_impl`` ('fused' or 'explicit') on every attention module of ``model``; returns
    how many were set."""
    if attn_impl not in ATTN_IMPLS:
        raise ValueError(f"attn_impl must be one of {ATTN_IMPLS}, got {attn_impl!r}")
    n = 0
    for m in model.modules():
        if isinstance(m, AttentionOps):
            m.attn_impl = attn_impl
            n += 1
    return n


class Attention(AttentionOps):
    """Multi-head self-attention of ViT / DeiT: (B, N, C) -> (B, N, C); parameters ``qkv``, ``proj``."""

    def __init__(self, dim, num_heads=8, qkv_bias=False, qk_scale=None, attn_drop=0., proj_drop=0.,
                 linear_layer=ms.Linear, matmul_layer=ms.MatMul, softmax_layer=ms.Softmax,
                 qgroups: QuantGroups = QuantGroups(), fused_attn: bool = True, attn_impl: str = "fused"):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim {dim} is not divisible by num_heads {num_heads}")
        self.qkv = build_layer(linear_layer, dim, dim * 3, bias=qkv_bias,
                               quant_groups=qgroups(dim, num_heads, "attn.qkv"))
        self.proj = build_layer(linear_layer, dim, dim, quant_groups=qgroups(dim, num_heads, "attn.proj"))
        self.proj_drop = nn.Dropout(proj_drop)
        self.init_attention_ops(num_heads, qk_scale or (dim // num_heads) ** -0.5, attn_drop,
                                matmul_layer, softmax_layer, fused_attn, attn_impl)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        x = self.attend(q, k, v, merge_heads=True)
        x = self.proj(x)
        x = self.proj_drop(x)
        return x


class PatchEmbed(nn.Module):
    """Image (B, C_in, H, W) -> tokens (B, N, C) by a stride-``patch_size`` conv ``proj``, then
    an optional ``norm``; N = (H // p) * (W // p). ``strict_img_size`` checks H, W == img_size
    (``torch._assert``, as timm's PatchEmbed: the check traces under FX and scripts)."""

    def __init__(self, img_size=224, patch_size=16, in_chans=3, embed_dim=768, norm_layer=None,
                 conv_layer=ms.Conv2d, conv_groups: int = 1, norm_groups: int = 1,
                 strict_img_size: bool = True):
        super().__init__()
        self.img_size = to_2tuple(img_size)
        self.patch_size = to_2tuple(patch_size)
        self.grid_size = (self.img_size[0] // self.patch_size[0], self.img_size[1] // self.patch_size[1])
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.strict_img_size = strict_img_size
        self.proj = build_layer(conv_layer, in_chans, embed_dim, kernel_size=self.patch_size,
                                stride=self.patch_size, quant_groups=conv_groups)
        if norm_layer is not None:
            self.norm = build_layer(norm_layer, embed_dim, quant_groups=norm_groups)
        else:
            self.norm = None

    def forward(self, x):
        _, _, H, W = x.shape
        if self.strict_img_size:
            msg = (f"input image size ({H}x{W}) does not match the model's img_size "
                   f"{self.img_size[0]}x{self.img_size[1]}; build the model with img_size=({H}, {W})")
            torch._assert(H == self.img_size[0], msg)
            torch._assert(W == self.img_size[1], msg)
        x = self.proj(x).flatten(2).transpose(1, 2)
        if self.norm is not None:
            x = self.norm(x)
        return x
