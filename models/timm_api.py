"""What the DeiT, Swin and PVT models share to follow timm's model contract.

timm's models expose ``forward_features`` (unpooled), ``forward_head(x, pre_logits)``,
``forward_intermediates`` / ``prune_intermediate_layers`` (used by ``features_only=True`` through
timm's ``FeatureGetterNet``), ``feature_info``, ``group_matcher`` (layer-wise LR decay),
``set_grad_checkpointing``, ``no_weight_decay``, ``get_classifier`` / ``reset_classifier``. This
module holds the pieces the three families have in common:

* :class:`GradCheckpointing`: ``set_grad_checkpointing(enable=True, bits=None)`` and
  :meth:`GradCheckpointing.checkpointed`, which runs one block either directly, under ordinary
  non-reentrant ``torch.utils.checkpoint`` (``bits=None``) or under the compressed checkpoint
  ``mesa_ops.checkpoint.checkpoint_block(block, *args, bits=bits)`` (the block's input stored
  as a packed low-bit copy).
* :func:`pool_tokens`: the ``global_pool`` of token models ('token', 'avg', '').
* :func:`tokens_to_nchw`, :func:`check_output_fmt`, :func:`check_global_pool`.

FX and TorchScript, as timm's tests use them: the Mesa layers (``mesa_ops.layers.MESA_LAYERS``)
are registered with timm's ``register_notrace_module`` (leaf modules of a symbolic trace: their
Python-side switches stay out of the graph); size checks are ``torch._assert`` (traced, scripted);
a model's forward runs its blocks directly under ``torch.jit.is_scripting()`` (checkpointing is
Python-only), and a scripted Mesa layer is its plain ``nn`` counterpart.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.utils.checkpoint
from timm.models import register_notrace_function, register_notrace_module  # (timm.layers from 1.0.17 on)
from timm.models._features import feature_take_indices

from mesa_ops.checkpoint import checkpoint_block
from mesa_ops.layers import MESA_LAYERS

for _layer in MESA_LAYERS:
    register_notrace_module(_layer)

__all__ = ["GradCheckpointing", "run_block", "pool_tokens", "tokens_to_nchw", "check_output_fmt",
           "check_global_pool", "feature_take_indices", "register_notrace_function"]


def run_block(block: nn.Module, *args, enable: bool = False, bits: int | None = None):
    """``block(*args)``, under activation checkpointing when ``enable`` and autograd records.

    ``bits=None``: ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` (the block's
    inputs are kept, everything inside is recomputed in backward). ``bits=8/4/2``: the compressed
    checkpoint (the inputs kept as a packed copy). Both through
    ``mesa_ops.checkpoint.checkpoint_block``, which runs the block's Mesa layers exact (what a
    checkpointed block saves lives one block's backward at most).
    A per-block choice from a policy file's ``on checkpoint:`` section
    (``block.mesa_checkpoint = (enable, bits)``, see mesa_ops.checkpoint.apply_checkpoint_policy)
    overrides the model-wide one.
    """
    override = getattr(block, "mesa_checkpoint", None)
    if override is not None:
        enable, bits = override
    if not enable or not torch.is_grad_enabled() or torch.jit.is_scripting():
        return block(*args)
    # (both kinds run the block's Mesa layers exact: see mesa_ops.checkpoint.exact_inside)
    return checkpoint_block(block, *args, bits=bits)


def _check_bits(bits):
    if bits is not None and bits not in (2, 4, 8):
        raise ValueError(f"grad_checkpointing_bits must be None (ordinary checkpointing) or 2, 4, 8; "
                         f"got {bits!r}")
    return bits


class GradCheckpointing:
    """``set_grad_checkpointing`` for a model whose blocks run through :meth:`checkpointed`.

    Attributes: ``grad_checkpointing`` (bool), ``grad_checkpointing_bits`` (None: ordinary
    non-reentrant checkpointing; 8/4/2: the compressed one). Models whose stages hold the flags
    themselves (Swin) override :meth:`_checkpoint_owners`.
    """

    # no annotations: TorchScript reads class annotations, and these would be strings here
    grad_checkpointing = False
    grad_checkpointing_bits = None

    def _checkpoint_owners(self):
        return [self]

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True, bits: int | None = None) -> None:
        """Checkpoint every Transformer block (``enable``); ``bits`` (8/4/2) selects the compressed
        checkpoint and stays set until changed (``bits=None`` keeps the current choice; pass
        ``bits=0`` to return to ordinary checkpointing)."""
        if bits is not None:
            bits = None if bits == 0 else _check_bits(bits)
            for owner in self._checkpoint_owners():
                owner.grad_checkpointing_bits = bits
        for owner in self._checkpoint_owners():
            owner.grad_checkpointing = bool(enable)

    def checkpointed(self, block: nn.Module, *args):
        """``block(*args)``, checkpointed as set (not for TorchScript: call the block directly
        under ``torch.jit.is_scripting()``)."""
        return run_block(block, *args, enable=self.grad_checkpointing, bits=self.grad_checkpointing_bits)


def init_grad_checkpointing(owners, enable: bool, bits: int | None) -> None:
    """Constructor helper: the initial checkpoint mode of each owner."""
    bits = _check_bits(bits)
    for owner in owners:
        owner.grad_checkpointing = bool(enable)
        owner.grad_checkpointing_bits = bits


TOKEN_POOLS = ("token", "avg", "")


def check_global_pool(global_pool, allowed=TOKEN_POOLS) -> str:
    if global_pool not in allowed:
        raise ValueError(f"global_pool={global_pool!r}: expected one of {', '.join(map(repr, allowed))}")
    return global_pool


def pool_tokens(x: torch.Tensor, global_pool: str, num_prefix_tokens: int) -> torch.Tensor:
    """(B, P + N, C) tokens -> (B, C): 'token' the first prefix token, 'avg' the mean of the N
    patch tokens; '' returns the tokens unchanged."""
    if global_pool == "token":
        return x[:, 0]
    if global_pool == "avg":
        return x[:, num_prefix_tokens:].mean(dim=1)
    return x


def tokens_to_nchw(x: torch.Tensor, H: int, W: int) -> torch.Tensor:
    """(B, H*W, C) -> (B, C, H, W)."""
    B, L, C = x.shape
    torch._assert(L == H * W, f"expected {H}x{W} tokens, got {L}")
    return x.transpose(1, 2).reshape(B, C, H, W).contiguous()


def check_output_fmt(output_fmt: str, allowed=("NCHW",)) -> None:
    if output_fmt not in allowed:
        raise ValueError(f"output_fmt={output_fmt!r}: this model returns intermediates as "
                         f"{' or '.join(allowed)}")
