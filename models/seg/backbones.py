"""PVT and Swin backbones for mmsegmentation 1.x, built from this repo's Mesa models.

Both wrap a classification model of :mod:`models` (same parameter names, same Mesa layers) and
return the four stage outputs as NCHW maps, for the Semantic FPN (PVT) and UperNet (Swin) heads of
the paper's ADE20K experiments (Pan et al., arXiv 2111.11124, Sec. 5, following the PVT and Swin
segmentation code):

* :class:`MesaPVT`: PVT v1 Ti/S/M/L; stage i gives (B, C_i, H/s_i, W/s_i), s = 4, 8, 16, 32,
  C = 64, 128, 320, 512. As in the PVT segmentation code the class token, the final norm and the
  classifier are dropped; stage 4 uses ``pos_embed4[:, 1:]``. Position embeddings are built at
  ``img_size`` (the crop size: a 224 px checkpoint's embeddings are resized bicubically on
  loading) and interpolated bilinearly at run time for any other input size (whole-image test).
* :class:`MesaSwinTransformer`: Swin T/S/B; stage i gives (B, C * 2^i, ceil(H/2^(i+2)), ...),
  with one LayerNorm ``norm{i}`` per output (as the Swin segmentation code). Any input size:
  the image is padded to the patch size, each block pads its token map to the window size and
  builds its shifted-window mask for that size, patch merging pads odd maps (the segmentation
  code's forward). The relative position tables are window-based, so checkpoints load unchanged.

Mesa: ``ms_policy`` is None/'off' (exact), 'mesa8' / 'mesa4' / 'mesa2', a dict of
:func:`mesa_ops.policy.set_mesa` arguments, or a policy file (``configs/mesa/pvt_8bit.txt``,
``configs/mesa/swin_8bit.txt``; a relative path is looked up in the working directory, then in the
repository root). It is applied to the whole backbone (including Swin's output norms).

Weights: ``pretrained=<path or URL>`` or ``init_cfg=dict(type='Pretrained', checkpoint=...)``,
loaded in :meth:`init_weights` (called by mmengine's Runner) by :func:`models.load_checkpoint`,
which reads the official checkpoints, this repo's and the original Mesa code's, and checks every
key (the classifier, the final norm and PVT's class token are skipped).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from mmengine.logging import print_log
from mmengine.model import BaseModule
from mmseg.registry import MODELS

import mesa_ops as ms

from .. import create_model, load_checkpoint
from ..pvt import stage_pos_embed
from ..registry import apply_policy
from ..swin import window_partition, window_reverse

__all__ = ["MesaPVT", "MesaSwinTransformer", "resolve_policy", "PVT_ARCHS", "SWIN_ARCHS"]

REPO_ROOT = Path(__file__).resolve().parents[2]
PVT_ARCHS = {"tiny": "pvt_tiny", "small": "pvt_small", "medium": "pvt_medium", "large": "pvt_large"}
SWIN_ARCHS = {"tiny": "swin_tiny_patch4_window7_224", "small": "swin_small_patch4_window7_224",
              "base": "swin_base_patch4_window7_224"}


def resolve_policy(ms_policy):
    """A relative policy-file path that does not exist in the working directory but does under
    the repository root, made absolute; anything else unchanged (errors are raised by
    :func:`models.registry.apply_policy`, naming the value)."""
    if isinstance(ms_policy, (str, os.PathLike)) and not os.path.isabs(ms_policy):
        if not os.path.exists(ms_policy) and (REPO_ROOT / ms_policy).is_file():
            return str(REPO_ROOT / ms_policy)
    return ms_policy


def _check_arch(arch, archs, what):
    if arch not in archs:
        raise ValueError(f"{what}: unknown arch {arch!r}; expected one of {sorted(archs)}")
    return archs[arch]


def _check_out_indices(out_indices, n):
    out = tuple(out_indices)
    if not out or any(not 0 <= i < n for i in out):
        raise ValueError(f"out_indices={out_indices!r}: expected indices in [0, {n})")
    return out


class _MesaBackbone(BaseModule):
    """Weight loading shared by the two backbones; subclasses set ``self.body`` (the wrapped
    classification model) and ``ckpt_skip`` (its checkpoint keys not used here)."""

    ckpt_skip: tuple = ()

    def __init__(self, pretrained=None, init_cfg=None):
        if pretrained is not None and init_cfg is not None:
            raise ValueError("pass either pretrained=... or init_cfg=..., not both")
        if init_cfg is not None and (not isinstance(init_cfg, dict) or init_cfg.get("type") != "Pretrained"
                                     or not init_cfg.get("checkpoint")):
            raise ValueError(f"init_cfg={init_cfg!r}: these backbones take only "
                             "dict(type='Pretrained', checkpoint=<path or URL>)")
        super().__init__(init_cfg=init_cfg)
        self.pretrained = pretrained

    def checkpoint_source(self):
        """The checkpoint to initialise from, or None (random init of the classification model)."""
        if self.pretrained:
            return self.pretrained
        if self.init_cfg:
            return self.init_cfg["checkpoint"]
        return None

    def init_weights(self):
        """Load the classification checkpoint into the wrapped model (if one is given)."""
        src = self.checkpoint_source()
        if src:
            load_checkpoint(self.body, src, skip=self.ckpt_skip,
                            verbose=lambda msg: print_log(f"{type(self).__name__}: {msg}", logger="current"))
        self._is_init = True

    def _apply_policy(self, ms_policy):
        self.ms_policy = ms_policy
        apply_policy(self, resolve_policy(ms_policy),
                     verbose=lambda msg: print_log(msg, logger="current"))


@MODELS.register_module()
class MesaPVT(_MesaBackbone):
    """PVT v1 backbone: (B, 3, H, W) -> 4 maps (B, C_i, H_i, W_i), see the module docstring.

    Args:
        arch: 'tiny' | 'small' | 'medium' | 'large'.
        img_size: the size the position embeddings are built (and checkpoints resized) for.
        drop_path_rate: stochastic depth (0.1 in the PVT segmentation code).
        ms_policy: Mesa policy (module docstring).
        out_indices: stages to return.
        pretrained / init_cfg: classification checkpoint (module docstring).
        **kwargs: other arguments of :class:`models.pvt.PyramidVisionTransformer`.
    """

    ckpt_skip = ("head.*", "norm.*", "cls_token")

    def __init__(self, arch="tiny", img_size=512, drop_path_rate=0.1, ms_policy=None,
                 out_indices=(0, 1, 2, 3), pretrained=None, init_cfg=None, **kwargs):
        super().__init__(pretrained=pretrained, init_cfg=init_cfg)
        self.arch = arch
        body = create_model(_check_arch(arch, PVT_ARCHS, "MesaPVT"), img_size=img_size, num_classes=0,
                            drop_path_rate=drop_path_rate, **kwargs)
        body.norm = nn.Identity()  # unused here (the segmentation code drops it too)
        del body.cls_token
        self.body = body
        self.out_indices = _check_out_indices(out_indices, body.num_stages)
        self._apply_policy(ms_policy)

    def forward(self, x):
        b = self.body
        B = x.shape[0]
        outs = []
        for i in range(b.num_stages):
            patch_embed = getattr(b, f"patch_embed{i + 1}")
            pos_embed = getattr(b, f"pos_embed{i + 1}")
            if i == b.num_stages - 1:
                pos_embed = pos_embed[:, 1:]  # the class token's position is not used
            H, W = x.shape[-2] // patch_embed.patch_size[0], x.shape[-1] // patch_embed.patch_size[1]
            x = patch_embed(x)
            x = getattr(b, f"pos_drop{i + 1}")(x + stage_pos_embed(pos_embed, patch_embed.grid_size, H, W))
            for blk in getattr(b, f"block{i + 1}"):
                x = blk(x, H, W)
            x = x.reshape(B, H, W, -1).permute(0, 3, 1, 2).contiguous()
            if i in self.out_indices:
                outs.append(x)
        return tuple(outs)


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


@MODELS.register_module()
class MesaSwinTransformer(_MesaBackbone):
    """Swin backbone: (B, 3, H, W) -> 4 maps (B, C * 2^i, H_i, W_i), any H, W (module docstring).

    Args:
        arch: 'tiny' | 'small' | 'base' (window 7, the 224 px ImageNet-1K models).
        drop_path_rate: stochastic depth (0.3 in the Swin UperNet configs).
        ms_policy, out_indices, pretrained, init_cfg: as :class:`MesaPVT`.
        **kwargs: other arguments of :class:`models.swin.SwinTransformer` (``ape``, ``window_size``,
            ``quant_group_size``, ...). The wrapped model is built for 64 * window_size px, which
            only fixes each block's window and shift (the official ones); inputs may be any size.
    """

    ckpt_skip = ("head.*", "norm.*")

    def __init__(self, arch="tiny", drop_path_rate=0.3, ms_policy=None, out_indices=(0, 1, 2, 3),
                 pretrained=None, init_cfg=None, **kwargs):
        super().__init__(pretrained=pretrained, init_cfg=init_cfg)
        self.arch = arch
        ws = kwargs.pop("window_size", 7)
        if "img_size" in kwargs:
            raise ValueError("MesaSwinTransformer takes any input size; do not pass img_size")
        body = create_model(_check_arch(arch, SWIN_ARCHS, "MesaSwinTransformer"), img_size=64 * ws,
                            window_size=ws, num_classes=0, drop_path_rate=drop_path_rate, **kwargs)
        body.norm = nn.Identity()  # replaced by one norm per output
        for layer in body.layers:
            for blk in layer.blocks:
                blk.attn_mask = None  # built per input size in forward
        self.body = body
        self.out_indices = _check_out_indices(out_indices, body.num_layers)
        self.num_features = [int(body.embed_dim * 2 ** i) for i in range(body.num_layers)]
        heads = [layer.blocks[0].num_heads for layer in body.layers]
        for i in self.out_indices:
            self.add_module(f"norm{i}", ms.LayerNorm(self.num_features[i],
                                                     quant_groups=body.qgroups(self.num_features[i], heads[i],
                                                                               f"norm{i}")))
        self._apply_policy(ms_policy)

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
        if H % ph or W % pw:
            x = F.pad(x, (0, (-W) % pw, 0, (-H) % ph))
        x = b.patch_embed.proj(x)
        H, W = x.shape[-2:]
        x = x.flatten(2).transpose(1, 2)
        if b.patch_embed.norm is not None:
            x = b.patch_embed.norm(x)
        if b.ape:
            gh, gw = b.patches_resolution
            pos = b.absolute_pos_embed.reshape(1, gh, gw, -1).permute(0, 3, 1, 2)
            pos = F.interpolate(pos, size=(H, W), mode="bicubic", align_corners=False)
            x = x + pos.flatten(2).transpose(1, 2)
        x = b.pos_drop(x)
        outs = []
        for i, layer in enumerate(b.layers):
            ws = layer.blocks[0].window_size
            shift = max(blk.shift_size for blk in layer.blocks)
            mask = shifted_window_mask(H, W, ws, shift, x.device) if shift > 0 else None
            for blk in layer.blocks:
                x = self._block(blk, x, H, W, mask)
            if i in self.out_indices:
                out = getattr(self, f"norm{i}")(x)
                outs.append(out.view(-1, H, W, self.num_features[i]).permute(0, 3, 1, 2).contiguous())
            if layer.downsample is not None:
                x = self._merge(layer.downsample, x, H, W)
                H, W = (H + 1) // 2, (W + 1) // 2
        return tuple(outs)
