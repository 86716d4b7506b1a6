"""Swin Transformer (Liu et al., 2021) from Mesa layers, with the key layout of
microsoft/Swin-Transformer's checkpoints: ``patch_embed.proj/norm``, ``layers.i.blocks.j.norm1``,
``...attn.relative_position_bias_table``, ``...attn.relative_position_index``, ``...attn.qkv``,
``...attn.proj``, ``...norm2``, ``...mlp.fc1/fc2``, ``...blocks.j.attn_mask`` (shifted blocks),
``layers.i.downsample.reduction/norm`` (at the end of stages 0-2), ``norm``, ``head``.
Mesa modules add quantizer state only, under the names of the original Swin-Mesa demo
(``attn.mm1``, ``attn.mm2``, ``attn.softmax``, ``mlp.act``).

The demo's quantization groups (32 channels per group) are ``quant_group_size=32``; the default
(``quant_groups='heads'``) gives every layer of a block one group per head (head_dim is 32, so the
two differ only for layers whose input is wider than the block: fc2, GELU, patch merging, head).

Shapes: image (B, 3, H, W) -> tokens (B, H/4 * W/4, C) -> ... -> (B, H/32 * W/32, 8C) -> logits.
Windows: (B * nW, ws*ws, C); attention (B * nW, heads, ws*ws, ws*ws).
"""
from __future__ import annotations

import re
from typing import Optional, Tuple

import torch
import torch.nn as nn

import mesa_ops as ms

from .checkpoint import resize_pos_embed, resize_rel_pos_bias_table
from .layers import (AttentionOps, DropPath, Mlp, PatchEmbed, QuantGroups, build_layer, init_weights,
                     PyramidHeadMixin,
                     to_2tuple, trunc_normal_)
from .registry import register_model
from .timm_api import (GradCheckpointing, check_global_pool, check_output_fmt, feature_take_indices,
                       init_grad_checkpointing, run_block, tokens_to_nchw)

__all__ = ["window_partition", "window_reverse", "WindowAttention", "SwinTransformerBlock", "PatchMerging",
           "BasicLayer", "SwinTransformer"]


