"""Image folders that survive what real data sets hold (issue 50): truncated, empty or mislabelled
files, and image modes whose plain RGB conversion loses the content.

* :func:`load_image`: a file as an RGB PIL image, decoded in full (a truncated file fails here,
  not later inside a transform): 16-bit integer grayscale scaled to 8 bits by one scale (PIL's
  ``convert('RGB')`` clips them: a 16-bit scan turns white), float images scaled from [0, 1],
  transparency composited over white (dropping alpha would show whatever colour transparent
  pixels hold), palette, CMYK, bilevel and the rest converted by PIL.
* :class:`CheckedImageFolder`: torchvision's ``ImageFolder`` whose unreadable images are skipped
  with a warning naming the file (the next readable image of the folder takes the place) and
  listed, one path a line, in ``skip_log``; with ``strict`` the first one is a
  :class:`~data.datasets.DatasetError` naming it. The list is a file so that DataLoader workers
  (forked or spawned) report to the main process.
"""
from __future__ import annotations

import errno
import os
import warnings

import numpy as np
from PIL import Image, UnidentifiedImageError
from torchvision import datasets

__all__ = ["CheckedImageFolder", "load_image", "read_skipped"]

# errors of the system, not of the file: raised, never taken for a bad image
_TRANSIENT = {errno.EIO, errno.ESTALE, errno.EMFILE, errno.ENFILE, errno.EINTR, errno.EAGAIN, errno.ENOMEM}
# what a broken image file raises while PIL opens or decodes it
_BAD_IMAGE = (OSError, UnidentifiedImageError, ValueError, SyntaxError, Image.DecompressionBombError)


def _to_8bit(img: Image.Image) -> Image.Image:
    arr = np.asarray(img)
    if img.mode.startswith("I"):  # 16-bit (PNG opens it as I;16, TIFF as I): 0..65535 -> 0..255,
        # one scale for every image (an 8-bit range stored in I stays as it is)
        top = float(arr.max()) if arr.size else 0.0
        arr = arr.astype(np.float64) / (257.0 if img.mode.startswith("I;16") or top > 255 else 1.0)
    else:  # "F"
        top = float(np.nanmax(arr)) if arr.size else 0.0
        arr = arr.astype(np.float64) * (255.0 if top <= 1.0 else 1.0)
    return Image.fromarray(np.clip(np.round(np.nan_to_num(arr)), 0, 255).astype(np.uint8), mode="L")


def load_image(path: str) -> Image.Image:
    """The image at ``path`` as RGB, fully decoded; raises what PIL raises for a broken file."""
    with open(path, "rb") as f:
        img = Image.open(f)
        img.load()
    if img.mode.startswith("I") or img.mode == "F":
        img = _to_8bit(img)
    if img.mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        img = Image.alpha_composite(white, rgba)
    return img.convert("RGB")


def read_skipped(skip_log: str | None) -> list[str]:
    """The distinct files a :class:`CheckedImageFolder` skipped, in the order they were met."""
    if not skip_log or not os.path.exists(skip_log):
        return []
    with open(skip_log, encoding="utf-8") as f:
        return list(dict.fromkeys(line.rstrip("\n") for line in f if line.strip()))


class CheckedImageFolder(datasets.ImageFolder):
    """``ImageFolder`` through :func:`load_image`, skipping (or, ``strict``, refusing) unreadable
    images; see the module docstring."""

    def __init__(self, root: str, transform=None, strict: bool = False, skip_log: str | None = None):
        super().__init__(root, transform=transform, loader=load_image)
        self.strict, self.skip_log = strict, skip_log

    def _skip(self, path: str, exc: BaseException) -> None:
        from .datasets import DatasetError

        why = f"{type(exc).__name__}: {exc}"
        if self.strict:
            raise DatasetError(f"unreadable image {path} ({why}); remove or replace it, or drop "
                               "--strict-data to skip such files with a warning")
        warnings.warn(f"skipping unreadable image {path} ({why})", stacklevel=2)
        if self.skip_log:
            with open(self.skip_log, "a", encoding="utf-8") as f:
                f.write(path + "\n")

    def __getitem__(self, index: int):
        n = len(self.samples)
        for k in range(n):
            path, target = self.samples[(index + k) % n]
            try:
                img = self.loader(path)
            except _BAD_IMAGE as exc:
                if isinstance(exc, OSError) and exc.errno in _TRANSIENT:
                    raise  # (the system's trouble, not the file's: retrying may work)
                self._skip(path, exc)
                continue
            if self.transform is not None:
                img = self.transform(img)
            if self.target_transform is not None:
                target = self.target_transform(target)
            return img, target
        from .datasets import DatasetError

        raise DatasetError(f"{self.root}: no readable image in the folder")
