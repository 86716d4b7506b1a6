"""ADE20K (MIT SceneParsing, 150 classes) in the layout mmsegmentation 1.x reads, and a tiny
synthetic copy of that layout for tests.

Layout (``configs/seg/_base_/datasets/ade20k.py``: ``data_root='data/ade/ADEChallengeData2016'``,
relative to the directory the tools run from)::

    data/ade/ADEChallengeData2016/
        images/training/ADE_train_00000001.jpg ...        20,210 RGB images
        images/validation/ADE_val_00000001.jpg ...         2,000 RGB images
        annotations/training/ADE_train_00000001.png ...   uint8 label maps, same size as the image:
        annotations/validation/ADE_val_00000001.png ...   0 = "other" (ignored), 1..150 = classes

Get it from http://data.csail.mit.edu/places/ADEchallenge/ADEChallengeData2016.zip and unzip it
into ``data/ade/`` (the zip holds ``ADEChallengeData2016/`` with exactly this layout). mmseg's
``ADE20KDataset`` pairs ``x.jpg`` with ``x.png`` and loads labels with ``reduce_zero_label=True``
(0 -> 255 ignored, k -> k - 1).

:func:`make_synthetic_ade20k` writes the same layout with a few small images (random rectangles
of a handful of classes on a background, labels aligned with the pixels, so a model can fit them)
for the segmentation tests and smoke runs::

    python -c "import data.ade20k as a; a.make_synthetic_ade20k('/tmp/ade/ADEChallengeData2016')"

``python -m data.ade20k ROOT`` checks a copy (pairs per split, or what is missing); ``--synthetic``
writes the synthetic set there first.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from PIL import Image

__all__ = ["NUM_CLASSES", "SPLITS", "layout_paths", "check_layout", "make_synthetic_ade20k"]

NUM_CLASSES = 150
SPLITS = {"training": "ADE_train", "validation": "ADE_val"}


def layout_paths(root) -> dict:
    """{'images/training': Path, ...} of the four directories under ``root``."""
    root = Path(root)
    return {f"{kind}/{split}": root / kind / split for kind in ("images", "annotations") for split in SPLITS}


def check_layout(root) -> dict:
    """Count the image / label pairs per split; raises FileNotFoundError naming a missing
    directory and ValueError naming an image without its label map (or the reverse)."""
    counts = {}
    dirs = layout_paths(root)
    for rel, d in dirs.items():
        if not d.is_dir():
            raise FileNotFoundError(f"ADE20K layout: missing directory {d} (expected {rel} under {root})")
    for split in SPLITS:
        imgs = {p.stem for p in dirs[f"images/{split}"].glob("*.jpg")}
        anns = {p.stem for p in dirs[f"annotations/{split}"].glob("*.png")}
        if imgs != anns:
            odd = sorted(imgs ^ anns)[:5]
            raise ValueError(f"ADE20K {split}: images and annotations differ, e.g. {odd}")
        if not imgs:
            raise ValueError(f"ADE20K {split}: no .jpg images in {dirs[f'images/{split}']}")
        counts[split] = len(imgs)
    return counts


def _sample(rng: np.random.Generator, height: int, width: int, classes: np.ndarray):
    """An (H, W, 3) uint8 image and its (H, W) uint8 label map: background class + rectangles,
    each class drawn in its own colour (plus noise)."""
    label = np.full((height, width), classes[0], dtype=np.uint8)
    for _ in range(int(rng.integers(2, 5))):
        c = classes[int(rng.integers(1, len(classes)))]
        h, w = int(rng.integers(height // 4, height // 2 + 1)), int(rng.integers(width // 4, width // 2 + 1))
        y, x = int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1))
        label[y:y + h, x:x + w] = c
    palette = np.random.default_rng(1234).integers(0, 256, size=(NUM_CLASSES + 1, 3))
    img = palette[label].astype(np.int16) + rng.integers(-20, 21, size=(height, width, 3))
    return np.clip(img, 0, 255).astype(np.uint8), label


def make_synthetic_ade20k(root, num_train: int = 4, num_val: int = 2, size=(96, 128), classes=(1, 2, 3, 5, 8),
                          seed: int = 0) -> dict:
    """Write a tiny ADE20K-format data set under ``root`` (= ``.../ADEChallengeData2016``).

    Args:
        num_train / num_val: images per split.
        size: (H, W) of every image.
        classes: ADE20K label values used (1..150; the first is the background of every image).
    Returns:
        {'training': num_train, 'validation': num_val} (as :func:`check_layout` counts them).
    """
    height, width = size
    classes = np.asarray(classes, dtype=np.uint8)
    if len(classes) < 2 or classes.min() < 1 or classes.max() > NUM_CLASSES:
        raise ValueError(f"classes={tuple(classes)}: need at least 2 values in 1..{NUM_CLASSES}")
    if height < 8 or width < 8:
        raise ValueError(f"size={size}: images must be at least 8x8")
    rng = np.random.default_rng(seed)
    dirs = layout_paths(root)
    for d in dirs.values():
        os.makedirs(d, exist_ok=True)
    for split, count in (("training", num_train), ("validation", num_val)):
        if count < 1:
            raise ValueError(f"{split}: need at least one image, got {count}")
        for i in range(1, count + 1):
            img, label = _sample(rng, height, width, classes)
            stem = f"{SPLITS[split]}_{i:08d}"
            Image.fromarray(img).save(dirs[f"images/{split}"] / f"{stem}.jpg", quality=95)
            Image.fromarray(label).save(dirs[f"annotations/{split}"] / f"{stem}.png")
    return check_layout(root)


def main(argv=None) -> None:
    """``python -m data.ade20k ROOT``: check the layout under ROOT (counts per split, or the
    problem; exit 1); ``--synthetic``: write a tiny synthetic set there first."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m data.ade20k", description=main.__doc__)
    ap.add_argument("root", help="the ADEChallengeData2016 directory")
    ap.add_argument("--synthetic", action="store_true", help="write a tiny synthetic set (4 + 2 images) first")
    a = ap.parse_args(argv)
    if a.synthetic:
        make_synthetic_ade20k(a.root)
    try:
        counts = check_layout(a.root)
    except (FileNotFoundError, ValueError) as exc:
        sys.exit(f"error: {exc}")
    print(f"{a.root}: ADE20K layout ok, " + ", ".join(f"{k} {v} image/label pairs" for k, v in counts.items()))


if __name__ == "__main__":
    main()