def window_partition(x, window_size: int):
    """(B, H, W, C) -> (B * H/ws * W/ws, ws, ws, C)."""
    B, H, W, C = x.shape
    x = x.view(B, H // window_size, window_size, W // window_size, window_size, C)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, window_size, window_size, C)


def window_reverse(windows, window_size: int, H: int, W: int):
    """(B * H/ws * W/ws, ws, ws, C) -> (B, H, W, C)."""
    B = windows.shape[0] // ((H // window_size) * (W // window_size))
    x = windows.view(B, H // window_size, W // window_size, window_size, window_size, -1)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(B, H, W, -1)


def relative_position_index(window_size) -> torch.Tensor:
    """(Wh*Ww, Wh*Ww) index into the ((2Wh-1)(2Ww-1), heads) bias table (official construction)."""
    coords = torch.stack(torch.meshgrid([torch.arange(window_size[0]), torch.arange(window_size[1])],
                                        indexing="ij"))
    flat = torch.flatten(coords, 1)
    rel = (flat[:, :, None] - flat[:, None, :]).permute(1, 2, 0).contiguous()
    rel[:, :, 0] += window_size[0] - 1
    rel[:, :, 1] += window_size[1] - 1
    rel[:, :, 0] *= 2 * window_size[1] - 1
    return rel.sum(-1)


class WindowAttention(AttentionOps):
    """Window multi-head self-attention with relative position bias: (B*nW, N, C) -> (B*nW, N, C)."""

    def __init__(self, dim, window_size, num_heads, qkv_bias=True, qk_scale=None, attn_drop=0., proj_drop=0.,
                 linear_layer=ms.Linear, matmul_layer=ms.MatMul, softmax_layer=ms.Softmax,
                 qgroups: QuantGroups = QuantGroups(), fused_attn: bool = True, attn_impl: str = "fused"):
        super().__init__()
        self.dim = dim
        self.window_size = window_size
        self.relative_position_bias_table = nn.Parameter(
            torch.zeros((2 * window_size[0] - 1) * (2 * window_size[1] - 1), num_heads))
        self.register_buffer("relative_position_index", relative_position_index(window_size))
        self.qkv = build_layer(linear_layer, dim, dim * 3, bias=qkv_bias,
                               quant_groups=qgroups(dim, num_heads, "attn.qkv"))
        self.proj = build_layer(linear_layer, dim, dim, quant_groups=qgroups(dim, num_heads, "attn.proj"))
        self.proj_drop = nn.Dropout(proj_drop)
        self.init_attention_ops(num_heads, qk_scale or (dim // num_heads) ** -0.5, attn_drop, matmul_layer,
                                softmax_layer, fused_attn, attn_impl)
        trunc_normal_(self.relative_position_bias_table, std=.02)

    def relative_position_bias(self):
        """(heads, N, N) with N = Wh * Ww."""
        n = self.window_size[0] * self.window_size[1]
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)].view(n, n, -1)
        return bias.permute(2, 0, 1).contiguous()

    def forward(self, x, mask: Optional[torch.Tensor] = None):
        """x (B*nW, N, C); mask (nW, N, N) of 0 / -100 or None."""
        B_, N, C = x.shape
        qkv = self.qkv(x).reshape(B_, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        x = self.attend(q, k, v, bias=self.relative_position_bias(), mask=mask, merge_heads=True)
        x = self.proj(x)
        x = self.proj_drop(x)
        return x

    def extra_repr(self) -> str:
        return f"dim={self.dim}, window_size={self.window_size}, num_heads={self.num_heads}"


class SwinTransformerBlock(nn.Module):
    """(Shifted) window attention + MLP on (B, H*W, C) at a fixed ``input_resolution``.

    ``with_cp`` (mmseg's ``SwinBlock.with_cp``): whether the model running this block (its
    :class:`BasicLayer`, or :class:`models.seg.MesaSwinTransformer`) runs it under activation
    checkpointing while training; per block, so it may be changed on one block after
    construction. ``set_grad_checkpointing`` / ``use_checkpoint`` / the backbone's ``with_cp``
    set it on every block. A policy file's per-block choice (``mesa_checkpoint``) overrides it.
    """

    def __init__(self, dim, input_resolution, num_heads, window_size=7, shift_size=0, mlp_ratio=4.,
                 qkv_bias=True, qk_scale=None, drop=0., attn_drop=0., drop_path=0., act_layer=ms.GELU,
                 norm_layer=ms.LayerNorm, linear_layer=ms.Linear, matmul_layer=ms.MatMul,
                 softmax_layer=ms.Softmax, qgroups: QuantGroups = QuantGroups(), fused_attn: bool = True,
                 attn_impl: str = "fused", with_cp: bool = False):
        super().__init__()
        self.with_cp = bool(with_cp)
        self.dim = dim
        self.input_resolution = input_resolution
        self.num_heads = num_heads
        self.window_size = window_size
        self.shift_size = shift_size
        self.mlp_ratio = mlp_ratio
        if min(self.input_resolution) <= self.window_size:
            # window as large as the input: no partition, no shift (official behaviour)
            self.shift_size = 0
            self.window_size = min(self.input_resolution)
        if not 0 <= self.shift_size < self.window_size:
            raise ValueError(f"shift_size {self.shift_size} must be in [0, window_size={self.window_size})")
        H, W = self.input_resolution
        if H % self.window_size or W % self.window_size:
            raise ValueError(f"input resolution {H}x{W} is not divisible by window_size {self.window_size}; "
                             f"pick img_size / window_size so that each stage's resolution is")

        self.norm1 = build_layer(norm_layer, dim, quant_groups=qgroups(dim, num_heads, "norm1"))
        self.attn = WindowAttention(dim, to_2tuple(self.window_size), num_heads, qkv_bias, qk_scale,
                                    attn_drop, drop, linear_layer=linear_layer, matmul_layer=matmul_layer,
                                    softmax_layer=softmax_layer, qgroups=qgroups, fused_attn=fused_attn,
                                    attn_impl=attn_impl)
        self.drop_path = DropPath(drop_path) if drop_path > 0. else nn.Identity()
        self.norm2 = build_layer(norm_layer, dim, quant_groups=qgroups(dim, num_heads, "norm2"))
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=act_layer, linear_layer=linear_layer, drop=drop,
                       num_heads=num_heads, qgroups=qgroups)
        self.register_buffer("attn_mask", self._attn_mask() if self.shift_size > 0 else None)

    def _attn_mask(self):
        """(nW, N, N): 0 within a shifted window's own region, -100 across regions (official)."""
        H, W = self.input_resolution
        img_mask = torch.zeros((1, H, W, 1))
        slices = (slice(0, -self.window_size), slice(-self.window_size, -self.shift_size),
                  slice(-self.shift_size, None))
        cnt = 0
        for h in slices:
            for w in slices:
                img_mask[:, h, w, :] = cnt
                cnt += 1
        ws = self.window_size
        mask_windows = window_partition(img_mask, ws).view(-1, ws * ws)
        attn_mask = mask_windows.unsqueeze(1) - mask_windows.unsqueeze(2)
        return attn_mask.masked_fill(attn_mask != 0, float(-100.0)).masked_fill(attn_mask == 0, float(0.0))

    def forward(self, x):
        H, W = self.input_resolution
        B, L, C = x.shape
        torch._assert(L == H * W, f"expected {H}x{W} tokens, got {L}")
        shortcut = x
        x = x.view(B, H, W, C)
        if self.shift_size > 0:
            x = torch.roll(x, shifts=(-self.shift_size, -self.shift_size), dims=(1, 2))
        x_windows = window_partition(x, self.window_size).view(-1, self.window_size * self.window_size, C)
        # norm1 per token after the shift and partition (the official order is norm1 first; a
        # LayerNorm of each token is the same either way, bit for bit): the qkv Linear then takes
        # norm1's output as it is and, under Mesa, stores no copy of its own
        x_windows = self.norm1(x_windows)
        attn_windows = self.attn(x_windows, mask=self.attn_mask)
        attn_windows = attn_windows.view(-1, self.window_size, self.window_size, C)
        x = window_reverse(attn_windows, self.window_size, H, W)
        if self.shift_size > 0:
            x = torch.roll(x, shifts=(self.shift_size, self.shift_size), dims=(1, 2))
        x = x.view(B, H * W, C)
        x = shortcut + self.drop_path(x)
        x = x + self.drop_path(self.mlp(self.norm2(x)))
        return x

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, input_resolution={self.input_resolution}, num_heads={self.num_heads}, "
                f"window_size={self.window_size}, shift_size={self.shift_size}, mlp_ratio={self.mlp_ratio}")


