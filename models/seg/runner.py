"""Training and testing the segmentation configs on mmengine's Runner (what ``tools/seg_train.py``
and ``tools/seg_test.py`` call), as mmsegmentation 1.x's own ``tools/train.py`` / ``test.py`` do,
plus what this environment needs:

* ``--resume`` under torch >= 2.6, where ``torch.load`` reads weights only: mmengine checkpoints
  hold a few non-tensor objects (the message hub's ``HistoryBuffer`` with numpy arrays and
  scalars); :func:`register_checkpoint_safe_globals` allows exactly those
  (``torch.serialization.add_safe_globals``), nothing else, and weights-only loading stays on.
* SyncBN: single-process runs revert it to BN (mmengine's Runner does); a distributed run without
  CUDA (torchrun on CPUs, gloo) has it replaced by BN in the config (:func:`sync_bn_to_bn`), the
  gloo process group initialised here (mmengine's ``init_dist`` calls ``torch.cuda.set_device``)
  and DDP built without ``device_ids``.
* ``--amp`` uses mmengine's ``AmpOptimWrapper`` (fp16, dynamic loss scale), which needs a GPU.
* Bad input is found before the Runner is built (and prints its environment): a missing or
  incomplete data set (:func:`check_data`, naming the expected layout), an unreadable or truncated
  checkpoint (:func:`check_checkpoint`), ``--amp`` without CUDA, raise :class:`SegUsageError`
  with a one-line message; the tools print it and exit with status 1.
"""
from __future__ import annotations

import logging
import os
import os.path as osp
import pickle
import zipfile

import numpy as np
import torch
import torch.distributed as dist
from mmengine.config import Config
from mmengine.logging import HistoryBuffer, print_log
from mmengine.runner import Runner

__all__ = ["build_config", "run_train", "run_test", "register_checkpoint_safe_globals", "sync_bn_to_bn",
           "CHECKPOINT_SAFE_GLOBALS", "LAUNCHERS", "tiny_run_options", "SegUsageError", "check_data",
           "check_checkpoint"]

LAUNCHERS = ("none", "pytorch", "slurm", "mpi")
ADE20K_URL = "http://data.csail.mit.edu/places/ADEchallenge/ADEChallengeData2016.zip"


class SegUsageError(ValueError):
    """Input the segmentation tools cannot use (missing data, unreadable checkpoint, --amp on
    CPU); the message is one line."""


_DEFAULT_STATISTICS = frozenset({"min", "max", "current", "mean"})  # HistoryBuffer._set_default_statistics


def _history_buffer_method(obj, name: str):
    """``getattr`` as mmengine checkpoints use it, and nothing more: the message hub pickles
    ``HistoryBuffer``'s statistics methods (``min``, ``max``, ``current``, ``mean``, ...) by
    reference, as ``getattr(HistoryBuffer, 'min')``. Registered as ``builtins.getattr`` for
    ``torch.load(weights_only=True)``; any other object or name is refused."""
    allowed = _DEFAULT_STATISTICS | set(HistoryBuffer._statistics_methods)
    if obj is HistoryBuffer and name in allowed:
        return getattr(obj, name)
    raise pickle.UnpicklingError(f"checkpoint asks for getattr({obj!r}, {name!r}); only HistoryBuffer's "
                                 f"statistics methods {sorted(allowed)} are allowed")


def _checkpoint_safe_globals() -> list:
    """What an mmengine Runner checkpoint (mmseg 1.2.2, mmengine 0.10.7, numpy 2) pickles besides
    tensors, found by listing the GLOBAL opcodes of a saved ``iter_N.pth`` and resuming from it:
    the message hub's ``HistoryBuffer`` with its numpy log arrays (``ndarray`` rebuilt by
    ``multiarray._reconstruct`` with a ``dtype``) and numpy scalars (``multiarray.scalar``), and
    the statistics methods by ``getattr`` (see :func:`_history_buffer_method`). numpy's module
    path is registered under both names (``numpy._core`` of numpy 2, ``numpy.core`` of numpy 1)."""
    core = getattr(np, "_core", None) or np.core
    found = [HistoryBuffer, np.ndarray, np.dtype, (_history_buffer_method, "builtins.getattr")]
    # dtype instances are rebuilt (BUILD) as their numpy 2 classes: Float64DType for the logs;
    # float32 / int64 / int32 for numpy scalars a hook may log
    found += [type(np.dtype(name)) for name in ("float64", "float32", "int64", "int32")]
    for mod in ("numpy._core.multiarray", "numpy.core.multiarray"):
        found += [(core.multiarray._reconstruct, f"{mod}._reconstruct"),
                  (core.multiarray.scalar, f"{mod}.scalar")]
    return found


CHECKPOINT_SAFE_GLOBALS = tuple(_checkpoint_safe_globals())


