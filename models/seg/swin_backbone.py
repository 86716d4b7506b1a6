"""MesaSwinTransformer: mmseg's ``SwinTransformer`` backbone contract on this repo's Mesa Swin.

Same constructor as ``mmseg.models.backbones.SwinTransformer`` (mmseg 1.2.2: names, defaults,
argument checks), plus ``ms_policy`` (Mesa), ``with_cp_bits`` (compressed checkpointing) and
``arch`` ('tiny' / 'small' / 'base' shorthand for ``embed_dims``, ``depths``, ``num_heads``), so
an mmseg config switches to Mesa by its backbone ``type`` alone. Outputs as mmseg's: stage i
gives (B, C * 2^i, ceil(H/2^(i+2)), ceil(W/2^(i+2))) for any H, W, each through its LayerNorm
``norm{i}``.

Parameter names are the official Swin checkpoints' (under ``body.``: ``patch_embed.proj``,
``layers.i.blocks.j.attn.qkv`` ...; the output norms ``norm{i}`` are the backbone's), so the
paper's ImageNet checkpoints load (:meth:`MesaBackbone.init_weights`); so do the checkpoints
mmseg's configs point to (OpenMMLab's conversions, ``stages.i.blocks.j.attn.w_msa.qkv`` ...:
:func:`mmseg_swin_to_official` undoes mmseg's ``swin2mmseg`` key renaming and patch-merging
channel order). The wrapped model is built
for ``patch_size * window_size * 2^num_stages`` px, which only fixes each block's window and
shift (every odd block shifted, as in mmseg and the Swin segmentation code); inputs may be any
size: the image is padded to the patch size, each block pads its token map to the window size
and builds its shifted-window mask for that size, patch merging pads odd maps.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from mmseg.registry import MODELS

from ..checkpoint import extract_state_dict, read_checkpoint
from ..swin import SwinTransformer, window_partition, window_reverse
from .base import (MesaBackbone, apply_arch, check_act_cfg, freeze, layer_norm_factory,
                   reject_legacy_kwargs, to_size2)

__all__ = ["MesaSwinTransformer", "SWIN_ARCHS", "shifted_window_mask", "mmseg_swin_to_official"]

SWIN_ARCHS = {"tiny": dict(embed_dims=96, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24)),
              "small": dict(embed_dims=96, depths=(2, 2, 18, 2), num_heads=(3, 6, 12, 24)),
              "base": dict(embed_dims=128, depths=(2, 2, 18, 2), num_heads=(4, 8, 16, 32))}
_ARCH_DEFAULTS = dict(embed_dims=96, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24))


def shifted_window_mask(H: int, W: int, window_size: int, shift_size: int, device) -> torch.Tensor:
    """(nW, ws*ws, ws*ws) mask of 0 / -100 for an (H, W) map padded to multiples of the window
    (as the Swin segmentation code builds it per forward)."""
    Hp = -(-H // window_size) * window_size
    Wp = -(-W // window_size) * window_size
    img_mask = torch.zeros((1, Hp, Wp, 1), device=device)
    slices = (slice(0, -window_size), slice(-window_size, -shift_size), slice(-shift_size, None))
    cnt = 0
    for h in slices:
        for w in slices:
            img_mask[:, h, w, :] = cnt
            cnt += 1
    mask_windows = window_partition(img_mask, window_size).view(-1, window_size * window_size)
    mask = mask_windows.unsqueeze(1) - mask_windows.unsqueeze(2)
    return mask.masked_fill(mask != 0, float(-100.0)).masked_fill(mask == 0, float(0.0))


def _is_mmseg_layout(sd: dict) -> bool:
    return any(k.startswith(("stages.", "patch_embed.projection.")) for k in sd)


def mmseg_swin_to_official(sd: dict) -> dict:
    """A Swin state dict in mmseg's layout (``tools/model_converters/swin2mmseg.py``'s output, or
    an mmseg Swin backbone's, ``backbone.`` prefix allowed) in the official layout: ``stages`` ->
    ``layers``, ``attn.w_msa`` -> ``attn``, ``ffn.layers.0.0`` / ``ffn.layers.1`` -> ``mlp.fc1`` /
    ``mlp.fc2``, ``patch_embed.projection`` -> ``patch_embed.proj``, and the patch mergings'
    reduction (4C inputs) and norm back to the official 2x2 concatenation order."""
    out = {}
    for k, v in sd.items():
        if k.startswith("backbone."):
            k = k[len("backbone."):]
        if k.startswith("stages."):
            k = "layers." + k[len("stages."):]
            k = k.replace(".attn.w_msa.", ".attn.").replace(".ffn.layers.0.0.", ".mlp.fc1.")
            k = k.replace(".ffn.layers.1.", ".mlp.fc2.")
            if ".downsample.reduction." in k and v.dim() == 2:
                o, i = v.shape
                v = v.reshape(o, i // 4, 4).transpose(1, 2)[:, [0, 2, 1, 3], :].reshape(o, i)
            elif ".downsample.norm." in k and v.dim() == 1:
                v = v.reshape(v.shape[0] // 4, 4).transpose(0, 1)[[0, 2, 1, 3], :].reshape(-1)
        elif k.startswith("patch_embed.projection."):
            k = "patch_embed.proj." + k[len("patch_embed.projection."):]
        out[k] = v
    return out


@MODELS.register_module()
class MesaSwinTransformer(MesaBackbone):
    """Swin backbone: (B, in_channels, H, W) -> maps (B, C * 2^i, H_i, W_i) for ``out_indices``.

    Args (mmseg's SwinTransformer, same defaults):
        pretrain_img_size: int or tuple; the absolute position embedding's grid is
            ``pretrain_img_size // patch_size`` (interpolated bicubically to other inputs).
        in_channels, embed_dims, patch_size, window_size, mlp_ratio, depths, num_heads: as mmseg.
        strides: (patch_size, 2, 2, 2): ``strides[0] == patch_size`` is asserted (mmseg); the
            patch mergings halve the map (other strides: ValueError).
        out_indices, qkv_bias, qk_scale, patch_norm, drop_rate, attn_drop_rate, drop_path_rate,
        use_abs_pos_embed: as mmseg.
        act_cfg: dict(type='GELU') (Mesa GELU). norm_cfg: dict(type='LN', eps, requires_grad).
        with_cp: the initial ``with_cp`` of every block (``body.layers[i].blocks[j].with_cp``, a
            :class:`models.swin.SwinTransformerBlock`); each block runs checkpointed while its
            ``with_cp`` is True (see :mod:`models.seg.base`, also for setting the backbone's).
        pretrained / init_cfg: the classification checkpoint (official Swin, this repo's, Mesa's).
        frozen_stages: -1 none; 0 the patch embedding (+ position embedding); k also stages
            0..k-1 (with their patch merging) and their output norms; as mmseg.
    Mesa extras:
        ms_policy: None/'off', 'mesa8'/'mesa4'/'mesa2', a dict of ``ms.policy.set_mesa``
            arguments or a policy file (``configs/mesa/swin_8bit.txt``; relative paths are also
            looked up under the repository root).
        with_cp_bits: None (plain checkpoint) or 8/4/2 (compressed checkpoint).
        arch: None, or 'tiny' / 'small' / 'base' setting embed_dims, depths, num_heads.
        quant_groups, quant_group_size, attn_impl: of :class:`models.swin.SwinTransformer`.
    """

    ckpt_skip = ("head.*", "norm.*")

    def __init__(self, pretrain_img_size=224, in_channels=3, embed_dims=96, patch_size=4, window_size=7,
                 mlp_ratio=4, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24), strides=(4, 2, 2, 2),
                 out_indices=(0, 1, 2, 3), qkv_bias=True, qk_scale=None, patch_norm=True, drop_rate=0.,
                 attn_drop_rate=0., drop_path_rate=0.1, use_abs_pos_embed=False, act_cfg=dict(type="GELU"),
                 norm_cfg=dict(type="LN"), with_cp=False, pretrained=None, frozen_stages=-1, init_cfg=None,
                 *, ms_policy=None, with_cp_bits=None, arch=None, quant_groups="heads",
                 quant_group_size=None, attn_impl="fused", **kwargs):
        reject_legacy_kwargs("MesaSwinTransformer", kwargs, {"img_size": "pretrain_img_size"})
        self.frozen_stages = frozen_stages
        pretrain_img_size = to_size2(pretrain_img_size)
        super().__init__(pretrained=pretrained, init_cfg=init_cfg)
        a = apply_arch("MesaSwinTransformer", arch, SWIN_ARCHS,
                       dict(embed_dims=embed_dims, depths=depths, num_heads=num_heads), _ARCH_DEFAULTS)
        embed_dims, depths, num_heads = a["embed_dims"], tuple(a["depths"]), tuple(a["num_heads"])
        self.arch = arch
        num_layers = len(depths)
        if len(num_heads) != num_layers:
            raise ValueError(f"depths {depths} and num_heads {num_heads} differ in length")
        self.out_indices = out_indices
        if not all(0 <= i < num_layers for i in out_indices):
            raise ValueError(f"out_indices={out_indices!r}: expected indices in [0, {num_layers})")
        self.use_abs_pos_embed = use_abs_pos_embed
        assert strides[0] == patch_size, "Use non-overlapping patch embed."
        if len(strides) != num_layers or any(s != 2 for s in strides[1:]):
            raise ValueError(f"strides={strides!r}: the Mesa Swin's patch mergings halve the map; "
                             f"expected ({patch_size},{' 2,' * (num_layers - 1)})")
        if not -1 <= frozen_stages <= num_layers:
            raise ValueError(f"frozen_stages={frozen_stages}: expected -1 .. {num_layers}")
        norm_layer, norm_grad = layer_norm_factory(norm_cfg, "MesaSwinTransformer")
        act_layer = check_act_cfg(act_cfg, "MesaSwinTransformer")

        body = SwinTransformer(
            img_size=patch_size * window_size * 2 ** num_layers, patch_size=patch_size, in_chans=in_channels,
            num_classes=0, embed_dim=embed_dims, depths=depths, num_heads=num_heads, window_size=window_size,
            mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, qk_scale=qk_scale, drop_rate=drop_rate,
            attn_drop_rate=attn_drop_rate, drop_path_rate=drop_path_rate, norm_layer=norm_layer,
            act_layer=act_layer, ape=use_abs_pos_embed, patch_norm=patch_norm, quant_groups=quant_groups,
            quant_group_size=quant_group_size, attn_impl=attn_impl)
        body.norm = nn.Identity()  # replaced by one norm per output
        for layer in body.layers:
            for blk in layer.blocks:
                blk.attn_mask = None  # built per input size in forward
            if layer.downsample is not None and not patch_norm:
                layer.downsample.norm = nn.Identity()  # mmseg: no norm in the patch merging either
        if use_abs_pos_embed:  # mmseg's grid: pretrain_img_size // patch_size
            grid = (pretrain_img_size[0] // patch_size, pretrain_img_size[1] // patch_size)
            body.patches_resolution = grid
            body.absolute_pos_embed = nn.Parameter(torch.zeros(1, grid[0] * grid[1], embed_dims))
            nn.init.trunc_normal_(body.absolute_pos_embed, std=.02)
        self.body = body
        self.num_features = [int(embed_dims * 2 ** i) for i in range(num_layers)]
        for i in out_indices:
            self.add_module(f"norm{i}", norm_layer(self.num_features[i], quant_groups=body.qgroups(
                self.num_features[i], num_heads[i], f"norm{i}")))
        self._finish(ms_policy, with_cp, with_cp_bits, norm_grad)

    def convert_checkpoint(self, src):
        """Official / this repo's / Mesa checkpoints as they are; mmseg-layout ones converted."""
        sd, _ = extract_state_dict(read_checkpoint(src), str(src))
        return mmseg_swin_to_official(sd) if _is_mmseg_layout(sd) else sd

    def transformer_blocks(self) -> list:
        """The Swin blocks, stage by stage."""
        return [blk for layer in self.body.layers for blk in layer.blocks]

    # ---- freezing (mmseg's SwinTransformer._freeze_stages) ------------------------------------
    def _freeze_stages(self):
        b = self.body
        if self.frozen_stages >= 0:
            freeze(b.patch_embed, b.pos_drop, b.absolute_pos_embed if self.use_abs_pos_embed else None)
        for i in range(1, self.frozen_stages + 1):
            if (i - 1) in self.out_indices:
                freeze(getattr(self, f"norm{i - 1}"))
            freeze(b.layers[i - 1])

    # ---- forward -----------------------------------------------------------------------------
    @staticmethod
    def _block(blk, x, H, W, mask):
        """One (shifted) window block on (B, H*W, C) for any H, W (pads to the window)."""
        B, L, C = x.shape
        ws, ss = blk.window_size, blk.shift_size
        shortcut = x
        pad_b, pad_r = (-H) % ws, (-W) % ws
        pad = bool(pad_b or pad_r)
        x = (blk.norm1(x) if pad else x).view(B, H, W, C)
        if pad:  # (official: the padding tokens are zeros after norm1)
            x = F.pad(x, (0, 0, 0, pad_r, 0, pad_b))
        Hp, Wp = H + pad_b, W + pad_r
        if ss > 0:
            x = torch.roll(x, shifts=(-ss, -ss), dims=(1, 2))
        windows = window_partition(x, ws).view(-1, ws * ws, C)
        if not pad:  # norm1 per token after the partition, as SwinTransformerBlock.forward does
            windows = blk.norm1(windows)
        windows = blk.attn(windows, mask=mask if ss > 0 else None).view(-1, ws, ws, C)
        x = window_reverse(windows, ws, Hp, Wp)
        if ss > 0:
            x = torch.roll(x, shifts=(ss, ss), dims=(1, 2))
        if pad_b or pad_r:
            x = x[:, :H, :W, :].contiguous()
        x = shortcut + blk.drop_path(x.view(B, H * W, C))
        return x + blk.drop_path(blk.mlp(blk.norm2(x)))

    @staticmethod
    def _merge(ds, x, H, W):
        """Patch merging of (B, H*W, C) -> (B, ceil(H/2)*ceil(W/2), 2C), padding odd maps."""
        B, L, C = x.shape
        x = x.view(B, H, W, C)
        if H % 2 or W % 2:
            x = F.pad(x, (0, 0, 0, W % 2, 0, H % 2))
        x0, x1 = x[:, 0::2, 0::2, :], x[:, 1::2, 0::2, :]
        x2, x3 = x[:, 0::2, 1::2, :], x[:, 1::2, 1::2, :]
        x = torch.cat([x0, x1, x2, x3], -1).view(B, -1, 4 * C)
        return ds.reduction(ds.norm(x))

    def forward(self, x):
        b = self.body
        ph, pw = b.patch_embed.patch_size
        H, W = x.shape[-2:]
        if H % ph or W % pw:  # mmseg's PatchEmbed(padding='corner')
            x = F.pad(x, (0, (-W) % pw, 0, (-H) % ph))
        x = b.patch_embed.proj(x)
        H, W = x.shape[-2:]
        x = x.flatten(2).transpose(1, 2)
        if b.patch_embed.norm is not None:
            x = b.patch_embed.norm(x)
        if self.use_abs_pos_embed:
            gh, gw = b.patches_resolution
            pos = b.absolute_pos_embed
            if (gh, gw) != (H, W):
                pos = pos.reshape(1, gh, gw, -1).permute(0, 3, 1, 2)
                pos = F.interpolate(pos, size=(H, W), mode="bicubic", align_corners=False)
                pos = pos.flatten(2).transpose(1, 2)
            x = x + pos
        x = b.pos_drop(x)
        outs = []
        for i, layer in enumerate(b.layers):
            ws = layer.blocks[0].window_size
            shift = max(blk.shift_size for blk in layer.blocks)
            mask = shifted_window_mask(H, W, ws, shift, x.device) if shift > 0 else None
            for blk in layer.blocks:
                x = self.run_block(blk, partial(self._block, blk), x, H, W, mask)
            if i in self.out_indices:
                out = getattr(self, f"norm{i}")(x)
                outs.append(out.view(-1, H, W, self.num_features[i]).permute(0, 3, 1, 2).contiguous())
            if layer.downsample is not None:
                x = self._merge(layer.downsample, x, H, W)
                H, W = (H + 1) // 2, (W + 1) // 2
        return tuple(outs)