class PatchMerging(nn.Module):
    """(B, H*W, C) -> (B, H/2*W/2, 2C): 2x2 neighbours concatenated, ``norm`` (4C), ``reduction``."""

    def __init__(self, input_resolution, dim, norm_layer=ms.LayerNorm, linear_layer=ms.Linear, num_heads=1,
                 qgroups: QuantGroups = QuantGroups()):
        super().__init__()
        self.input_resolution = input_resolution
        self.dim = dim
        self.reduction = build_layer(linear_layer, 4 * dim, 2 * dim, bias=False,
                                     quant_groups=qgroups(4 * dim, num_heads, "downsample.reduction"))
        self.norm = build_layer(norm_layer, 4 * dim,
                                quant_groups=qgroups(4 * dim, num_heads, "downsample.norm"))

    def forward(self, x):
        H, W = self.input_resolution
        B, L, C = x.shape
        torch._assert(H % 2 == 0 and W % 2 == 0 and L == H * W,  # the tensor test last (FX)
                      f"patch merging needs {H}x{W} tokens, an even grid; got {L}")
        x = x.view(B, H, W, C)
        x0, x1 = x[:, 0::2, 0::2, :], x[:, 1::2, 0::2, :]
        x2, x3 = x[:, 0::2, 1::2, :], x[:, 1::2, 1::2, :]
        x = torch.cat([x0, x1, x2, x3], -1)
        x = x.view(B, -1, 4 * C)
        x = self.norm(x)
        x = self.reduction(x)
        return x

    def extra_repr(self) -> str:
        return f"input_resolution={self.input_resolution}, dim={self.dim}"


