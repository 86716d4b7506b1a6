"""DeiT (Touvron et al., 2021) from Mesa layers, with the key layout of the official checkpoints
(facebookresearch/deit): ``patch_embed.proj``, ``cls_token``, ``pos_embed``, ``blocks.N.norm1``,
``blocks.N.attn.qkv``, ``blocks.N.attn.proj``, ``blocks.N.norm2``, ``blocks.N.mlp.fc1/fc2``,
``norm``, ``head`` and, distilled, ``dist_token``, ``head_dist``. Mesa modules add only quantizer
state (``clip_val``, ``shift``, ``iteration``; ``attn.mm1/mm2/softmax.quant1/quant2.*``), under
the names of the original Mesa DeiT demo.

Shapes: image (B, 3, H, W) -> tokens (B, 1 [+1] + N, C) -> logits (B, num_classes).
"""
from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn as nn

import mesa_ops as ms

from .checkpoint import resize_pos_embed
from .layers import (Attention, PatchEmbed, QuantGroups, build_layer, init_prenorm_block,
                     init_weights, make_head, trunc_normal_)
from .registry import register_model
from .timm_api import (GradCheckpointing, check_global_pool, check_output_fmt, feature_take_indices,
                       init_grad_checkpointing, pool_tokens, tokens_to_nchw)

__all__ = ["Block", "VisionTransformer"]

_DEIT = "https://dl.fbaipublicfiles.com/deit/"


class Block(nn.Module):
    """Pre-norm Transformer block on (B, N, C): x + attn(norm1(x)); x + mlp(norm2(x))."""

    def __init__(self, dim, num_heads, mlp_ratio=4., qkv_bias=False, qk_scale=None, drop=0., attn_drop=0.,
                 drop_path=0., act_layer=ms.GELU, norm_layer=ms.LayerNorm, linear_layer=ms.Linear,
                 matmul_layer=ms.MatMul, softmax_layer=ms.Softmax, qgroups: QuantGroups = QuantGroups(),
                 fused_attn: bool = True, attn_impl: str = "fused"):
        super().__init__()
        init_prenorm_block(
            self, dim, num_heads,
            lambda: Attention(dim, num_heads=num_heads, qkv_bias=qkv_bias, qk_scale=qk_scale,
                              attn_drop=attn_drop, proj_drop=drop, linear_layer=linear_layer,
                              matmul_layer=matmul_layer, softmax_layer=softmax_layer,
                              qgroups=qgroups, fused_attn=fused_attn, attn_impl=attn_impl),
            mlp_ratio, drop, drop_path, act_layer, norm_layer, linear_layer, qgroups)

    def forward(self, x):
        x = x + self.drop_path(self.attn(self.norm1(x)))
        x = x + self.drop_path(self.mlp(self.norm2(x)))
        return x


