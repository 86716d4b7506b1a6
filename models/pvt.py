"""PVT v1 (Wang et al., 2021), the Pyramid Vision Transformer with spatial-reduction attention,
from Mesa layers, with the key layout of whai362/PVT's classification checkpoints:
``patch_embed{i}.proj/norm``, ``pos_embed{i}``, ``block{i}.j.norm1``, ``block{i}.j.attn.q``,
``...attn.kv``, ``...attn.sr``/``...attn.norm`` (sr ratio > 1), ``...attn.proj``, ``...norm2``,
``...mlp.fc1/fc2``, ``norm``, ``cls_token``, ``head`` (i = 1..4). Mesa adds quantizer state only
(``attn.mm1``, ``attn.mm2``, ``attn.softmax``, ``mlp.act`` and every Linear / LayerNorm / Conv2d).

Stages: dims 64/128/320/512, heads 1/2/5/8, mlp ratios 8/8/4/4, sr ratios 8/4/2/1; stage i works
on (B, H/s_i * W/s_i, C_i) tokens with s = 4, 8, 16, 32; the class token joins at stage 4.
Position embeddings are interpolated at run time for another input size (as the official code).
"""
from __future__ import annotations

import math
from functools import partial
from typing import Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

import mesa_ops as ms

from .checkpoint import resize_pos_embed
from .layers import (AttentionOps, PatchEmbed, QuantGroups, build_layer, init_prenorm_block,
                     init_weights, PyramidHeadMixin, to_2tuple, trunc_normal_)
from .registry import register_model
from .timm_api import (GradCheckpointing, check_global_pool, check_output_fmt, feature_take_indices,
                       init_grad_checkpointing, pool_tokens, register_notrace_function, tokens_to_nchw)

__all__ = ["SRAttention", "Block", "PyramidVisionTransformer", "stage_pos_embed"]


@register_notrace_function  # FX: one graph node, so the size test runs on the real sizes
def stage_pos_embed(pos_embed: torch.Tensor, grid: Tuple[int, int], H: int, W: int) -> torch.Tensor:
    """(1, h*w, C) position embedding of a stage built for the (h, w) ``grid`` -> (1, H*W, C),
    resized bilinearly when (H, W) differs (as the official code does at another input size)."""
    if H == grid[0] and W == grid[1]:
        return pos_embed
    return F.interpolate(pos_embed.reshape(1, grid[0], grid[1], -1).permute(0, 3, 1, 2), size=(H, W),
                         mode="bilinear").reshape(1, -1, H * W).permute(0, 2, 1)


