"""FSDP2 for ``tools/train.py --fsdp``: ``fully_shard`` on each transformer block, then on the root,
and checkpoints through ``torch.distributed.checkpoint`` (DCP).

    model = fsdp.wrap(model, device, reshard_after_forward=True, amp="bf16")
    fsdp.save_sharded(folder, model, optimizer, extra)       # every rank: its shards (+ extra, rank 0)
    extra = fsdp.load_sharded(folder, model, optimizer)      # in place, bit-exact resume
    fsdp.export_full_checkpoint(folder, "model.pth")         # offline, one process: {'model', 'meta'}
    ema = fsdp.ShardedModelEma(model, decay)                  # DeiT's model EMA, of each rank's shards

Parameters become DTensors sharded on dim 0 over the ranks; buffers (Mesa's quantizer state) stay
whole on every rank, kept equal by Mesa's own all-reduce (``ms.set_dist_sync``). A sharded
checkpoint is a folder: DCP's files (model and optimizer, keyed by parameter name, so it loads on
any number of ranks, also into an unwrapped model) and ``extra.pth`` (epoch, schedule, scaler,
every rank's RNG states, args, the Mesa layer table), written by rank 0; with model EMA, the
EMA's shards under ``model_ema`` beside the model's.
"""
from __future__ import annotations

import contextlib
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

__all__ = ["EXTRA", "ShardedModelEma", "export_full_checkpoint", "full_model_state_dict", "has_model_ema",
           "is_fsdp", "is_sharded_checkpoint", "load_sharded", "save_sharded", "shard_units", "wrap"]

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


def _reshard(model: nn.Module) -> None:
    """Reshard every FSDP2 unit of ``model`` (its registered parameters are the sharded DTensors
    again); a no-op for a plain model and for units already sharded."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the same storage), any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


class ShardedModelEma:
    """timm's ``ModelEmaV3`` (constant ``decay``, no warm-up: DeiT's ``--model-ema``) for an FSDP2
    model: each rank keeps the EMA of its own shards, never the whole model.

    ``state`` maps the model's state-dict keys to the EMA: a DTensor of the same sharding for each
    parameter, a plain tensor for each buffer (Mesa's quantizer state, whole on every rank).
    :meth:`update` is ``ModelEmaV3.update``'s arithmetic on the local shards, element for element
    (``torch._foreach_lerp_`` of every floating entry with weight ``1 - decay``, a copy of the
    others), so the EMA equals what ``ModelEmaV3`` computes on the unsharded weights, bit for bit.
    The DCP checkpoint stores ``state`` as it stores the model (:func:`save_sharded`); :meth:`applied`
    puts the EMA into the model for an evaluation and restores the weights after it."""

    def __init__(self, model: nn.Module, decay: float):
        self.decay = float(decay)
        self.reset(model)

    def reset(self, model: nn.Module) -> None:
        """The EMA set to the model's current (sharded) weights."""
        _reshard(model)
        with torch.no_grad():
            self.state = {k: v.detach().clone() for k, v in model.state_dict().items()}

    @torch.no_grad()
    def update(self, model: nn.Module, step=None) -> None:
        _reshard(model)
        ema_f, model_f = [], []
        for k, v in model.state_dict().items():
            e, m = _local(self.state[k]), _local(v.detach())
            if e.is_floating_point():
                ema_f.append(e)
                model_f.append(m)
            else:
                e.copy_(m)
        if ema_f:
            torch._foreach_lerp_(ema_f, model_f, weight=1.0 - self.decay)

    def _targets(self, model: nn.Module) -> dict:
        own = dict(model.named_parameters())
        own.update(model.named_buffers())
        missing = [k for k in self.state if k not in own]
        if missing:
            raise KeyError(f"model EMA: the model has no {missing[:4]}")
        return {k: own[k] for k in self.state}

    @contextlib.contextmanager
    def applied(self, model: nn.Module):
        """The EMA's values in ``model``'s (sharded) parameters and buffers for the duration; the
        model's own values are put back after, exactly. The model is resharded first (a forward
        without backward, or ``reshard_after_forward=False``, leaves FSDP2's unsharded
        parameters registered) and again before the restore."""
        _reshard(model)
        targets = self._targets(model)
        with torch.no_grad():
            saved = {k: _local(t.detach()).clone() for k, t in targets.items()}
        try:
            with torch.no_grad():
                for k, t in targets.items():
                    _local(t.detach()).copy_(_local(self.state[k]))
            yield model
        finally:
            _reshard(model)
            with torch.no_grad():
                for k, t in self._targets(model).items():
                    _local(t.detach()).copy_(saved[k])

    def full_state_dict(self, rank0_only: bool = False) -> dict:
        """The whole EMA on the CPU: on every rank, or on rank 0 only (the others get {}). A
        collective for the sharded entries: every rank calls it."""
        out = {}
        for k, v in self.state.items():
            full = v.full_tensor() if hasattr(v, "full_tensor") else v
            if not rank0_only or is_main_process():
                out[k] = full.detach().cpu()
            del full
        return out


def full_model_state_dict(model: nn.Module, rank0_only: bool = False) -> dict:
    """The whole (unsharded) state dict, on the CPU: on every rank, or on rank 0 only (the
    others get {}). A collective: every rank calls it."""
    if not is_fsdp(model):
        return {k: v.cpu() for k, v in model.state_dict().items()}
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=rank0_only))
    return {k: v.cpu() for k, v in sd.items()}


