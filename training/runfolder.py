"""A run's folder and inputs kept sane (issue 50).

* :func:`lock_folder`: one live run per ``--output-dir``: an exclusive POSIX lock (``lockf``) on
  ``DIR/.lock``, released by the kernel when the process dies (so a killed run never blocks its
  own resume) and not inherited by forked DataLoader workers; a second run is refused with a line
  naming the first's PID and host. Where the platform has no ``fcntl`` (Windows) or the file
  system no locks (some NFS / Lustre mounts), there is no lock, and a warning says so.
* :func:`remove_temporaries`: the ``.tmp_*`` files a write killed midway left (checkpoints are
  written to one and renamed); removed once the lock is held, i.e. when no live run writes them.
* :func:`check_patch_size`: an input size the patch size does not divide is refused with the
  nearest sizes that work (a ViT's patch embedding would drop the last rows and columns of every
  image without a word).
* :func:`check_classes`: the train and val folders of an ImageFolder hold the same classes.
"""
from __future__ import annotations

import glob
import os
import shutil
import socket
import warnings

import torch

from .errors import UsageError

__all__ = ["check_classes", "check_patch_size", "lock_folder", "remove_temporaries"]

LOCK_NAME = ".lock"


def lock_folder(output_dir: str):
    """Hold ``output_dir``'s run lock for this process's life; returns the open lock file (keep a
    reference) or None where there is no ``fcntl``. Raises :class:`UsageError` if a live run
    holds it."""
    try:
        import fcntl
    except ImportError:  # (Windows)
        return None
    path = os.path.join(output_dir, LOCK_NAME)
    f = open(path, "a+", encoding="utf-8")
    try:
        fcntl.lockf(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except (BlockingIOError, PermissionError):  # (EAGAIN / EACCES: held by a live process)
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise UsageError(f"--output-dir {output_dir} is in use by a live run ({holder}); wait for it to end, "
                         "stop it, or choose another --output-dir") from None
    except OSError as exc:  # (no locks on this file system: ENOLCK, EOPNOTSUPP, ...)
        f.close()
        warnings.warn(f"{output_dir}: cannot lock the folder ({exc}); a second run there would not be refused",
                      stacklevel=2)
        return None
    f.seek(0)
    f.truncate()
    f.write(f"PID {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    return f


def remove_temporaries(output_dir: str) -> list[str]:
    """Delete the ``.tmp_*`` files left in ``output_dir`` by writes a kill interrupted; returns
    their names. Call it with the folder's lock held."""
    names = []
    for p in sorted(glob.glob(os.path.join(output_dir, ".tmp_*"))):
        try:
            if os.path.isdir(p):
                shutil.rmtree(p)
            else:
                os.unlink(p)
            names.append(os.path.basename(p))
        except FileNotFoundError:
            pass
    return names


def _patch_size(model) -> int | None:
    """The patch size of a ViT whose patch embedding is a convolution with kernel = stride and no
    padding (the one that drops a remainder); None otherwise (overlapping or padded embeddings,
    dynamic padding: any size works)."""
    pe = getattr(model, "patch_embed", None)
    proj = getattr(pe, "proj", None)
    if pe is None or getattr(pe, "dynamic_img_pad", False) or not isinstance(proj, torch.nn.Conv2d):
        return None
    k, s, pad = tuple(proj.kernel_size), tuple(proj.stride), proj.padding
    if k != s or s[0] != s[1] or (pad != "valid" and any(int(v) for v in (pad if isinstance(pad, tuple) else (1,)))):
        return None
    return int(s[0])


def check_patch_size(model, input_size: int, name: str) -> None:
    """Refuse an ``input_size`` that the model's patch size does not divide (see the docstring)."""
    p = _patch_size(model)
    if p is None or p <= 1 or input_size % p == 0:
        return
    lo, hi = input_size - input_size % p, input_size - input_size % p + p
    sizes = " or ".join(str(s) for s in (lo, hi) if s > 0)
    raise UsageError(f"--input-size {input_size} is not a multiple of {name}'s patch size {p}: its last "
                     f"{input_size % p} rows and columns of every image would be dropped; use --input-size {sizes}")


def check_classes(train_set, val_set) -> None:
    """The train and val image folders name the same classes (in the same order: the labels)."""
    a, b = getattr(train_set, "classes", None), getattr(val_set, "classes", None)
    if a is None or b is None or list(a) == list(b):
        return
    only_train, only_val = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    raise UsageError(f"the train and val folders hold different classes ({len(a)} and {len(b)}; only in "
                     f"train: {', '.join(only_train[:5]) or '-'}; only in val: {', '.join(only_val[:5]) or '-'}): "
                     "give both the same class folders")
