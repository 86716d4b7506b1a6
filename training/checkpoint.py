"""Training checkpoints: atomic writes, ``torch.load(weights_only=True)``-loadable contents, and
everything an exact resume needs.

A checkpoint is ``{'model', 'meta'}`` (as :func:`models.save_checkpoint`: weights with the Mesa
quantizer state) plus ``optimizer``, ``lr_scheduler``, ``scaler``, ``model_ema``, ``epoch``,
``max_accuracy``, ``args`` (a plain dict) and ``rng``: per rank, the torch (CPU and CUDA), numpy,
python and Mesa stochastic-rounding generator states; and ``checksum``, the SHA-256 of all that
(:func:`models.checkpoint.add_checksum`), verified by :func:`read_checkpoint`.
"""
from __future__ import annotations

import os
import random
import uuid

import numpy as np
import torch

import mesa_ops as ms
from mesa_ops.layers import MESA_LAYERS
from models.checkpoint import FORMAT_NAME, FORMAT_VERSION, add_checksum, read_checkpoint

__all__ = ["atomic_save", "build_checkpoint", "get_rng_states", "read_checkpoint", "set_rng_states"]


def atomic_save(obj, path: str) -> None:
    """``torch.save`` to a temporary file in the same folder, then rename (a crash never leaves a
    truncated checkpoint). The file gets the mode ``open()`` gives (0666 less the umask), as every
    other file of a run, not ``mkstemp``'s 0600."""
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f".tmp_{os.path.basename(path)}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "xb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _meta(model) -> dict:
    cfg = getattr(model, "pretrained_cfg", None) or {}
    mesa = {name: {"enable": bool(m.enable), "bits": int(m.bits)}
            for name, m in model.named_modules() if isinstance(m, MESA_LAYERS)}
    return {"format": FORMAT_NAME, "version": FORMAT_VERSION,
            "architecture": str(cfg.get("architecture", "")), "class": type(model).__name__, "mesa": mesa}


def build_checkpoint(model, *, optimizer, lr_scheduler, scaler, model_ema, epoch: int, max_accuracy: float,
                     args: dict, rng: list) -> dict:
    obj = {"model": model.state_dict(), "meta": _meta(model), "optimizer": optimizer.state_dict(),
           "lr_scheduler": lr_scheduler.state_dict(), "scaler": scaler.state_dict(), "epoch": int(epoch),
           "max_accuracy": float(max_accuracy), "args": args, "rng": rng}
    if model_ema is not None:
        obj["model_ema"] = model_ema.state_dict()
    return add_checksum(obj)


def get_rng_states() -> dict:
    """This process's generator states, as tensors / ints / tuples (weights_only-safe)."""
    np_state = np.random.get_state(legacy=False)
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": {"bit_generator": np_state["bit_generator"],
                       "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
                       "pos": int(np_state["state"]["pos"]), "has_gauss": int(np_state["has_gauss"]),
                       "gauss": float(np_state["gauss"])}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if hasattr(ms, "get_rng_state"):
        state["mesa"] = ms.get_rng_state()
    return state


def set_rng_states(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_tuples(state["python"]))
    n = state["numpy"]
    np.random.set_state({"bit_generator": n["bit_generator"],
                         "state": {"key": n["key"].numpy().astype(np.uint32), "pos": n["pos"]},
                         "has_gauss": n["has_gauss"], "gauss": n["gauss"]})
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "mesa" in state and hasattr(ms, "set_rng_state"):
        ms.set_rng_state(state["mesa"])


def _tuples(x):
    """random.setstate wants tuples where a round trip may have produced lists."""
    if isinstance(x, (list, tuple)):
        return tuple(_tuples(v) for v in x)
    return x
