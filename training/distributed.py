"""Process-group set-up: torchrun (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``), Slurm's srun
(``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID`` with ``MASTER_ADDR``/``MASTER_PORT``), or one
plain process. NCCL on CUDA, gloo on CPU."""
from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = [
    "DistInfo",
    "all_gather_object",
    "barrier",
    "cleanup",
    "get_rank",
    "get_world_size",
    "init_distributed_mode",
    "is_dist",
    "is_main_process",
]


@dataclass
class DistInfo:
    distributed: bool = False
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str = ""


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_dist() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_dist() else 1


def is_main_process() -> bool:
    return get_rank() == 0


def barrier() -> None:
    if is_dist():
        dist.barrier()


def all_gather_object(obj) -> list:
    if not is_dist():
        return [obj]
    out = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm node list (``scontrol show hostnames``, as mmcv does)."""
    if not nodelist:
        raise RuntimeError("srun without SLURM_JOB_NODELIST: set MASTER_ADDR and MASTER_PORT")
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                             check=True, timeout=60).stdout.split()
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"cannot expand the Slurm node list {nodelist!r} with scontrol ({exc}); "
                           "set MASTER_ADDR") from exc
    if not out:
        raise RuntimeError(f"scontrol returned no host for {nodelist!r}; set MASTER_ADDR")
    return out[0]


def init_distributed_mode(device: str, dist_url: str = "env://") -> DistInfo:
    """Join the process group described by the environment (torchrun or srun); otherwise one
    process. ``device``: 'cuda...' selects NCCL and this rank's GPU (``LOCAL_RANK``), else gloo."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world, local = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
    elif "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        rank, world = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
        local = int(env.get("SLURM_LOCALID", 0))
        if dist_url == "env://" and "MASTER_ADDR" not in env:
            nodes = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
            env["MASTER_ADDR"] = _first_slurm_host(nodes)
        env.setdefault("MASTER_PORT", "29500")
        env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"] = str(rank), str(world), str(local)
    else:
        return DistInfo()
    if world <= 1:
        return DistInfo(rank=rank, local_rank=local)
    cuda = str(device).startswith("cuda")
    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group(backend=backend, init_method=dist_url, world_size=world, rank=rank)
    dist.barrier()
    return DistInfo(True, rank, world, local, backend)


def cleanup() -> None:
    if is_dist():
        dist.destroy_process_group()