class VisionTransformer(GradCheckpointing, nn.Module):
    """ViT / DeiT classifier; ``distilled=True`` adds DeiT's distillation token and head.

    The distilled model returns ``(head(cls), head_dist(dist))`` in training mode and their mean
    in eval mode, as the official code does.

    timm's model contract: ``forward_features`` -> normed tokens (B, P + N, C) (P prefix tokens),
    ``forward_head(x, pre_logits)`` pools (``global_pool``: 'token', 'avg' over the patch tokens,
    or '' for none) and classifies; ``forward_intermediates`` / ``feature_info`` give the blocks'
    outputs (reduction = patch size), ``set_grad_checkpointing`` checkpoints each block.

    Args (beyond the usual ViT ones):
        norm_layer, act_layer, linear_layer, conv_layer, matmul_layer, softmax_layer: layer classes
            (Mesa layers by default; plain ``nn`` classes also work).
        quant_groups, quant_group_size: Mesa groups of Linear / LayerNorm / GELU (see
            :class:`models.layers.QuantGroups`); attention always quantizes head-wise.
        fused_attn: use ``F.scaled_dot_product_attention`` while Mesa does not compress attention.
        attn_impl: with Mesa on, 'fused' (default) compresses attention as ms.SDPA (q, k, v, out
            stored packed, no N x N matrix); 'explicit' as q@k, softmax, attn@v (the paper).
        global_pool: 'token' (class token, the default), 'avg' or ''.
        grad_checkpointing, grad_checkpointing_bits: initial :meth:`set_grad_checkpointing` mode.
    """

    def __init__(self, img_size=224, patch_size=16, in_chans=3, num_classes=1000, embed_dim=768, depth=12,
                 num_heads=12, mlp_ratio=4., qkv_bias=True, qk_scale=None, drop_rate=0., attn_drop_rate=0.,
                 drop_path_rate=0., distilled=False, norm_layer=partial(ms.LayerNorm, eps=1e-6),
                 act_layer=ms.GELU, linear_layer=ms.Linear, conv_layer=ms.Conv2d, matmul_layer=ms.MatMul,
                 softmax_layer=ms.Softmax, quant_groups="heads", quant_group_size=None, fused_attn=True,
                 attn_impl="fused",
                 global_pool="token", grad_checkpointing=False, grad_checkpointing_bits=None):
        super().__init__()
        self.num_classes = num_classes
        self.global_pool = check_global_pool(global_pool)
        self.num_features = self.head_hidden_size = self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.distilled = distilled
        self.num_prefix_tokens = 2 if distilled else 1
        self.linear_layer = linear_layer
        self.qgroups = qg = QuantGroups(quant_groups, quant_group_size)

        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim, conv_layer=conv_layer)
        num_patches = self.patch_embed.num_patches
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.dist_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if distilled else None
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches + self.num_prefix_tokens, embed_dim))
        self.pos_drop = nn.Dropout(p=drop_rate)

        dpr = torch.linspace(0, drop_path_rate, depth, device="cpu").tolist()
        self.blocks = nn.ModuleList([
            Block(embed_dim, num_heads, mlp_ratio, qkv_bias, qk_scale, drop_rate, attn_drop_rate, dpr[i],
                  act_layer=act_layer, norm_layer=norm_layer, linear_layer=linear_layer,
                  matmul_layer=matmul_layer, softmax_layer=softmax_layer, qgroups=qg, fused_attn=fused_attn,
                  attn_impl=attn_impl)
            for i in range(depth)])
        self.feature_info = [dict(module=f"blocks.{i}", num_chs=embed_dim,
                                  reduction=self.patch_embed.patch_size[0]) for i in range(depth)]
        init_grad_checkpointing([self], grad_checkpointing, grad_checkpointing_bits)
        self.norm = build_layer(norm_layer, embed_dim, quant_groups=qg(embed_dim, num_heads, "norm"))
        self.head = self._make_head(num_classes)
        self.head_dist = self._make_head(num_classes) if distilled else None
        # the class (and distillation) token rows of every stored token tensor are kept exactly
        # (one range per channel group over all tokens stores them badly: issue 22.8)
        ms.policy.mark_prefix_tokens(self)

        trunc_normal_(self.pos_embed, std=.02)
        trunc_normal_(self.cls_token, std=.02)
        if distilled:
            trunc_normal_(self.dist_token, std=.02)
        self.apply(init_weights)

    def _make_head(self, num_classes):
        return make_head(self.linear_layer, self.embed_dim, num_classes, self.qgroups, self.num_heads)

    @torch.jit.ignore
    def no_weight_decay(self):
        return {"pos_embed", "cls_token", "dist_token"}

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False):
        """Parameter groups for timm's layer-wise LR decay: the embeddings, one group per block
        (the final norm with the last block), the head(s) last."""
        return dict(stem=r"^cls_token|^dist_token|^pos_embed|^patch_embed",
                    blocks=[(r"^blocks\.(\d+)", None), (r"^norm", (99999,))])

    @torch.jit.ignore
    def get_classifier(self):
        return (self.head, self.head_dist) if self.distilled else self.head

    def reset_classifier(self, num_classes: int, global_pool: str | None = None):
        """New (randomly initialised) head(s) for ``num_classes`` classes (0: none, the pooled
        features come out); ``global_pool`` as in the constructor."""
        self.num_classes = num_classes
        if global_pool is not None:
            self.global_pool = check_global_pool(global_pool)
        self.head = self._make_head(num_classes)
        if self.distilled:
            self.head_dist = self._make_head(num_classes)
        for h in (self.head, self.head_dist):
            if h is not None:
                h.apply(init_weights)

    def _embed(self, x):
        x = self.patch_embed(x)
        B = x.shape[0]
        prefix = [self.cls_token.expand(B, -1, -1)]
        if self.dist_token is not None:
            prefix.append(self.dist_token.expand(B, -1, -1))
        x = torch.cat(prefix + [x], dim=1)
        return self.pos_drop(x + self.pos_embed)

    def forward_features(self, x):
        """(B, 3, H, W) -> normed tokens (B, P + N, C), P = 1 (2 distilled) prefix tokens."""
        x = self._embed(x)
        for blk in self.blocks:
            if torch.jit.is_scripting():
                x = blk(x)
            else:
                x = self.checkpointed(blk, x)
        return self.norm(x)

    def forward_head(self, x, pre_logits: bool = False):
        """Tokens (B, P + N, C) -> logits (B, classes); ``pre_logits``: the pooled features.
        Distilled with ``global_pool='token'``: class and distillation heads, their mean in eval
        mode (and for ``pre_logits``), both in training mode."""
        if self.head_dist is not None and self.global_pool == "token":  # distilled
            x, x_dist = x[:, 0], x[:, 1]
            if pre_logits:
                return (x + x_dist) / 2
            x, x_dist = self.head(x), self.head_dist(x_dist)
            if self.training and not torch.jit.is_scripting():
                return x, x_dist
            return (x + x_dist) / 2
        x = pool_tokens(x, self.global_pool, self.num_prefix_tokens)
        return x if pre_logits else self.head(x)

    def forward(self, x):
        return self.forward_head(self.forward_features(x))

    def forward_intermediates(self, x, indices=None, return_prefix_tokens: bool = False, norm: bool = False,
                              stop_early: bool = False, output_fmt: str = "NCHW",
                              intermediates_only: bool = False):
        """timm's ``forward_intermediates``: the outputs of the blocks in ``indices`` (None: all,
        int n: the last n, a sequence: those, negative from the end).

        Returns ``(final, intermediates)`` (``final`` as :meth:`forward_features` gives it), or
        only the intermediates: each (B, C, H/p, W/p) for ``output_fmt='NCHW'`` or (B, N, C)
        for 'NLC', the prefix tokens removed (``return_prefix_tokens``: (patch, prefix) pairs);
        ``norm`` applies the final norm to each.
        """
        check_output_fmt(output_fmt, ("NCHW", "NLC"))
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        B = x.shape[0]
        x = self._embed(x)
        blocks = self.blocks if torch.jit.is_scripting() or not stop_early else self.blocks[:max_index + 1]
        intermediates = []
        for i, blk in enumerate(blocks):
            x = self.checkpointed(blk, x)
            if i in take_indices:
                intermediates.append(self.norm(x) if norm else x)
        p = self.num_prefix_tokens
        prefix = [y[:, :p] for y in intermediates]
        intermediates = [y[:, p:] for y in intermediates]
        if output_fmt == "NCHW":
            H, W = self.patch_embed.grid_size
            intermediates = [tokens_to_nchw(y, H, W) for y in intermediates]
        if return_prefix_tokens:
            intermediates = list(zip(intermediates, prefix))
        if intermediates_only:
            return intermediates
        return self.norm(x), intermediates

    def prune_intermediate_layers(self, indices=1, prune_norm: bool = False, prune_head: bool = True):
        """Drop the blocks after the last of ``indices`` (and the norm / head if asked); returns the
        absolute indices kept (timm's FeatureGetterNet calls this for ``features_only``)."""
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        self.blocks = self.blocks[:max_index + 1]
        self.feature_info = self.feature_info[:max_index + 1]
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            self.reset_classifier(0, "")
        return take_indices

    # checkpoint loading (models.checkpoint.load_checkpoint)
    def resize_checkpoint_tensor(self, name: str, value: torch.Tensor):
        """``pos_embed`` of another resolution resized bicubically to this one; else None."""
        if name != "pos_embed" or value.dim() != 3 or value.shape[-1] != self.pos_embed.shape[-1]:
            return None
        n = value.shape[1] - self.num_prefix_tokens
        side = math.isqrt(max(n, 0))
        if side * side != n:
            return None
        return resize_pos_embed(value, self.patch_embed.grid_size, self.num_prefix_tokens, (side, side))