class BasicLayer(nn.Module):
    """One stage: ``depth`` blocks (shift 0, ws/2, 0, ...) then an optional ``downsample``.

    Checkpointing: each block runs checkpointed when its own ``with_cp`` says so (with the
    stage's ``grad_checkpointing_bits``: None plain, 8/4/2 compressed). ``grad_checkpointing``
    (and the official name ``use_checkpoint``) reads whether any block has ``with_cp``; setting
    ``grad_checkpointing`` sets every block's ``with_cp``.
    """

    # Python-side switches (TorchScript runs the blocks directly)
    __jit_unused_properties__ = ["grad_checkpointing", "use_checkpoint"]

    def __init__(self, dim, input_resolution, depth, num_heads, window_size, mlp_ratio=4., qkv_bias=True,
                 qk_scale=None, drop=0., attn_drop=0., drop_path=0., norm_layer=ms.LayerNorm,
                 act_layer=ms.GELU, linear_layer=ms.Linear, matmul_layer=ms.MatMul, softmax_layer=ms.Softmax,
                 downsample=None,
                 qgroups: QuantGroups = QuantGroups(), fused_attn: bool = True, attn_impl: str = "fused",
                 use_checkpoint: bool = False):
        super().__init__()
        self.dim = dim
        self.input_resolution = input_resolution
        self.depth = depth
        self.blocks = nn.ModuleList([
            SwinTransformerBlock(dim, input_resolution, num_heads, window_size,
                                 0 if i % 2 == 0 else window_size // 2, mlp_ratio, qkv_bias, qk_scale, drop,
                                 attn_drop, drop_path[i] if isinstance(drop_path, (list, tuple))
                                 else drop_path,
                                 act_layer=act_layer, norm_layer=norm_layer, linear_layer=linear_layer,
                                 matmul_layer=matmul_layer, softmax_layer=softmax_layer, qgroups=qgroups,
                                 fused_attn=fused_attn, attn_impl=attn_impl, with_cp=use_checkpoint)
            for i in range(depth)])
        init_grad_checkpointing([self], use_checkpoint, None)
        if downsample is not None:
            self.downsample = downsample(input_resolution, dim=dim, norm_layer=norm_layer,
                                         linear_layer=linear_layer, num_heads=num_heads, qgroups=qgroups)
        else:
            self.downsample = None

    @property
    def grad_checkpointing(self) -> bool:
        """Whether any block of the stage has ``with_cp``."""
        return any(getattr(blk, "with_cp", False) for blk in self.blocks)

    @grad_checkpointing.setter
    def grad_checkpointing(self, enable: bool) -> None:
        for blk in self.blocks:
            blk.with_cp = bool(enable)

    @property
    def use_checkpoint(self) -> bool:  # the official attribute name
        return self.grad_checkpointing

    def forward_blocks(self, x):
        """The stage's blocks, each checkpointed when its ``with_cp`` is set: (B, H*W, C) -> same."""
        for blk in self.blocks:
            if torch.jit.is_scripting():
                x = blk(x)
            else:
                # (a block wrapped from outside, e.g. by mesa_ops.checkpoint.wrap_blocks, has no
                # with_cp: it runs as its wrapper says)
                x = run_block(blk, x, enable=getattr(blk, "with_cp", False), bits=self.grad_checkpointing_bits)
        return x

    def forward(self, x):
        """(B, H*W, C) -> (B, H*W, C), or (B, H/2*W/2, 2C) after ``downsample``."""
        x = self.forward_blocks(x)
        if self.downsample is not None:
            x = self.downsample(x)
        return x


