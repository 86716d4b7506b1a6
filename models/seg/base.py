"""What :class:`~models.seg.MesaSwinTransformer` and :class:`~models.seg.MesaPVT` share: mmseg's
(mmdet's) constructor checks, weight loading, Mesa policies, ``with_cp``, ``frozen_stages``.

* ``pretrained`` / ``init_cfg`` are checked as mmseg's SwinTransformer and mmdet's PVT check them
  (both set: AssertionError; ``pretrained`` neither a str nor None: TypeError; a str is turned into
  ``init_cfg=dict(type='Pretrained', checkpoint=...)`` with mmseg's deprecation warning). The
  checkpoint is read in :meth:`MesaBackbone.init_weights` (mmengine's Runner calls it) by
  :func:`models.load_checkpoint`: the official (paper) checkpoints, this repo's, the original Mesa
  code's; every key is checked.
* ``with_cp``: as in mmseg, every Transformer block carries its own ``with_cp`` (set from the
  backbone's at construction) and follows it: a block whose ``with_cp`` is True runs, while
  training with autograd recording, under non-reentrant activation checkpointing
  (``with_cp_bits=None``) or the compressed checkpoint of :mod:`mesa_ops.checkpoint` (``8``/``4``/
  ``2``: the block input kept as a packed copy); one whose ``with_cp`` is False runs plainly.
  ``block.with_cp = False`` on one block after construction turns checkpointing off for that
  block only. The backbone's ``with_cp`` (and ``grad_checkpointing``) reads True when any block
  has ``with_cp``; setting it (or ``set_grad_checkpointing(enable, bits)``) after construction
  sets every block's ``with_cp`` (``with_cp_bits``, the backbone's ``grad_checkpointing_bits``,
  applies to all blocks). A policy file's ``on checkpoint:`` section chooses per block
  (``block.mesa_checkpoint = (enable, bits)``, as for the classification models): that choice
  overrides the block's ``with_cp`` and the backbone's bits; at construction the chosen blocks'
  ``with_cp`` is set to the policy's ``enable`` so that it reads what runs.
* ``frozen_stages``: :meth:`MesaBackbone.train` puts the frozen parts in eval mode and their
  parameters get ``requires_grad=False`` (mmseg's ``_freeze_stages``). A frozen prefix then records
  no autograd graph: with Mesa on it stores nothing (its Mesa layers, in eval mode, are the plain
  layers, and nothing downstream needs their inputs).
"""
from __future__ import annotations

import os
import warnings
from functools import partial
from pathlib import Path

import torch
import torch.nn as nn
from mmengine.logging import print_log
from mmengine.model import BaseModule

import mesa_ops as ms
from mesa_ops.checkpoint import checkpoint_block

from .. import load_checkpoint
from ..registry import apply_policy
from ..timm_api import GradCheckpointing, init_grad_checkpointing

__all__ = ["MesaBackbone", "resolve_policy", "to_size2", "layer_norm_factory", "check_act_cfg",
           "reject_legacy_kwargs", "freeze"]

REPO_ROOT = Path(__file__).resolve().parents[2]


def resolve_policy(ms_policy):
    """A relative policy-file path that does not exist in the working directory but does under
    the repository root, made absolute; anything else unchanged (errors are raised by
    :func:`models.registry.apply_policy`, naming the value)."""
    if isinstance(ms_policy, (str, os.PathLike)) and not os.path.isabs(ms_policy):
        if not os.path.exists(ms_policy) and (REPO_ROOT / ms_policy).is_file():
            return str(REPO_ROOT / ms_policy)
    return ms_policy


def to_size2(size):
    """mmseg's handling of ``pretrain_img_size``: an int -> (s, s); a 1-tuple -> (s, s); a tuple
    must then have length 2 (AssertionError, as mmseg)."""
    if isinstance(size, int):
        return (size, size)
    if isinstance(size, tuple):
        if len(size) == 1:
            size = (size[0], size[0])
        assert len(size) == 2, f"The size of image should have length 1 or 2, but got {len(size)}"
    return size