# timm pretrained_cfg (the official evaluation: resize 256 -> center crop 224, i.e. crop_pct 0.875;
# 384 px models: no crop). forward_features is a token sequence: no pool_size.
_CFG = dict(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225), crop_pct=0.875, interpolation="bicubic",
            first_conv="patch_embed.proj", classifier="head", input_size=(3, 224, 224), num_classes=1000,
            fixed_input_size=True, license="apache-2.0",
            origin_url="https://github.com/facebookresearch/deit",
            paper_ids="arXiv:2012.12877")
_CFG_384 = dict(_CFG, input_size=(3, 384, 384), crop_pct=1.0)
_DIST = dict(classifier=("head", "head_dist"))
_register = partial(register_model, family="deit", out_indices=3)  # timm ViT's features_only default
_TI = dict(patch_size=16, embed_dim=192, depth=12, num_heads=3, mlp_ratio=4, qkv_bias=True)
_S = dict(patch_size=16, embed_dim=384, depth=12, num_heads=6, mlp_ratio=4, qkv_bias=True)
_B = dict(patch_size=16, embed_dim=768, depth=12, num_heads=12, mlp_ratio=4, qkv_bias=True)


@_register(cfg=dict(_CFG, url=_DEIT + "deit_tiny_patch16_224-a1311bcf.pth"))
def deit_tiny_patch16_224(**kwargs):
    """DeiT-Ti/16, 224px (5.72M parameters)."""
    return VisionTransformer(**{**_TI, **kwargs})