def save_sharded(folder: str, model: nn.Module, optimizer, extra: dict,
                 model_ema: ShardedModelEma | None = None) -> None:
    """Every rank writes its shards of the model and optimizer state (and of ``model_ema``) to
    ``folder`` (DCP), rank 0 ``extra`` (weights_only-loadable contents). Written to
    ``folder + '.tmp'`` first and renamed after all ranks finished, so a crash leaves the previous
    checkpoint whole."""
    tmp, old = folder + ".tmp", folder + ".old"
    if is_main_process():
        shutil.rmtree(tmp, ignore_errors=True)
    barrier()
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optimizer": osd}
    if model_ema is not None:
        state["model_ema"] = model_ema.state
    dcp.save(state, checkpoint_id=tmp)
    if is_main_process():
        torch.save(extra, os.path.join(tmp, EXTRA))
        if os.path.exists(folder):
            shutil.rmtree(old, ignore_errors=True)
            os.replace(folder, old)
        os.replace(tmp, folder)
        shutil.rmtree(old, ignore_errors=True)
    barrier()


def has_model_ema(folder: str) -> bool:
    """Whether a :func:`save_sharded` folder holds a model EMA."""
    meta = dcp.FileSystemReader(folder).read_metadata()
    return any(k.startswith("model_ema.") for k in meta.state_dict_metadata)


def load_sharded(folder: str, model: nn.Module, optimizer=None, model_ema: ShardedModelEma | None = None) -> dict:
    """Load a :func:`save_sharded` folder in place into ``model`` (FSDP, DDP's module or a plain
    model, on any number of ranks) and, given, ``optimizer`` and ``model_ema`` (left as it is when
    the folder holds none: ``extra['model_ema_loaded']`` says which); returns the ``extra`` dict."""
    msd = get_model_state_dict(model)
    state = {"model": msd}
    if optimizer is not None:
        state["optimizer"] = get_state_dict(model, optimizer)[1]
    ema_loaded = model_ema is not None and has_model_ema(folder)
    if ema_loaded:
        state["model_ema"] = model_ema.state
    dcp.load(state, checkpoint_id=folder)
    if optimizer is not None:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    else:
        set_model_state_dict(model, state["model"])
    extra = torch.load(os.path.join(folder, EXTRA), weights_only=True)
    extra["model_ema_loaded"] = ema_loaded
    return extra


def export_full_checkpoint(folder: str, path: str) -> dict:
    """Convert a :func:`save_sharded` folder into one file ``{'model', 'meta', 'epoch'}`` (and
    ``'model_ema'`` where the run kept one) that
    ``models.load_checkpoint`` and ``tools/train.py --eval --resume`` read; one process, no
    process group. Returns the state dict."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from .checkpoint import atomic_save

    tmp = path + ".dcp.tmp"
    dcp_to_torch_save(folder, tmp)
    try:
        whole = torch.load(tmp, weights_only=True)
    finally:
        os.unlink(tmp)
    sd = whole["model"]
    extra = torch.load(os.path.join(folder, EXTRA), weights_only=True)
    obj = {"model": sd, "meta": extra.get("meta", {}), "epoch": extra.get("epoch")}
    if "model_ema" in whole:
        obj["model_ema"] = whole["model_ema"]
    atomic_save(obj, path)
    return sd