def layer_norm_factory(norm_cfg, what: str):
    """(Mesa LayerNorm class with the config's eps, requires_grad) from an mmcv ``norm_cfg``."""
    if not isinstance(norm_cfg, dict) or norm_cfg.get("type") not in ("LN", "LayerNorm"):
        raise ValueError(f"{what}: norm_cfg={norm_cfg!r}: the Mesa backbones build Mesa LayerNorms; "
                         "only dict(type='LN', eps=..., requires_grad=...) is supported")
    extra = set(norm_cfg) - {"type", "eps", "requires_grad"}
    if extra:
        raise ValueError(f"{what}: norm_cfg keys {sorted(extra)} not supported (type, eps, requires_grad)")
    eps = norm_cfg.get("eps", 1e-5)
    return partial(ms.LayerNorm, eps=eps), bool(norm_cfg.get("requires_grad", True))


def check_act_cfg(act_cfg, what: str):
    if not isinstance(act_cfg, dict) or act_cfg.get("type") != "GELU" or len(act_cfg) != 1:
        raise ValueError(f"{what}: act_cfg={act_cfg!r}: the Mesa backbones use Mesa GELU; only "
                         "dict(type='GELU') is supported")
    return ms.GELU


# timm-style names of the former constructors -> mmseg's
LEGACY_NAMES = {"in_chans": "in_channels", "embed_dim": "embed_dims", "ape": "use_abs_pos_embed",
                "use_checkpoint": "with_cp", "depths_pvt": "num_layers"}


def reject_legacy_kwargs(what: str, kwargs: dict, extra: dict | None = None) -> None:
    """TypeError for any leftover keyword, naming mmseg's argument where one is meant."""
    if not kwargs:
        return
    names = {**LEGACY_NAMES, **(extra or {})}
    parts = [f"{k} (mmseg's name: {names[k]})" if k in names else k for k in kwargs]
    raise TypeError(f"{what}: unexpected arguments {', '.join(parts)}")


def freeze(*parts) -> None:
    """Eval mode and ``requires_grad=False`` for modules; ``requires_grad=False`` for parameters."""
    for p in parts:
        if p is None:
            continue
        if isinstance(p, nn.Parameter):
            p.requires_grad = False
            continue
        p.eval()
        for q in p.parameters():
            q.requires_grad = False


def apply_arch(what: str, arch, archs: dict, given: dict, defaults: dict) -> dict:
    """The architecture arguments (``given``) with an ``arch`` shorthand applied: each value must
    be left at its default or equal the arch's."""
    if arch is None:
        return given
    if arch not in archs:
        raise ValueError(f"{what}: unknown arch {arch!r}; expected one of {sorted(archs)}")
    out = dict(given)
    for k, v in archs[arch].items():
        if _same(given[k], defaults[k]) or _same(given[k], v):
            out[k] = v
        else:
            raise ValueError(f"{what}: arch={arch!r} sets {k}={v!r}, but {k}={given[k]!r} was given")
    return out


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) == list(b)
    return a == b