class SwinTransformer(GradCheckpointing, PyramidHeadMixin, nn.Module):
    """Swin classifier (official constructor arguments, plus the layer classes, ``quant_groups``,
    ``quant_group_size`` and ``fused_attn`` as in :class:`models.deit.VisionTransformer`).

    timm's model contract (as timm's Swin): ``forward_features`` -> the normed last-stage map
    (B, H/32, W/32, C), ``output_fmt = 'NHWC'``; ``forward_head(x, pre_logits)`` averages it
    (``global_pool='avg'``, or '' for none) and classifies; ``forward_intermediates`` /
    ``feature_info`` give the four stages as NCHW maps (strides 4, 8, 16, 32);
    ``set_grad_checkpointing(enable, bits)`` checkpoints every block (``use_checkpoint`` is the
    official constructor name of the same switch): it sets every block's ``with_cp``, which each
    block follows (see :class:`BasicLayer`); ``grad_checkpointing`` reads whether any block has it.
    """

    output_fmt = "NHWC"
    __jit_unused_properties__ = ["grad_checkpointing"]  # Python-side (TorchScript runs no checkpointing)

    derived_buffers = ("relative_position_index", "attn_mask")

    def __init__(self, img_size=224, patch_size=4, in_chans=3, num_classes=1000, embed_dim=96,
                 depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24), window_size=7, mlp_ratio=4., qkv_bias=True,
                 qk_scale=None, drop_rate=0., attn_drop_rate=0., drop_path_rate=0.1, norm_layer=ms.LayerNorm,
                 act_layer=ms.GELU, linear_layer=ms.Linear, conv_layer=ms.Conv2d, matmul_layer=ms.MatMul,
                 softmax_layer=ms.Softmax, ape=False, patch_norm=True, use_checkpoint=False,
                 quant_groups="heads", quant_group_size=None, fused_attn=True, attn_impl="fused",
                 global_pool="avg",
                 grad_checkpointing=False, grad_checkpointing_bits=None):
        super().__init__()
        self.num_classes = num_classes
        self.global_pool = check_global_pool(global_pool, ("avg", ""))
        self.num_layers = len(depths)
        self.embed_dim = embed_dim
        self.ape = ape
        self.patch_norm = patch_norm
        self.num_features = self.head_hidden_size = int(embed_dim * 2 ** (self.num_layers - 1))
        self.mlp_ratio = mlp_ratio
        self.window_size = window_size
        self.linear_layer = linear_layer
        self.qgroups = qg = QuantGroups(quant_groups, quant_group_size)
        self.last_heads = num_heads[-1]

        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim,
                                      norm_layer=norm_layer if patch_norm else None, conv_layer=conv_layer,
                                      norm_groups=qg(embed_dim, num_heads[0], "patch_embed.norm"))
        self.patches_resolution = pr = self.patch_embed.grid_size
        if ape:
            self.absolute_pos_embed = nn.Parameter(torch.zeros(1, self.patch_embed.num_patches, embed_dim))
            trunc_normal_(self.absolute_pos_embed, std=.02)
        else:
            self.absolute_pos_embed = None
        self.pos_drop = nn.Dropout(p=drop_rate)

        dpr = torch.linspace(0, drop_path_rate, sum(depths), device="cpu").tolist()
        self.layers = nn.ModuleList()
        for i in range(self.num_layers):
            self.layers.append(BasicLayer(
                int(embed_dim * 2 ** i), (pr[0] // (2 ** i), pr[1] // (2 ** i)), depths[i], num_heads[i],
                window_size, mlp_ratio, qkv_bias, qk_scale, drop_rate, attn_drop_rate,
                dpr[sum(depths[:i]):sum(depths[:i + 1])], norm_layer=norm_layer, act_layer=act_layer,
                linear_layer=linear_layer, matmul_layer=matmul_layer, softmax_layer=softmax_layer,
                downsample=PatchMerging if i < self.num_layers - 1 else None,
                qgroups=qg, fused_attn=fused_attn, attn_impl=attn_impl, use_checkpoint=use_checkpoint))
        # module: the stage's last block (layers.i ends with the patch merging of the official
        # layout), whose output FX / hook feature extraction (feature_cls='fx' / 'hook') return
        self.feature_info = [dict(num_chs=int(embed_dim * 2 ** i), reduction=patch_size * 2 ** i,
                                  module=f"layers.{i}.blocks.{depths[i] - 1}") for i in range(self.num_layers)]
        init_grad_checkpointing(self.layers, use_checkpoint or grad_checkpointing, grad_checkpointing_bits)
        self.norm = build_layer(norm_layer, self.num_features,
                                quant_groups=qg(self.num_features, self.last_heads, "norm"))
        self.head = self._make_head(num_classes)
        self.apply(init_weights)

    def _checkpoint_owners(self):
        return list(self.layers)

    @property
    def grad_checkpointing(self) -> bool:
        return any(layer.grad_checkpointing for layer in self.layers)

    @torch.jit.ignore
    def no_weight_decay(self):
        """The absolute position embedding and every relative position bias table (full names,
        as timm's Swin gives them)."""
        nwd = {n for n, _ in self.named_parameters() if "relative_position_bias_table" in n}
        return nwd | ({"absolute_pos_embed"} if self.ape else set())

    @torch.jit.ignore
    def no_weight_decay_keywords(self):
        return {"relative_position_bias_table"}

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False):
        """Parameter groups for timm's layer-wise LR decay: the patch embedding, one group per block
        (``coarse``: per stage). The official layout ends stage i with its patch merging
        (``layers.i.downsample``); it joins the stage's last block (as the official Swin / SimMIM
        fine-tuning's layer ids do), the final norm joins the last block, the head comes last."""
        return dict(
            stem=r"^patch_embed|^absolute_pos_embed",
            blocks=r"^layers\.(\d+)" if coarse else [
                (r"^layers\.(\d+)\.downsample", (99999,)),
                (r"^layers\.(\d+)\.\w+\.(\d+)", None),
                (r"^norm", (99999,)),
            ])

    @torch.jit.ignore
    def get_classifier(self):
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: str | None = None):
        """A new (randomly initialised) head for ``num_classes`` classes (0: none); ``global_pool``
        'avg' or '' (no pooling: ``forward`` returns the (B, H, W, C) map)."""
        if global_pool is not None:
            self.global_pool = check_global_pool(global_pool, ("avg", ""))
        self.num_classes = num_classes
        self.head = self._make_head(num_classes)
        self.head.apply(init_weights)

    def _embed(self, x):
        x = self.patch_embed(x)
        if self.absolute_pos_embed is not None:  # ape
            x = x + self.absolute_pos_embed
        return self.pos_drop(x)

    def _to_nhwc(self, x, resolution: Tuple[int, int]):
        H, W = resolution
        return x.reshape(x.shape[0], H, W, x.shape[-1])

    def forward_features(self, x):
        """(B, 3, H, W) -> the normed last-stage map (B, H/32, W/32, C) (NHWC, as timm's Swin)."""
        x = self._embed(x)
        for layer in self.layers:
            x = layer(x)
        return self._to_nhwc(self.norm(x), self.layers[-1].input_resolution)

    def forward_head(self, x, pre_logits: bool = False):
        """(B, H, W, C) -> logits; ``pre_logits``: the pooled features (B, C)."""
        if self.global_pool == "avg":
            x = x.mean(dim=(1, 2))
        return x if pre_logits else self.head(x)

    def forward(self, x):
        return self.forward_head(self.forward_features(x))

    def forward_intermediates(self, x, indices=None, norm: bool = False, stop_early: bool = False,
                              output_fmt: str = "NCHW", intermediates_only: bool = False):
        """timm's ``forward_intermediates``: the stages in ``indices`` (None: all four, int n: the
        last n, a sequence: those), each the stage's output before its patch merging as
        (B, C_i, H/(4*2^i), W/(4*2^i)); ``norm`` applies the final norm to the last stage's.

        Returns ``(final, intermediates)`` with ``final`` as :meth:`forward_features` gives it
        (un-normed when ``stop_early`` ends before the last stage), or only the intermediates.
        """
        check_output_fmt(output_fmt)
        take_indices, max_index = feature_take_indices(len(self.layers), indices)
        last = len(self.layers) - 1
        stop = max_index if stop_early else last
        x = self._embed(x)
        intermediates = []
        for i, layer in enumerate(self.layers[:stop + 1]):
            x = layer.forward_blocks(x)
            if i in take_indices:
                y = self.norm(x) if norm and i == last else x
                intermediates.append(tokens_to_nchw(y, *layer.input_resolution))
            if i < stop and layer.downsample is not None:
                x = layer.downsample(x)
        if intermediates_only:
            return intermediates
        if stop == last:
            x = self.norm(x)
        return self._to_nhwc(x, self.layers[stop].input_resolution), intermediates

    def prune_intermediate_layers(self, indices=1, prune_norm: bool = False, prune_head: bool = True):
        """Keep the stages up to the last of ``indices`` (its patch merging goes, and with it the
        final norm and head when it is not the last stage); returns the absolute indices."""
        take_indices, max_index = feature_take_indices(len(self.layers), indices)
        prune_end = max_index < len(self.layers) - 1
        self.layers = self.layers[:max_index + 1]
        self.feature_info = self.feature_info[:max_index + 1]
        if prune_end:
            self.layers[-1].downsample = None
            self.num_features = self.head_hidden_size = self.feature_info[max_index]["num_chs"]
        if prune_norm or prune_end:
            self.norm = nn.Identity()
        if prune_head or prune_end:
            self.reset_classifier(0, "")
        return take_indices

    def checkpoint_filter(self, sd: dict) -> dict:
        """A state dict in timm's Swin layout (timm's ``swin_*`` models and their hub
        ``model.safetensors``: each stage's patch merging at the start of the next stage,
        ``layers.{i}.downsample``, the classifier ``head.fc``) -> the official layout this model
        has (``layers.{i-1}.downsample``, ``head``); any other state dict is returned as it is."""
        last = len(self.layers) - 1
        if not any(k.startswith(("head.fc.", f"layers.{last}.downsample.")) for k in sd):
            return sd
        return _relayout(sd, -1, "head.fc.", "head.")

    def timm_layout(self, sd: dict) -> dict:
        """This model's state dict (official layout) -> timm's Swin layout (the inverse of
        :meth:`checkpoint_filter`), without the buffers timm derives (``derived_buffers``)."""
        kept = {k: v for k, v in sd.items() if k.rsplit(".", 1)[-1] not in self.derived_buffers}
        return _relayout(kept, +1, "head.", "head.fc.")

    def resize_checkpoint_tensor(self, name: str, value: torch.Tensor):
        """A relative position table of another window, resized to this block's; else None."""
        if name.endswith("relative_position_bias_table") and value.dim() == 2:
            attn = self.get_submodule(name.rsplit(".", 1)[0])
            if value.shape[1] == attn.num_heads:
                return resize_rel_pos_bias_table(value, attn.window_size)
        if name == "absolute_pos_embed" and self.ape:
            return resize_pos_embed(value, self.patches_resolution, 0)
        return None