def register_checkpoint_safe_globals() -> None:
    """Allow exactly the non-tensor objects of mmengine checkpoints in
    ``torch.load(weights_only=True)`` (:data:`CHECKPOINT_SAFE_GLOBALS`); weights-only loading
    stays on for everything else."""
    torch.serialization.add_safe_globals(list(CHECKPOINT_SAFE_GLOBALS))


def sync_bn_to_bn(cfg) -> int:
    """Replace every ``norm_cfg`` of type 'SyncBN' in ``cfg`` by 'BN' (in place); returns how many."""
    n = 0

    def walk(node):
        nonlocal n
        if isinstance(node, dict):
            if node.get("type") == "SyncBN":
                node["type"] = "BN"
                n += 1
            for v in node.values():
                walk(v)
        elif isinstance(node, (list, tuple)):
            for v in node:
                walk(v)

    walk(cfg._cfg_dict if isinstance(cfg, Config) else cfg)
    return n


def build_config(config: str, *, work_dir: str | None = None, amp: bool = False, resume: str | None = None,
                 cfg_options: dict | None = None, launcher: str = "none") -> Config:
    """The Runner config: ``config`` file + ``cfg_options`` (mmengine's ``merge_from_dict``, list
    indices allowed: ``train_dataloader.dataset.pipeline.2.crop_size``), ``work_dir`` (default
    ``./work_dirs/<config name>``), ``amp`` (fp16 AmpOptimWrapper), ``resume`` ('auto': the latest
    checkpoint of ``work_dir``; or a checkpoint path), ``launcher`` (none | pytorch | slurm | mpi)."""
    if not osp.isfile(config):
        raise FileNotFoundError(f"config not found: {config}")
    if launcher not in LAUNCHERS:
        raise SegUsageError(f"launcher={launcher!r}: expected one of {LAUNCHERS}")
    cfg = Config.fromfile(config)
    cfg.launcher = launcher
    if cfg_options:
        cfg.merge_from_dict(cfg_options)
    if work_dir is not None:
        cfg.work_dir = work_dir
    elif cfg.get("work_dir") is None:
        cfg.work_dir = osp.join("./work_dirs", osp.splitext(osp.basename(config))[0])
    if amp:
        if not torch.cuda.is_available():
            raise SegUsageError("--amp needs a CUDA device: mmengine's AmpOptimWrapper (fp16 with a dynamic "
                             "loss scale) does not run on CPU")
        if cfg.optim_wrapper.get("type", "OptimWrapper") != "OptimWrapper":
            raise ValueError(f"--amp replaces an OptimWrapper, but the config has "
                             f"{cfg.optim_wrapper.get('type')!r}")
        cfg.optim_wrapper.type = "AmpOptimWrapper"
        cfg.optim_wrapper.loss_scale = "dynamic"
    if resume:
        cfg.resume = True
        cfg.load_from = None if resume == "auto" else resume
        if resume != "auto" and not osp.isfile(resume):
            raise FileNotFoundError(f"--resume checkpoint not found: {resume}")
    if launcher != "none" and not torch.cuda.is_available():
        n = sync_bn_to_bn(cfg)
        print_log(f"distributed run without CUDA: {n} SyncBN norm configs set to BN", logger="current")
        cfg.model_wrapper_cfg = dict(type="MMDistributedDataParallel", device_ids=None,
                                     broadcast_buffers=False,
                                     find_unused_parameters=cfg.get("find_unused_parameters", False))
    return cfg


def _init_cpu_distributed(cfg) -> None:
    """Initialise gloo for a torchrun launch without CUDA (mmengine's init_dist needs CUDA)."""
    if cfg.launcher == "none" or torch.cuda.is_available() or dist.is_initialized():
        return
    if cfg.launcher != "pytorch":
        raise ValueError(f"launcher {cfg.launcher!r} without CUDA: only 'pytorch' (torchrun) runs on CPUs")
    dist.init_process_group(backend="gloo")


def _runner(cfg) -> Runner:
    register_checkpoint_safe_globals()
    _init_cpu_distributed(cfg)
    if "runner_type" in cfg:
        from mmseg.registry import RUNNERS
        return RUNNERS.build(cfg)
    return Runner.from_cfg(cfg)


def _layout(root: str) -> str:
    return (f"expected {root}/images/training/*.jpg with {root}/annotations/training/*.png of the same names, "
            f"and the same for validation (unzip {ADE20K_URL} into {osp.dirname(root) or '.'}, or point "
            "--cfg-options train_dataloader.dataset.data_root=DIR val_dataloader.dataset.data_root=DIR "
            "test_dataloader.dataset.data_root=DIR at a copy; check a copy: python -m data.ade20k DIR; "
            "a synthetic set for a smoke run: python -m data.ade20k DIR --synthetic)")