@_register(cfg=dict(_CFG, url=_DEIT + "deit_small_patch16_224-cd65a155.pth"))
def deit_small_patch16_224(**kwargs):
    """DeiT-S/16, 224px (22.05M parameters)."""
    return VisionTransformer(**{**_S, **kwargs})


@_register(cfg=dict(_CFG, url=_DEIT + "deit_base_patch16_224-b5f2ef4d.pth"))
def deit_base_patch16_224(**kwargs):
    """DeiT-B/16, 224px (86.57M parameters)."""
    return VisionTransformer(**{**_B, **kwargs})


@_register(cfg=dict(_CFG_384, url=_DEIT + "deit_base_patch16_384-8de9b5d1.pth"))
def deit_base_patch16_384(**kwargs):
    """DeiT-B/16, 384px (86.86M parameters)."""
    return VisionTransformer(**{**_B, "img_size": 384, **kwargs})


@_register(cfg=dict(_CFG, **_DIST, url=_DEIT + "deit_tiny_distilled_patch16_224-b40b3cf7.pth"))
def deit_tiny_distilled_patch16_224(**kwargs):
    """DeiT-Ti/16 with distillation token, 224px."""
    return VisionTransformer(**{**_TI, "distilled": True, **kwargs})


@_register(cfg=dict(_CFG, **_DIST, url=_DEIT + "deit_small_distilled_patch16_224-649709d9.pth"))
def deit_small_distilled_patch16_224(**kwargs):
    """DeiT-S/16 with distillation token, 224px."""
    return VisionTransformer(**{**_S, "distilled": True, **kwargs})


@_register(cfg=dict(_CFG, **_DIST, url=_DEIT + "deit_base_distilled_patch16_224-df68dfff.pth"))
def deit_base_distilled_patch16_224(**kwargs):
    """DeiT-B/16 with distillation token, 224px."""
    return VisionTransformer(**{**_B, "distilled": True, **kwargs})


@_register(cfg=dict(_CFG_384, **_DIST, url=_DEIT + "deit_base_distilled_patch16_384-d0272ac0.pth"))
def deit_base_distilled_patch16_384(**kwargs):
    """DeiT-B/16 with distillation token, 384px."""
    return VisionTransformer(**{**_B, "img_size": 384, "distilled": True, **kwargs})