def _relayout(sd: dict, shift: int, head_from: str, head_to: str) -> dict:
    """``sd`` with each ``layers.{i}.downsample.*`` key moved to stage ``i + shift`` and the
    ``head_from`` prefix renamed ``head_to`` (Swin's official <-> timm layouts)."""
    out = {}
    for k, v in sd.items():
        m = re.match(r"layers\.(\d+)\.downsample\.(.*)", k)
        if m:
            k = f"layers.{int(m.group(1)) + shift}.downsample.{m.group(2)}"
        elif k.startswith(head_from):
            k = head_to + k[len(head_from):]
        out[k] = v
    return out


# timm pretrained_cfg: crop_pct 0.9 at 224 px (timm's Swin value), no crop at 384 px (TEST.CROP False in
# the official config); forward_features is the last stage's (H/32, W/32) map: pool_size.
_CFG = dict(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225), crop_pct=0.9, interpolation="bicubic",
            first_conv="patch_embed.proj", classifier="head", input_size=(3, 224, 224), pool_size=(7, 7),
            num_classes=1000, fixed_input_size=True, license="mit",
            origin_url="https://github.com/microsoft/Swin-Transformer", paper_ids="arXiv:2103.14030")
_SWIN = "https://github.com/SwinTransformer/storage/releases/download/v1.0.0/"
# drop_path_rate: the official ImageNet-1k training configs (configs/swin/*.yaml DROP_PATH_RATE):
# T 0.2, S 0.3, B 0.5, B-384 fine-tuning 0.5.