class MesaBackbone(GradCheckpointing, BaseModule):
    """Weight loading, Mesa policy, checkpointing and freezing shared by the two backbones.

    Subclasses set ``self.body`` (the wrapped classification model, whose parameter names are
    the official checkpoints'), ``ckpt_skip`` (its checkpoint keys not used here) and implement
    :meth:`_freeze_stages`.
    """

    ckpt_skip: tuple = ()
    frozen_stages: int = -1
    norm_eval: bool = False

    def __init__(self, pretrained=None, init_cfg=None):
        assert not (init_cfg and pretrained), "init_cfg and pretrained cannot be specified at the same time"
        if isinstance(pretrained, str):
            warnings.warn('DeprecationWarning: pretrained is deprecated, please use "init_cfg" instead')
            init_cfg = dict(type="Pretrained", checkpoint=pretrained)
        elif pretrained is not None:
            raise TypeError("pretrained must be a str or None")
        if init_cfg is not None and (not isinstance(init_cfg, dict) or init_cfg.get("type") != "Pretrained"
                                     or not init_cfg.get("checkpoint")):
            raise ValueError(f"init_cfg={init_cfg!r}: these backbones take only "
                             "dict(type='Pretrained', checkpoint=<path or URL>)")
        super().__init__(init_cfg=init_cfg)
        self.pretrained = pretrained

    # ---- weights -----------------------------------------------------------------------------
    def checkpoint_source(self):
        """The checkpoint to initialise from, or None (random init of the classification model)."""
        return self.init_cfg["checkpoint"] if self.init_cfg else None

    def init_weights(self):
        """Load the classification checkpoint into the wrapped model (if one is given)."""
        src = self.checkpoint_source()
        if src:
            load_checkpoint(self.body, self.convert_checkpoint(src), skip=self.ckpt_skip,
                            verbose=lambda msg: print_log(f"{type(self).__name__}: {msg}", logger="current"))
        self._is_init = True

    def convert_checkpoint(self, src):
        """The checkpoint ``src`` as :func:`models.load_checkpoint` takes it (subclasses convert
        other layouts)."""
        return src

    # ---- Mesa --------------------------------------------------------------------------------
    def _finish(self, ms_policy, with_cp, with_cp_bits, norm_requires_grad: bool):
        """The last constructor step: norms' requires_grad, checkpointing, the policy, freezing."""
        if not norm_requires_grad:
            for m in self.modules():
                if isinstance(m, nn.LayerNorm):
                    for p in m.parameters():
                        p.requires_grad = False
        init_grad_checkpointing([self], with_cp, with_cp_bits)  # every block's with_cp
        if with_cp_bits is not None and not with_cp:
            raise ValueError(f"with_cp_bits={with_cp_bits} needs with_cp=True")
        self.ms_policy = ms_policy
        apply_policy(self, resolve_policy(ms_policy), verbose=lambda msg: print_log(msg, logger="current"))
        for blk in self.transformer_blocks():
            choice = getattr(blk, "mesa_checkpoint", None)
            if choice is not None:
                blk.with_cp = bool(choice[0])
        self._freeze_stages()

    def transformer_blocks(self) -> list:
        """The Transformer blocks, in forward order (each carries ``with_cp``)."""
        raise NotImplementedError

    # Python-side switches over the blocks (TorchScript does not run these backbones' forward)
    @property
    def grad_checkpointing(self) -> bool:
        """Whether any block has ``with_cp`` (timm's name; see :attr:`with_cp`)."""
        return any(getattr(blk, "with_cp", False) for blk in self.transformer_blocks())

    @grad_checkpointing.setter
    def grad_checkpointing(self, enable: bool) -> None:
        for blk in self.transformer_blocks():
            blk.with_cp = bool(enable)

    @property
    def with_cp(self) -> bool:
        """mmseg's ``with_cp``: True when any block has ``with_cp``; setting it sets every block's."""
        return self.grad_checkpointing

    @with_cp.setter
    def with_cp(self, enable: bool) -> None:
        self.grad_checkpointing = enable

    def _checkpoint_owners(self):
        return [self]

    def run_block(self, blk: nn.Module, fn, *args):
        """``fn(*args)`` (``fn`` runs block ``blk``), checkpointed when the block's ``with_cp`` (or
        its ``mesa_checkpoint`` from a policy file, which takes precedence) says so, the block is
        training and autograd records: bits (``with_cp_bits``, or the policy's) None -> torch's
        non-reentrant checkpoint, 8/4/2 -> the compressed one (the first argument kept packed)."""
        choice = getattr(blk, "mesa_checkpoint", None)
        enable, bits = choice if choice is not None else (getattr(blk, "with_cp", False),
                                                          self.grad_checkpointing_bits)
        if not (enable and blk.training and torch.is_grad_enabled()):
            return fn(*args)
        # (the block's Mesa layers run exact inside either kind: mesa_ops.checkpoint.exact_inside)
        return checkpoint_block(fn, *args, bits=bits, owner=blk)

    # ---- freezing ----------------------------------------------------------------------------
    def _freeze_stages(self) -> None:
        raise NotImplementedError

    def train(self, mode: bool = True):
        """Training mode, keeping the frozen stages frozen (and, with ``norm_eval``, every
        LayerNorm in eval mode, as mmseg's ViT / BEiT do)."""
        super().train(mode)
        self._freeze_stages()
        if mode and self.norm_eval:
            for m in self.modules():
                if isinstance(m, nn.LayerNorm):
                    m.eval()
        return self
