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

import torch
import torch.nn as nn
import torch.nn.functional as F

import mesa_ops as ms

from .checkpoint import resize_pos_embed
from .layers import (AttentionOps, PatchEmbed, QuantGroups, build_layer, init_prenorm_block,
                     init_weights, PyramidHeadMixin, trunc_normal_)
from .registry import register_model

__all__ = ["SRAttention", "Block", "PyramidVisionTransformer"]


class SRAttention(AttentionOps):
    """Spatial-reduction attention: queries from all N = H*W tokens, keys / values from the
    tokens reduced by a stride-``sr_ratio`` conv ``sr`` + ``norm``: (B, N, C) -> (B, N, C)."""

    def __init__(self, dim, num_heads=8, qkv_bias=False, qk_scale=None, attn_drop=0., proj_drop=0.,
                 sr_ratio=1, linear_layer=ms.Linear, conv_layer=ms.Conv2d, sr_norm_layer=ms.LayerNorm,
                 matmul_layer=ms.MatMul, softmax_layer=ms.Softmax, qgroups: QuantGroups = QuantGroups(),
                 fused_attn: bool = True):
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
                                softmax_layer, fused_attn)

    def forward(self, x, H, W):
        B, N, C = x.shape
        h = self.num_heads
        q = self.q(x).reshape(B, N, h, C // h).permute(0, 2, 1, 3)
        if self.sr_ratio > 1:
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
                 fused_attn: bool = True):
        super().__init__()
        init_prenorm_block(
            self, dim, num_heads,
            lambda: SRAttention(dim, num_heads, qkv_bias, qk_scale, attn_drop, drop, sr_ratio,
                                linear_layer=linear_layer, conv_layer=conv_layer,
                                sr_norm_layer=sr_norm_layer, matmul_layer=matmul_layer,
                                softmax_layer=softmax_layer, qgroups=qgroups, fused_attn=fused_attn),
            mlp_ratio, drop, drop_path, act_layer, norm_layer, linear_layer, qgroups)

    def forward(self, x, H, W):
        x = x + self.drop_path(self.attn(self.norm1(x), H, W))
        x = x + self.drop_path(self.mlp(self.norm2(x)))
        return x


class PyramidVisionTransformer(PyramidHeadMixin, nn.Module):
    """PVT v1 classifier. ``norm_layer`` is the blocks' and final norm (eps 1e-6 in the official
    models); ``sr_norm_layer`` the norm of the patch embeddings and of the spatial reduction (plain
    LayerNorm, eps 1e-5, in the official code). Other arguments as in
    :class:`models.deit.VisionTransformer`."""

    def __init__(self, img_size=224, patch_size=16, in_chans=3, num_classes=1000,
                 embed_dims=(64, 128, 256, 512), num_heads=(1, 2, 4, 8), mlp_ratios=(4, 4, 4, 4),
                 qkv_bias=False, qk_scale=None, drop_rate=0.,
                 attn_drop_rate=0., drop_path_rate=0., norm_layer=ms.LayerNorm, depths=(3, 4, 6, 3),
                 sr_ratios=(8, 4, 2, 1), num_stages=4, act_layer=ms.GELU, linear_layer=ms.Linear,
                 conv_layer=ms.Conv2d, sr_norm_layer=ms.LayerNorm, matmul_layer=ms.MatMul,
                 softmax_layer=ms.Softmax, quant_groups="heads", quant_group_size=None, fused_attn=True):
        super().__init__()
        self.num_classes = num_classes
        self.depths = depths
        self.num_stages = num_stages
        self.embed_dims = embed_dims
        self.num_features = embed_dims[num_stages - 1]
        self.linear_layer = linear_layer
        self.qgroups = qg = QuantGroups(quant_groups, quant_group_size)
        self.last_heads = num_heads[num_stages - 1]

        dpr = [x.item() for x in torch.linspace(0, drop_path_rate, sum(depths))]
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
                      qgroups=qg, fused_attn=fused_attn)
                for j in range(depths[i])]))
            cur += depths[i]
        self.norm = build_layer(norm_layer, self.num_features,
                                quant_groups=qg(self.num_features, self.last_heads, "norm"))
        self.cls_token = nn.Parameter(torch.zeros(1, 1, self.num_features))
        self.head = self._make_head(num_classes)

        for i in range(num_stages):
            trunc_normal_(getattr(self, f"pos_embed{i + 1}"), std=.02)
        trunc_normal_(self.cls_token, std=.02)
        self.apply(init_weights)

    @torch.jit.ignore
    def no_weight_decay(self):
        return {"cls_token"}

    @staticmethod
    def _get_pos_embed(pos_embed, patch_embed, H, W):
        """(1, h*w, C) of the stage's built grid -> (1, H*W, C) (bilinear when they differ)."""
        if (H, W) == patch_embed.grid_size:
            return pos_embed
        gh, gw = patch_embed.grid_size
        return F.interpolate(pos_embed.reshape(1, gh, gw, -1).permute(0, 3, 1, 2), size=(H, W),
                             mode="bilinear").reshape(1, -1, H * W).permute(0, 2, 1)

    def forward_features(self, x):
        """(B, 3, H, W) -> the normed class token (B, C_4)."""
        B = x.shape[0]
        for i in range(self.num_stages):
            patch_embed = getattr(self, f"patch_embed{i + 1}")
            pos_embed = getattr(self, f"pos_embed{i + 1}")
            H, W = x.shape[-2] // patch_embed.patch_size[0], x.shape[-1] // patch_embed.patch_size[1]
            x = patch_embed(x)
            if i == self.num_stages - 1:
                x = torch.cat((self.cls_token.expand(B, -1, -1), x), dim=1)
                grid = self._get_pos_embed(pos_embed[:, 1:], patch_embed, H, W)
                pos_embed = torch.cat((pos_embed[:, :1], grid), dim=1)
            else:
                pos_embed = self._get_pos_embed(pos_embed, patch_embed, H, W)
            x = getattr(self, f"pos_drop{i + 1}")(x + pos_embed)
            for blk in getattr(self, f"block{i + 1}"):
                x = blk(x, H, W)
            if i != self.num_stages - 1:
                x = x.reshape(B, H, W, -1).permute(0, 3, 1, 2).contiguous()
        x = self.norm(x)
        return x[:, 0]

    def forward(self, x):
        return self.head(self.forward_features(x))

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


_CFG = dict(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225), crop_pct=0.875, interpolation="bicubic",
            first_conv="patch_embed1.proj", classifier="head", input_size=(3, 224, 224))
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