@register_model(family="swin", cfg=dict(_CFG, url=_SWIN + "swin_tiny_patch4_window7_224.pth"))
def swin_tiny_patch4_window7_224(**kwargs):
    """Swin-T, window 7, 224px (28.29M parameters), drop path 0.2."""
    return SwinTransformer(**{**dict(patch_size=4, window_size=7, embed_dim=96, depths=(2, 2, 6, 2),
                                     num_heads=(3, 6, 12, 24), drop_path_rate=0.2), **kwargs})


@register_model(family="swin", cfg=dict(_CFG, url=_SWIN + "swin_small_patch4_window7_224.pth"))
def swin_small_patch4_window7_224(**kwargs):
    """Swin-S, window 7, 224px (49.61M parameters), drop path 0.3."""
    return SwinTransformer(**{**dict(patch_size=4, window_size=7, embed_dim=96, depths=(2, 2, 18, 2),
                                     num_heads=(3, 6, 12, 24), drop_path_rate=0.3), **kwargs})


@register_model(family="swin", cfg=dict(_CFG, url=_SWIN + "swin_base_patch4_window7_224.pth"))
def swin_base_patch4_window7_224(**kwargs):
    """Swin-B, window 7, 224px (87.77M parameters), drop path 0.5."""
    return SwinTransformer(**{**dict(patch_size=4, window_size=7, embed_dim=128, depths=(2, 2, 18, 2),
                                     num_heads=(4, 8, 16, 32), drop_path_rate=0.5), **kwargs})


@register_model(family="swin", cfg=dict(_CFG, url=_SWIN + "swin_base_patch4_window12_384.pth",
                                        input_size=(3, 384, 384), pool_size=(12, 12), crop_pct=1.0))
def swin_base_patch4_window12_384(**kwargs):
    """Swin-B, window 12, 384px (87.90M parameters), drop path 0.5."""
    return SwinTransformer(**{**dict(img_size=384, patch_size=4, window_size=12, embed_dim=128,
                                     depths=(2, 2, 18, 2), num_heads=(4, 8, 16, 32), drop_path_rate=0.5),
                              **kwargs})