class SRAttention(AttentionOps):
    """Spatial-reduction attention: queries from all N = H*W tokens, keys / values from the
    tokens reduced by a stride-``sr_ratio`` conv ``sr`` + ``norm``: (B, N, C) -> (B, N, C)."""

    def __init__(self, dim, num_heads=8, qkv_bias=False, qk_scale=None, attn_drop=0., proj_drop=0.,
                 sr_ratio=1, linear_layer=ms.Linear, conv_layer=ms.Conv2d, sr_norm_layer=ms.LayerNorm,
                 matmul_layer=ms.MatMul, softmax_layer=ms.Softmax, qgroups: QuantGroups = QuantGroups(),
                 fused_attn: bool = True, attn_impl: str = "fused"):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim {dim} is not divisible by num_heads {num_heads}")
        self.dim = dim
        g = qgroups(dim, num_heads, "attn")
        self.q = build_layer(linear_layer, dim, dim, bias=qkv_bias, quant_groups=g)
        self.kv = build_layer(linear_layer, dim, dim * 2, bias=qkv_bias, quant_groups=g)
        self.proj = build_layer(linear_layer, dim, dim, quant_groups=g)
        self.proj_drop = nn.Dropout(proj_drop)
        self.sr_ratio = sr_ratio
        if sr_ratio > 1:
            self.sr = build_layer(conv_layer, dim, dim, kernel_size=sr_ratio, stride=sr_ratio, quant_groups=g)
            self.norm = build_layer(sr_norm_layer, dim, quant_groups=g)
        self.init_attention_ops(num_heads, qk_scale or (dim // num_heads) ** -0.5, attn_drop, matmul_layer,
                                softmax_layer, fused_attn, attn_impl)

    def forward(self, x, H: int, W: int):
        B, N, C = x.shape
        h = self.num_heads
        q = self.q(x).reshape(B, N, h, C // h).permute(0, 2, 1, 3)
        if hasattr(self, "sr"):  # sr_ratio > 1 (hasattr: TorchScript skips the branch otherwise)
            x_ = x.permute(0, 2, 1).reshape(B, C, H, W)
            x_ = self.sr(x_).reshape(B, C, -1).permute(0, 2, 1)
            x_ = self.norm(x_)
        else:
            x_ = x
        kv = self.kv(x_).reshape(B, -1, 2, h, C // h).permute(2, 0, 3, 1, 4)
        k, v = kv[0], kv[1]
        x = self.attend(q, k, v, merge_heads=True)
        x = self.proj(x)
        x = self.proj_drop(x)
        return x


class Block(nn.Module):
    """PVT block on (B, N, C) with the stage's (H, W): x + attn(norm1(x)); x + mlp(norm2(x))."""

    def __init__(self, dim, num_heads, mlp_ratio=4., qkv_bias=False, qk_scale=None, drop=0., attn_drop=0.,
                 drop_path=0., act_layer=ms.GELU, norm_layer=ms.LayerNorm, sr_ratio=1,
                 linear_layer=ms.Linear, conv_layer=ms.Conv2d, sr_norm_layer=ms.LayerNorm,
                 matmul_layer=ms.MatMul, softmax_layer=ms.Softmax, qgroups: QuantGroups = QuantGroups(),
                 fused_attn: bool = True, attn_impl: str = "fused"):
        super().__init__()
        init_prenorm_block(
            self, dim, num_heads,
            lambda: SRAttention(dim, num_heads, qkv_bias, qk_scale, attn_drop, drop, sr_ratio,
                                linear_layer=linear_layer, conv_layer=conv_layer,
                                sr_norm_layer=sr_norm_layer, matmul_layer=matmul_layer,
                                softmax_layer=softmax_layer, qgroups=qgroups, fused_attn=fused_attn,
                                attn_impl=attn_impl),
            mlp_ratio, drop, drop_path, act_layer, norm_layer, linear_layer, qgroups)

    def forward(self, x, H: int, W: int):
        x = x + self.drop_path(self.attn(self.norm1(x), H, W))
        x = x + self.drop_path(self.mlp(self.norm2(x)))
        return x


class PyramidVisionTransformer(GradCheckpointing, PyramidHeadMixin, nn.Module):
    """PVT v1 classifier. ``norm_layer`` is the blocks' and final norm (eps 1e-6 in the official
    models); ``sr_norm_layer`` the norm of the patch embeddings and of the spatial reduction (plain
    LayerNorm, eps 1e-5, in the official code). Other arguments as in
    :class:`models.deit.VisionTransformer`.

    timm's model contract: PVT v1 classifies from a class token that joins at stage 4, so
    ``forward_features`` gives the last stage's normed tokens (B, 1 + N, C) and
    ``forward_head(x, pre_logits)`` pools them (``global_pool``: 'token' as the official model,
    'avg', or ''); ``forward_intermediates`` / ``feature_info`` give the four stages as NCHW maps
    (strides 4, 8, 16, 32); ``set_grad_checkpointing(enable, bits)`` checkpoints every block.
    """

    def __init__(self, img_size=224, patch_size=16, in_chans=3, num_classes=1000,
                 embed_dims=(64, 128, 256, 512), num_heads=(1, 2, 4, 8), mlp_ratios=(4, 4, 4, 4),
                 qkv_bias=False, qk_scale=None, drop_rate=0.,
                 attn_drop_rate=0., drop_path_rate=0., norm_layer=ms.LayerNorm, depths=(3, 4, 6, 3),
                 sr_ratios=(8, 4, 2, 1), num_stages=4, act_layer=ms.GELU, linear_layer=ms.Linear,
                 conv_layer=ms.Conv2d, sr_norm_layer=ms.LayerNorm, matmul_layer=ms.MatMul,
                 softmax_layer=ms.Softmax, quant_groups="heads", quant_group_size=None, fused_attn=True,
                 attn_impl="fused",
                 global_pool="token", grad_checkpointing=False, grad_checkpointing_bits=None):
        super().__init__()
        self.num_classes = num_classes
        self.global_pool = check_global_pool(global_pool)
        self.depths = depths
        self.num_stages = num_stages
        self.embed_dims = embed_dims
        self.num_features = self.head_hidden_size = embed_dims[num_stages - 1]
        self.linear_layer = linear_layer
        self.qgroups = qg = QuantGroups(quant_groups, quant_group_size)
        self.last_heads = num_heads[num_stages - 1]

        dpr = torch.linspace(0, drop_path_rate, sum(depths), device="cpu").tolist()
        cur = 0
        for i in range(num_stages):
            in_ch = in_chans if i == 0 else embed_dims[i - 1]
            patch_embed = PatchEmbed(
                img_size if i == 0 else img_size // (2 ** (i + 1)), patch_size if i == 0 else 2, in_ch,
                embed_dims[i], norm_layer=sr_norm_layer, conv_layer=conv_layer,
                conv_groups=1 if i == 0 else qg(in_ch, num_heads[i - 1], f"patch_embed{i + 1}.proj"),
                norm_groups=qg(embed_dims[i], num_heads[i], f"patch_embed{i + 1}.norm"),
                strict_img_size=False)
            num_patches = patch_embed.num_patches + (1 if i == num_stages - 1 else 0)
            setattr(self, f"patch_embed{i + 1}", patch_embed)
            setattr(self, f"pos_embed{i + 1}", nn.Parameter(torch.zeros(1, num_patches, embed_dims[i])))
            setattr(self, f"pos_drop{i + 1}", nn.Dropout(p=drop_rate))
            setattr(self, f"block{i + 1}", nn.ModuleList([
                Block(embed_dims[i], num_heads[i], mlp_ratios[i], qkv_bias, qk_scale, drop_rate,
                      attn_drop_rate, dpr[cur + j], act_layer=act_layer, norm_layer=norm_layer,
                      sr_ratio=sr_ratios[i], linear_layer=linear_layer, conv_layer=conv_layer,
                      sr_norm_layer=sr_norm_layer, matmul_layer=matmul_layer, softmax_layer=softmax_layer,
                      qgroups=qg, fused_attn=fused_attn, attn_impl=attn_impl)
                for j in range(depths[i])]))
            cur += depths[i]
        self.norm = build_layer(norm_layer, self.num_features,
                                quant_groups=qg(self.num_features, self.last_heads, "norm"))
        self.cls_token = nn.Parameter(torch.zeros(1, 1, self.num_features))
        self.head = self._make_head(num_classes)
        # the class token joins at the last stage: its rows there are kept exactly (issue 22.8)
        ms.set_prefix_tokens(getattr(self, f"block{num_stages}"), 1)
        ms.set_prefix_tokens(self.norm, 1)
        self.feature_info = [dict(num_chs=embed_dims[i], reduction=to_2tuple(patch_size)[0] * 2 ** i,
                                  module=f"block{i + 1}") for i in range(num_stages)]
        init_grad_checkpointing([self], grad_checkpointing, grad_checkpointing_bits)

        for i in range(num_stages):
            trunc_normal_(getattr(self, f"pos_embed{i + 1}"), std=.02)
        trunc_normal_(self.cls_token, std=.02)
        self.apply(init_weights)

    @torch.jit.ignore
    def no_weight_decay(self):
        """The class token and the position embeddings (as timm's DeiT / PVT-v2 exclude them)."""
        return {"cls_token"} | {f"pos_embed{i + 1}" for i in range(self.num_stages)}

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False):
        """Parameter groups for timm's layer-wise LR decay: the first patch embedding, then one group
        per block (``coarse``: per stage); the patch embedding and position embedding of stage i > 1
        join that stage's first block (the class token: the last stage's), the final norm the last
        block, the head comes last."""
        last = self.num_stages
        if coarse:
            return dict(stem=r"^patch_embed1\.|^pos_embed1$",
                        blocks=[(r"^(?:block|patch_embed|pos_embed)(\d+)", None), (r"^cls_token", (last,)),
                                (r"^norm", (99999,))])
        return dict(stem=r"^patch_embed1\.|^pos_embed1$",
                    blocks=[(r"^block(\d+)\.(\d+)", None), (r"^(?:patch_embed|pos_embed)(\d+)", (0,)),
                            (r"^cls_token", (last, 0)), (r"^norm", (99999,))])

    @torch.jit.ignore
    def get_classifier(self):
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: str | None = None):
        """A new (randomly initialised) head for ``num_classes`` classes (0: none); ``global_pool``
        'token' (class token), 'avg' (mean of the last stage's patch tokens) or '' (none)."""
        if global_pool is not None:
            self.global_pool = check_global_pool(global_pool)
        self.num_classes = num_classes
        self.head = self._make_head(num_classes)
        self.head.apply(init_weights)

    def _with_pos(self, x, pos_embed: torch.Tensor, grid: Tuple[int, int], H: int, W: int, last: bool):
        """A stage's patch tokens (B, H*W, C) plus its position embedding (resized to H x W); in
        the last stage the class token leads: (B, 1 + H*W, C)."""
        cls_token = self.cls_token
        if last and cls_token is not None:
            x = torch.cat((cls_token.expand(x.shape[0], -1, -1), x), dim=1)
            return x + torch.cat((pos_embed[:, :1], stage_pos_embed(pos_embed[:, 1:], grid, H, W)), dim=1)
        return x + stage_pos_embed(pos_embed, grid, H, W)

    def _stage(self, i: int, x):
        """Stage ``i`` (0-based): image or (B, C, H, W) map -> tokens (B, [1 +] H*W, C_i), H, W
        (the class token leads in the last stage)."""
        patch_embed = getattr(self, f"patch_embed{i + 1}")
        H, W = x.shape[-2] // patch_embed.patch_size[0], x.shape[-1] // patch_embed.patch_size[1]
        x = self._with_pos(patch_embed(x), getattr(self, f"pos_embed{i + 1}"), patch_embed.grid_size, H, W,
                           i == self.num_stages - 1)
        x = getattr(self, f"pos_drop{i + 1}")(x)
        for blk in getattr(self, f"block{i + 1}"):
            x = self.checkpointed(blk, x, H, W)
        return x, H, W

    def _has_cls(self, i: int) -> bool:
        return i == self.num_stages - 1 and self.cls_token is not None

    def forward_features(self, x):
        """(B, 3, H, W) -> the last stage's normed tokens (B, 1 + H/32*W/32, C_4), class token first."""
        if torch.jit.is_scripting():
            return self._forward_features_scripted(x)
        else:
            for i in range(self.num_stages):
                x, H, W = self._stage(i, x)
                if i < self.num_stages - 1:
                    x = tokens_to_nchw(x, H, W)
            return self.norm(x)

    def _forward_features_scripted(self, x):
        """:meth:`forward_features` for TorchScript, which cannot look a module up by a computed
        name (``patch_embed{i}``): the same stages written out; ``hasattr`` skips, at compile time,
        those a pruned model lacks."""
        last = self.num_stages - 1
        H, W = x.shape[-2] // self.patch_embed1.patch_size[0], x.shape[-1] // self.patch_embed1.patch_size[1]
        x = self.pos_drop1(self._with_pos(self.patch_embed1(x), self.pos_embed1, self.patch_embed1.grid_size,
                                          H, W, last == 0))
        for blk in self.block1:
            x = blk(x, H, W)
        if hasattr(self, "block2"):
            x = tokens_to_nchw(x, H, W)
            H, W = x.shape[-2] // self.patch_embed2.patch_size[0], x.shape[-1] // self.patch_embed2.patch_size[1]
            x = self.pos_drop2(self._with_pos(self.patch_embed2(x), self.pos_embed2,
                                              self.patch_embed2.grid_size, H, W, last == 1))
            for blk in self.block2:
                x = blk(x, H, W)
        if hasattr(self, "block3"):
            x = tokens_to_nchw(x, H, W)
            H, W = x.shape[-2] // self.patch_embed3.patch_size[0], x.shape[-1] // self.patch_embed3.patch_size[1]
            x = self.pos_drop3(self._with_pos(self.patch_embed3(x), self.pos_embed3,
                                              self.patch_embed3.grid_size, H, W, last == 2))
            for blk in self.block3:
                x = blk(x, H, W)
        if hasattr(self, "block4"):
            x = tokens_to_nchw(x, H, W)
            H, W = x.shape[-2] // self.patch_embed4.patch_size[0], x.shape[-1] // self.patch_embed4.patch_size[1]
            x = self.pos_drop4(self._with_pos(self.patch_embed4(x), self.pos_embed4,
                                              self.patch_embed4.grid_size, H, W, last == 3))
            for blk in self.block4:
                x = blk(x, H, W)
        return self.norm(x)

    def forward_head(self, x, pre_logits: bool = False):
        """Tokens (B, 1 + N, C) -> logits; ``pre_logits``: the pooled features (B, C)."""
        x = pool_tokens(x, self.global_pool, 1)
        return x if pre_logits else self.head(x)

    def forward(self, x):
        return self.forward_head(self.forward_features(x))

    def forward_intermediates(self, x, indices=None, norm: bool = False, stop_early: bool = False,
                              output_fmt: str = "NCHW", intermediates_only: bool = False):
        """timm's ``forward_intermediates``: the stages in ``indices`` (None: all, int n: the last
        n, a sequence: those) as (B, C_i, H/(4*2^i), W/(4*2^i)) maps (the class token removed);
        ``norm`` applies the final norm to the last stage's. Returns ``(final, intermediates)``
        with ``final`` as :meth:`forward_features` gives it (the tokens of the stage it stopped
        at when ``stop_early``, un-normed), or only the intermediates."""
        check_output_fmt(output_fmt)
        take_indices, max_index = feature_take_indices(self.num_stages, indices)
        last = self.num_stages - 1
        stop = max_index if stop_early else last
        intermediates = []
        for i in range(stop + 1):
            x, H, W = self._stage(i, x)
            if i in take_indices:
                y = self.norm(x) if norm and i == last else x
                intermediates.append(tokens_to_nchw(y[:, 1:] if self._has_cls(i) else y, H, W))
            if i < stop:
                x = tokens_to_nchw(x, H, W)
        if intermediates_only:
            return intermediates
        return (self.norm(x) if stop == last else x), intermediates

    def prune_intermediate_layers(self, indices=1, prune_norm: bool = False, prune_head: bool = True):
        """Drop the stages after the last of ``indices`` (with the class token, final norm and
        head when that is not the last stage); returns the absolute indices kept."""
        take_indices, max_index = feature_take_indices(self.num_stages, indices)
        prune_end = max_index < self.num_stages - 1
        for i in range(max_index + 1, self.num_stages):
            for attr in ("patch_embed", "pos_embed", "pos_drop", "block"):
                delattr(self, f"{attr}{i + 1}")
        if prune_end:
            self.num_stages = max_index + 1
            self.feature_info = self.feature_info[:max_index + 1]
            self.cls_token = None
            ms.set_prefix_tokens(getattr(self, f"block{max_index + 1}"), 0)
            self.num_features = self.head_hidden_size = self.feature_info[max_index]["num_chs"]
        if prune_norm or prune_end:
            self.norm = nn.Identity()
        if prune_head or prune_end:
            self.reset_classifier(0, "")
        return take_indices

    def resize_checkpoint_tensor(self, name: str, value: torch.Tensor):
        """``pos_embed{i}`` of another resolution resized (bicubic) to this model's grids; else None."""
        if not (name.startswith("pos_embed") and name[len("pos_embed"):].isdigit() and value.dim() == 3):
            return None
        i = int(name[len("pos_embed"):])
        if not 1 <= i <= self.num_stages:
            return None
        prefix = 1 if i == self.num_stages else 0
        n = value.shape[1] - prefix
        side = math.isqrt(max(n, 0))
        if side * side != n:
            return None
        return resize_pos_embed(value, getattr(self, f"patch_embed{i}").grid_size, prefix, (side, side))


# timm pretrained_cfg. crop_pct 0.875: whai362/PVT's classification code evaluates as DeiT's does
# (resize int(256 / 224 * 224) = 256, bicubic, center crop 224). forward_features is a token sequence
# (class token + the last stage's 7x7 grid: pool_size); the input size is free (position embeddings
# are interpolated).
_CFG = dict(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225), crop_pct=0.875, interpolation="bicubic",
            first_conv="patch_embed1.proj", classifier="head", input_size=(3, 224, 224), pool_size=(7, 7),
            num_classes=1000,
            fixed_input_size=False, license="apache-2.0", origin_url="https://github.com/whai362/PVT",
            paper_ids="arXiv:2102.12122")
