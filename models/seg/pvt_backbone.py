"""MesaPVT: mmdet's ``PyramidVisionTransformer`` (PVT v1) backbone contract on this repo's Mesa PVT.

mmseg 1.2.2 has no PVT v1; mmdet's is the OpenMMLab one (``mmdet.models.backbones.pvt``). Same
constructor (names, defaults, argument checks), plus ``ms_policy``, ``with_cp`` / ``with_cp_bits``,
``frozen_stages``, ``norm_eval``, ``img_size`` and ``arch`` ('tiny' / 'small' / 'medium' /
'large' shorthand for ``num_layers``). Stage i gives (B, embed_dims * num_heads[i], H_i, W_i)
with H_i = floor(H / 4 / 2^i) (the stride-4 / stride-2 patch embeddings, no padding), for any
input size (position embeddings interpolated bilinearly, as mmdet and the PVT code).

Parameter names are the official PVT checkpoints' (under ``body.``: ``patch_embed{i}``,
``pos_embed{i}``, ``block{i}.j.attn.q`` ...), so the paper's ImageNet checkpoints load (class
token, final norm and classifier skipped; stage 4 uses ``pos_embed4[:, 1:]``). Position
embeddings are built at ``img_size`` (default ``pretrain_img_size``; the PVT segmentation configs
use the crop size, a 224 px checkpoint's embeddings are then resized bicubically on loading).

``norm_cfg`` is the blocks' norm (eps 1e-6 by default, as mmdet and the PVT code) and that of
``norm_after_stage``; the patch embeddings' and spatial reductions' norms are those of the PVT
code (LayerNorm, eps 1e-5) so the paper's checkpoints compute what they computed (mmdet builds
these from ``norm_cfg`` too). Not in this PVT v1: overlapping patch embeddings
(``patch_sizes != strides``, ``paddings``) and ``use_conv_ffn`` (PVT v2): they raise ValueError;
mmdet's / timm's PVT v2 gets Mesa through ``dict(type='MesaCompressed', backbone=...)``.
"""
from __future__ import annotations

import torch.nn as nn

import mesa_ops as ms
from mmengine.logging import print_log
from mmseg.registry import MODELS

from ..pvt import PyramidVisionTransformer, stage_pos_embed
from .base import (MesaBackbone, apply_arch, check_act_cfg, freeze, layer_norm_factory,
                   reject_legacy_kwargs, to_size2)

__all__ = ["MesaPVT", "PVT_ARCHS"]

PVT_ARCHS = {"tiny": dict(num_layers=[2, 2, 2, 2]), "small": dict(num_layers=[3, 4, 6, 3]),
             "medium": dict(num_layers=[3, 4, 18, 3]), "large": dict(num_layers=[3, 8, 27, 3])}