def check_data(cfg, loaders=("train_dataloader", "val_dataloader")) -> None:
    """Each of the ``loaders`` of ``cfg`` (present and not None) finds its image and label
    directories (``data_root`` / ``data_prefix``) with files in them; else :class:`SegUsageError`
    naming the directory and the expected ADE20K layout."""
    for name in loaders:
        loader = cfg.get(name)
        if not loader:
            continue
        ds = loader.get("dataset", {})
        root = str(ds.get("data_root", "") or "")
        prefix = ds.get("data_prefix", {}) or {}
        what = "ADE20K" if ds.get("type") == "ADE20KDataset" else f"{ds.get('type', 'the data set')}"
        for key, ext in (("img_path", ".jpg"), ("seg_map_path", ".png")):
            d = osp.join(root, prefix.get(key, ""))
            if not osp.isdir(d):
                raise SegUsageError(f"{what} not found ({name}): no directory {d}; {_layout(root)}")
            if not any(f.endswith(ext) for f in os.listdir(d)):
                raise SegUsageError(f"{what} incomplete ({name}): no *{ext} files in {d}; {_layout(root)}")


def check_checkpoint(path: str, what: str = "checkpoint") -> None:
    """``path`` exists and ``torch.load`` can read it (weights only, memory-mapped, so the tensors
    are not read); else :class:`SegUsageError` (e.g. a truncated copy)."""
    if not osp.isfile(path):
        raise SegUsageError(f"{what} not found: {path}")
    register_checkpoint_safe_globals()
    try:
        torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except (RuntimeError, pickle.UnpicklingError, EOFError, ValueError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise SegUsageError(f"{what} {path}: not a readable PyTorch checkpoint ({type(exc).__name__}: {first}); "
                            "a truncated or damaged copy? copy it again or pick another iter_*.pth") from exc


def _resume_checkpoint(cfg) -> str | None:
    """The checkpoint a run of ``cfg`` will load: ``load_from``, or with ``resume`` and no
    ``load_from`` the work dir's ``last_checkpoint`` (mmengine's auto-resume)."""
    if cfg.get("load_from"):
        return cfg.load_from
    marker = osp.join(cfg.work_dir, "last_checkpoint")
    if cfg.get("resume") and osp.isfile(marker):
        with open(marker) as f:
            return f.read().strip() or None
    return None


def run_train(cfg) -> Runner:
    """Build the Runner from ``cfg`` (see :func:`build_config`) and train; returns the Runner.
    The data and the checkpoint to resume from are checked first (:class:`SegUsageError`)."""
    check_data(cfg, ("train_dataloader",) + (("val_dataloader",) if cfg.get("val_cfg") else ()))
    ckpt = _resume_checkpoint(cfg)
    if ckpt:
        check_checkpoint(ckpt, "--resume checkpoint" if cfg.get("resume") else "load_from checkpoint")
    runner = _runner(cfg)
    runner.train()
    return runner


def run_test(cfg, checkpoint: str) -> dict:
    """Load ``checkpoint`` (a Runner checkpoint of ``cfg``'s model) and evaluate on the test set;
    returns the metrics (``mIoU``, ``aAcc``, ``mAcc``). The checkpoint and the test data are
    checked first (:class:`SegUsageError`)."""
    check_checkpoint(checkpoint)
    check_data(cfg, ("test_dataloader",))
    cfg.load_from = checkpoint
    runner = _runner(cfg)
    metrics = runner.test()
    logging.getLogger("models").info("test metrics: %s", metrics)
    return metrics


def tiny_run_options(data_root: str, crop: int = 64, iters: int = 2, batch: int = 2, test_scale: int = 64,
                     workers: int = 0) -> dict:
    """``cfg_options`` for a smoke run of any configs/seg/ config on a small ADE20K-format set
    (``data.ade20k.make_synthetic_ade20k``): ``crop`` x ``crop`` training crops, ``iters`` iterations
    with a checkpoint and an evaluation at the end, whole-image tests with the short side
    ``test_scale``, no pretrained weights, ``workers`` data-loading processes."""
    opts = {
        "model.backbone.init_cfg": None,
        "model.data_preprocessor.size": (crop, crop),
        "train_dataloader.batch_size": batch,
        "train_dataloader.dataset.pipeline.2.scale": (4 * crop, crop),
        "train_dataloader.dataset.pipeline.3.crop_size": (crop, crop),
        "val_dataloader.dataset.pipeline.1.scale": (4 * test_scale, test_scale),
        "test_dataloader.dataset.pipeline.1.scale": (4 * test_scale, test_scale),
        "train_cfg.max_iters": iters,
        "train_cfg.val_interval": iters,
        "default_hooks.checkpoint.interval": iters,
        "default_hooks.logger.interval": 1,
    }
    for loader in ("train_dataloader", "val_dataloader", "test_dataloader"):
        opts[f"{loader}.dataset.data_root"] = data_root
        opts[f"{loader}.num_workers"] = workers
        opts[f"{loader}.persistent_workers"] = workers > 0
    return opts