_PVT = "https://github.com/whai362/PVT/releases/download/v2/"
_ARCH = dict(patch_size=4, embed_dims=(64, 128, 320, 512), num_heads=(1, 2, 5, 8), mlp_ratios=(8, 8, 4, 4),
             qkv_bias=True, norm_layer=partial(ms.LayerNorm, eps=1e-6), sr_ratios=(8, 4, 2, 1))


@register_model(family="pvt", cfg=dict(_CFG, url=_PVT + "pvt_tiny.pth"))
def pvt_tiny(**kwargs):
    """PVT-Tiny, depths 2-2-2-2 (13.2M parameters)."""
    return PyramidVisionTransformer(**{**_ARCH, "depths": (2, 2, 2, 2), **kwargs})


@register_model(family="pvt", cfg=dict(_CFG, url=_PVT + "pvt_small.pth"))
def pvt_small(**kwargs):
    """PVT-Small, depths 3-4-6-3 (24.5M parameters)."""
    return PyramidVisionTransformer(**{**_ARCH, "depths": (3, 4, 6, 3), **kwargs})


@register_model(family="pvt", cfg=dict(_CFG, url=_PVT + "pvt_medium.pth"))
def pvt_medium(**kwargs):
    """PVT-Medium, depths 3-4-18-3 (44.2M parameters)."""
    return PyramidVisionTransformer(**{**_ARCH, "depths": (3, 4, 18, 3), **kwargs})


@register_model(family="pvt", cfg=dict(_CFG, url=_PVT + "pvt_large.pth"))
def pvt_large(**kwargs):
    """PVT-Large, depths 3-8-27-3 (61.4M parameters)."""
    return PyramidVisionTransformer(**{**_ARCH, "depths": (3, 8, 27, 3), **kwargs})