@MODELS.register_module()
class MesaPVT(MesaBackbone):
    """PVT v1 backbone: (B, in_channels, H, W) -> maps (B, C_i, H_i, W_i) for ``out_indices``.

    Args (mmdet's PyramidVisionTransformer, same defaults; the default is PVT-Small):
        pretrain_img_size: int or tuple (a 3-tuple: AssertionError, as mmdet).
        in_channels, embed_dims (an int: stage i has embed_dims * num_heads[i] channels),
        num_stages, num_layers, num_heads, patch_sizes, strides, paddings, sr_ratios,
        out_indices, mlp_ratios, qkv_bias, drop_rate, attn_drop_rate, drop_path_rate,
        use_abs_pos_embed, norm_after_stage, use_conv_ffn, act_cfg, norm_cfg, pretrained,
        convert_weights, init_cfg: as mmdet (see the module docstring for what is not supported).
    Extras:
        ms_policy: as :class:`~models.seg.MesaSwinTransformer` (``configs/mesa/pvt_8bit.txt``).
        with_cp, with_cp_bits: the initial ``with_cp`` of every block (``body.block{i}[j].with_cp``)
            and the checkpoint kind (None plain / 8, 4, 2 compressed); each block runs
            checkpointed while its ``with_cp`` is True (see :mod:`models.seg.base`).
        frozen_stages: -1 none; 0 the first patch embedding and position embedding; k also the
            blocks of stages 1..k and the patch / position embeddings of stages 2..k (mmseg's
            convention: a frozen stage is eval mode and ``requires_grad=False``).
        norm_eval: every LayerNorm in eval mode while training (mmseg's ViT / BEiT). With Mesa,
            a Mesa LayerNorm in eval mode is the plain one: it stores its input exact.
        img_size: the position embeddings' build size (default ``pretrain_img_size``).
        arch: None, or 'tiny' / 'small' / 'medium' / 'large' (sets ``num_layers``).
        quant_groups, quant_group_size, attn_impl: of :class:`models.pvt.PyramidVisionTransformer`.
    """

    def __init__(self, pretrain_img_size=224, in_channels=3, embed_dims=64, num_stages=4,
                 num_layers=[3, 4, 6, 3], num_heads=[1, 2, 5, 8], patch_sizes=[4, 2, 2, 2],
                 strides=[4, 2, 2, 2], paddings=[0, 0, 0, 0], sr_ratios=[8, 4, 2, 1], out_indices=(0, 1, 2, 3),
                 mlp_ratios=[8, 8, 4, 4], qkv_bias=True, drop_rate=0., attn_drop_rate=0., drop_path_rate=0.1,
                 use_abs_pos_embed=True, norm_after_stage=False, use_conv_ffn=False, act_cfg=dict(type="GELU"),
                 norm_cfg=dict(type="LN", eps=1e-6), pretrained=None, convert_weights=True, init_cfg=None,
                 *, ms_policy=None, with_cp=False, with_cp_bits=None, frozen_stages=-1, norm_eval=False,
                 img_size=None, arch=None, quant_groups="heads", quant_group_size=None, attn_impl="fused",
                 **kwargs):
        reject_legacy_kwargs("MesaPVT", kwargs, {"depths": "num_layers", "embed_dim": "embed_dims"})
        self.convert_weights = convert_weights
        pretrain_img_size = to_size2(pretrain_img_size)
        super().__init__(pretrained=pretrained, init_cfg=init_cfg)
        num_layers = apply_arch("MesaPVT", arch, PVT_ARCHS, dict(num_layers=num_layers),
                                dict(num_layers=[3, 4, 6, 3]))["num_layers"]
        self.arch = arch
        self.embed_dims = embed_dims
        self.num_stages = num_stages
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.patch_sizes = patch_sizes
        self.strides = strides
        self.sr_ratios = sr_ratios
        assert num_stages == len(num_layers) == len(num_heads) == len(patch_sizes) == len(strides) \
            == len(sr_ratios)
        self.out_indices = out_indices
        assert max(out_indices) < self.num_stages
        if min(out_indices) < 0:
            raise ValueError(f"out_indices={out_indices!r}: expected indices in [0, {num_stages})")
        if list(patch_sizes) != list(strides) or list(paddings) != [0] * num_stages \
                or list(patch_sizes) != [4] + [2] * (num_stages - 1):
            raise ValueError(f"patch_sizes={patch_sizes}, strides={strides}, paddings={paddings}: this PVT v1 "
                             f"has non-overlapping patch embeddings of stride 4, 2, 2, 2 and no padding")
        if use_conv_ffn:
            raise ValueError("use_conv_ffn=True (PVT v2's MixFFN) is not in this PVT v1; use mmdet's "
                             "PyramidVisionTransformerV2 inside dict(type='MesaCompressed', backbone=...)")
        if not -1 <= frozen_stages <= num_stages:
            raise ValueError(f"frozen_stages={frozen_stages}: expected -1 .. {num_stages}")
        self.frozen_stages = frozen_stages
        self.norm_eval = norm_eval
        self.use_abs_pos_embed = use_abs_pos_embed
        norm_layer, norm_grad = layer_norm_factory(norm_cfg, "MesaPVT")
        act_layer = check_act_cfg(act_cfg, "MesaPVT")
        if isinstance(embed_dims, int):
            dims = tuple(embed_dims * h for h in num_heads)
        else:
            raise TypeError(f"embed_dims={embed_dims!r}: an int (stage i has embed_dims * num_heads[i] "
                            "channels, as mmdet)")
        size = to_size2(img_size) if img_size is not None else pretrain_img_size
        if size[0] != size[1]:
            raise ValueError(f"img_size / pretrain_img_size {size}: the position embeddings are square here")

        body = PyramidVisionTransformer(
            img_size=size[0], patch_size=patch_sizes[0], in_chans=in_channels, num_classes=0,
            embed_dims=dims, num_heads=tuple(num_heads), mlp_ratios=tuple(mlp_ratios), qkv_bias=qkv_bias,
            drop_rate=drop_rate, attn_drop_rate=attn_drop_rate, drop_path_rate=drop_path_rate,
            norm_layer=norm_layer, depths=tuple(num_layers), sr_ratios=tuple(sr_ratios), num_stages=num_stages,
            act_layer=act_layer, quant_groups=quant_groups, quant_group_size=quant_group_size,
            attn_impl=attn_impl)
        body.norm = nn.Identity()  # unused here (the segmentation code drops it too)
        del body.cls_token
        ms.set_prefix_tokens(getattr(body, f"block{num_stages}"), 0)  # (no class token here)
        skip = ["head.*", "norm.*", "cls_token"]
        if not use_abs_pos_embed:
            for i in range(num_stages):
                delattr(body, f"pos_embed{i + 1}")
            skip.append("pos_embed*")
        self.ckpt_skip = tuple(skip)
        self.body = body
        self.norm_after_stage = norm_after_stage
        self.stage_norms = nn.ModuleList([
            norm_layer(d, quant_groups=body.qgroups(d, h, f"stage_norms.{i}")) if norm_after_stage
            else nn.Identity() for i, (d, h) in enumerate(zip(dims, num_heads))])
        self._finish(ms_policy, with_cp, with_cp_bits, norm_grad)
        if norm_eval and ms_policy not in (None, "off"):
            print_log("MesaPVT: norm_eval=True keeps the LayerNorms in eval mode while training; with Mesa "
                      "they then store their inputs exact", logger="current")

    @property
    def num_features(self):
        return list(self.body.embed_dims)

    def transformer_blocks(self) -> list:
        """The PVT blocks, stage by stage."""
        b = self.body
        return [blk for i in range(b.num_stages) for blk in getattr(b, f"block{i + 1}")]

    # ---- freezing ----------------------------------------------------------------------------
    def _stage_parts(self, i: int) -> list:
        """The modules / parameters of 0-based stage ``i``, patch embedding first."""
        b = self.body
        parts = [getattr(b, f"patch_embed{i + 1}"), getattr(b, f"pos_drop{i + 1}")]
        if self.use_abs_pos_embed:
            parts.append(getattr(b, f"pos_embed{i + 1}"))
        return parts + [getattr(b, f"block{i + 1}"), self.stage_norms[i]]

    def _freeze_stages(self):
        if self.frozen_stages >= 0:
            freeze(*self._stage_parts(0)[:-2])  # the stem: patch embedding (+ position embedding)
        for i in range(self.frozen_stages):
            freeze(*self._stage_parts(i))

    # ---- forward -----------------------------------------------------------------------------
    def forward(self, x):
        b = self.body
        B = x.shape[0]
        outs = []
        for i in range(b.num_stages):
            patch_embed = getattr(b, f"patch_embed{i + 1}")
            H, W = x.shape[-2] // patch_embed.patch_size[0], x.shape[-1] // patch_embed.patch_size[1]
            x = patch_embed(x)
            if self.use_abs_pos_embed:
                pos_embed = getattr(b, f"pos_embed{i + 1}")
                if i == b.num_stages - 1:
                    pos_embed = pos_embed[:, 1:]  # the class token's position is not used
                x = getattr(b, f"pos_drop{i + 1}")(x + stage_pos_embed(pos_embed, patch_embed.grid_size, H, W))
            for blk in getattr(b, f"block{i + 1}"):
                x = self.run_block(blk, blk, x, H, W)
            x = self.stage_norms[i](x)
            x = x.reshape(B, H, W, -1).permute(0, 3, 1, 2).contiguous()
            if i in self.out_indices:
                outs.append(x)
        return tuple(outs)
