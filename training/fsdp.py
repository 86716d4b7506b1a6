"""FSDP2 for ``tools/train.py --fsdp``: ``fully_shard`` on each transformer block, then on the root,
and checkpoints through ``torch.distributed.checkpoint`` (DCP).

    model = fsdp.wrap(model, device, reshard_after_forward=True, amp="bf16")
    fsdp.save_sharded(folder, model, optimizer, extra)       # every rank: its shards (+ extra, rank 0)
    extra = fsdp.load_sharded(folder, model, optimizer)      # in place, bit-exact resume
    fsdp.export_full_checkpoint(folder, "model.pth")         # offline, one process: {'model', 'meta'}

Parameters become DTensors sharded on dim 0 over the ranks; buffers (Mesa's quantizer state) stay
whole on every rank, kept equal by Mesa's own all-reduce (``ms.set_dist_sync``). A sharded
checkpoint is a folder: DCP's files (model and optimizer, keyed by parameter name, so it loads on
any number of ranks, also into an unwrapped model) and ``extra.pth`` (epoch, schedule, scaler,
every rank's RNG states, args, the Mesa layer table), written by rank 0.
"""
from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from .distributed import barrier, get_world_size, is_main_process

__all__ = ["EXTRA", "export_full_checkpoint", "full_model_state_dict", "is_fsdp", "is_sharded_checkpoint",
           "load_sharded", "save_sharded", "shard_units", "wrap"]

EXTRA = "extra.pth"
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def is_fsdp(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def is_sharded_checkpoint(path: str) -> bool:
    """A DCP folder (``.metadata``) as :func:`save_sharded` writes."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, ".metadata"))


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The outermost submodules whose class name ends in ``Block`` (timm's ViT / DeiT ``Block``,
    ``SwinTransformerBlock``, PVT's ``Block``): each becomes one FSDP unit."""
    units = []

    def visit(m):
        for child in m.children():
            if type(child).__name__.endswith("Block"):
                units.append(child)
            else:
                visit(child)
    visit(model)
    return units


def wrap(model: nn.Module, device: torch.device, *, reshard_after_forward: bool = True,
         amp: str = "none") -> nn.Module:
    """Broadcast rank 0's parameters and buffers, then ``fully_shard`` each of
    :func:`shard_units` and the root, over all ranks (a 1-D mesh on ``device``'s type). ``amp`` 'fp16' / 'bf16': parameters are all-gathered in that dtype,
    gradients reduced in float32 (``MixedPrecisionPolicy``); 'none': float32 throughout."""
    if not dist.is_initialized():
        raise RuntimeError("--fsdp needs a process group: launch with torchrun (or srun)")
    mesh = init_device_mesh(device.type, (get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=_DTYPES[amp], reduce_dtype=torch.float32) if amp in _DTYPES \
        else MixedPrecisionPolicy()
    kw = dict(mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    # each rank initialised its own copy (seeded per rank): start from rank 0's, as DDP does
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            if t.device.type == device.type:  # (the quantizers' CPU draw counters: 0 on every rank)
                dist.broadcast(t.data, src=0)
    for m in shard_units(model):
        fully_shard(m, **kw)
    fully_shard(model, **kw)
    return model


def full_model_state_dict(model: nn.Module, rank0_only: bool = False) -> dict:
    """The whole (unsharded) state dict, on the CPU: on every rank, or on rank 0 only (the
    others get {}). A collective: every rank calls it."""
    if not is_fsdp(model):
        return {k: v.cpu() for k, v in model.state_dict().items()}
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=rank0_only))
    return {k: v.cpu() for k, v in sd.items()}


def save_sharded(folder: str, model: nn.Module, optimizer, extra: dict) -> None:
    """Every rank writes its shards of the model and optimizer state to ``folder`` (DCP), rank 0
    ``extra`` (weights_only-loadable contents). Written to ``folder + '.tmp'`` first and renamed
    after all ranks finished, so a crash leaves the previous checkpoint whole."""
    tmp, old = folder + ".tmp", folder + ".old"
    if is_main_process():
        shutil.rmtree(tmp, ignore_errors=True)
    barrier()
    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=tmp)
    if is_main_process():
        torch.save(extra, os.path.join(tmp, EXTRA))
        if os.path.exists(folder):
            shutil.rmtree(old, ignore_errors=True)
            os.replace(folder, old)
        os.replace(tmp, folder)
        shutil.rmtree(old, ignore_errors=True)
    barrier()


def load_sharded(folder: str, model: nn.Module, optimizer=None) -> dict:
    """Load a :func:`save_sharded` folder in place into ``model`` (FSDP, DDP's module or a plain
    model, on any number of ranks) and, given, ``optimizer``; returns the ``extra`` dict."""
    msd = get_model_state_dict(model)
    state = {"model": msd}
    if optimizer is not None:
        state["optimizer"] = get_state_dict(model, optimizer)[1]
    dcp.load(state, checkpoint_id=folder)
    if optimizer is not None:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    else:
        set_model_state_dict(model, state["model"])
    return torch.load(os.path.join(folder, EXTRA), weights_only=True)


def export_full_checkpoint(folder: str, path: str) -> dict:
    """Convert a :func:`save_sharded` folder into one file ``{'model', 'meta', 'epoch'}`` that
    ``models.load_checkpoint`` and ``tools/train.py --eval --resume`` read; one process, no
    process group. Returns the state dict."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from .checkpoint import atomic_save

    tmp = path + ".dcp.tmp"
    dcp_to_torch_save(folder, tmp)
    try:
        sd = torch.load(tmp, weights_only=True)["model"]
    finally:
        os.unlink(tmp)
    extra = torch.load(os.path.join(folder, EXTRA), weights_only=True)
    atomic_save({"model": sd, "meta": extra.get("meta", {}), "epoch": extra.get("epoch")}, path)
    return sd
