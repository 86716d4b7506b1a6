"""The classification data sets: ImageNet, any ImageFolder, CIFAR-100, DIGITS (scikit-learn's), FAKE.

``build_dataset(is_train, args) -> (dataset, num_classes)`` yields ``(image (3, S, S) float, label)``
pairs through :func:`data.transforms.build_transform`. Nothing is ever downloaded.
"""
from __future__ import annotations

import os

import numpy as np
from PIL import Image
from torch.utils.data import Dataset
from torchvision import datasets

from .images import CheckedImageFolder
from .transforms import build_transform

__all__ = ["DATASETS", "DatasetError", "DigitsDataset", "build_dataset", "dataset_defaults", "digits_split"]


class DatasetError(RuntimeError):
    """A data set that is missing or not in the expected layout."""


# name -> (number of classes, default input size, horizontal-flip probability in training,
#          padding of the random crop of images of <= 32 px)
DATASETS = {
    "IMNET": (1000, 224, 0.5, 4),
    "CIFAR100": (100, 224, 0.5, 4),
    "DIGITS": (10, 32, 0.0, 0),  # not mirror-symmetric; a shift of a 8x8 digit moves whole strokes
    "FAKE": (10, 224, 0.5, 4),
    "FOLDER": (None, 224, 0.5, 4),  # any ImageFolder: the class count is the folder's
}
_ALIASES = {"CIFAR": "CIFAR100", "IMAGENET": "IMNET"}

IMNET_LAYOUT = ("expected ImageNet as an ImageFolder: {root}/train/n01440764/*.JPEG ... and "
                "{root}/val/n01440764/*.JPEG ... (1000 class folders each)")
CIFAR_LAYOUT = ("expected torchvision's CIFAR-100 files {root}/cifar-100-python/meta, "
                "{root}/cifar-100-python/train and {root}/cifar-100-python/test (extract "
                "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz into {root}; "
                "nothing is downloaded)")


def canonical_name(name: str) -> str:
    key = _ALIASES.get(str(name).upper(), str(name).upper())
    if key not in DATASETS:
        raise DatasetError(f"unknown data set {name!r}; choose one of {', '.join(DATASETS)}")
    return key


def dataset_defaults(name: str) -> dict:
    """``{'num_classes', 'input_size', 'hflip', 'crop_padding'}`` of a data set."""
    n, size, hflip, pad = DATASETS[canonical_name(name)]
    return {"num_classes": n, "input_size": size, "hflip": hflip, "crop_padding": pad}


# ---- DIGITS ----------------------------------------------------------------------------------------
DIGITS_VAL = 300
DIGITS_SPLIT_SEED = 0


def digits_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(train images (1497, 8, 8) uint8 0..255, train labels, val images (300, 8, 8), val labels):
    scikit-learn's digits, a fixed stratified split (seed 0)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    images = np.clip(np.round(d.images * (255.0 / 16.0)), 0, 255).astype(np.uint8)
    xtr, xva, ytr, yva = train_test_split(images, d.target, test_size=DIGITS_VAL, stratify=d.target,
                                          random_state=DIGITS_SPLIT_SEED)
    return xtr, ytr.astype(np.int64), xva, yva.astype(np.int64)


class DigitsDataset(Dataset):
    """scikit-learn's 8x8 handwritten digits (10 classes) as RGB PIL images upscaled (bilinear) to
    ``image_size`` px; ``train``: 1497 images, else the 300 held-out ones."""

    def __init__(self, train: bool = True, image_size: int = 32, transform=None):
        xtr, ytr, xva, yva = digits_split()
        x, y = (xtr, ytr) if train else (xva, yva)
        self.images = [Image.fromarray(im, mode="L").resize((image_size, image_size), Image.BILINEAR)
                       .convert("RGB") for im in x]
        self.targets = [int(t) for t in y]
        self.transform = transform
        self.classes = [str(i) for i in range(10)]

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i):
        img = self.images[i]
        if self.transform is not None:
            img = self.transform(img)
        return img, self.targets[i]


# ---- builders --------------------------------------------------------------------------------------
def _require_path(args, name: str) -> str:
    root = getattr(args, "data_path", None)
    if not root:
        raise DatasetError(f"--data-set {name} needs --data-path")
    return os.path.expanduser(str(root))


FOLDER_LAYOUT = ("expected an ImageFolder: {root}/train/<class>/<image> ... and {root}/val/<class>/<image> ... "
                 "(the same class folders in both)")


def _image_folder(root: str, is_train: bool, transform, args, layout: str, what: str):
    split = os.path.join(root, "train" if is_train else "val")
    if not os.path.isdir(split):
        raise DatasetError(f"{what} folder {split} not found; " + layout.format(root=root))
    try:
        return CheckedImageFolder(split, transform=transform, strict=bool(getattr(args, "strict_data", False)),
                                  skip_log=getattr(args, "skip_log", None))
    except (FileNotFoundError, RuntimeError) as exc:
        raise DatasetError(f"{split}: {exc}; " + layout.format(root=root)) from exc


def _cifar100(root: str, is_train: bool, transform):
    try:
        return datasets.CIFAR100(root, train=is_train, transform=transform, download=False)
    except (RuntimeError, OSError, ValueError) as exc:  # torchvision: "Dataset not found or corrupted..."
        raise DatasetError(f"CIFAR-100 not found or corrupted under {root}; "
                           + CIFAR_LAYOUT.format(root=root)) from exc


def build_dataset(is_train: bool, args):
    """(dataset, num_classes) for ``args.data_set`` (see the package docstring).

    Reads ``args.data_set``, ``args.data_path`` (IMNET, FOLDER, CIFAR100), ``args.input_size``,
    ``args.strict_data`` and ``args.skip_log`` (image folders: data.images), the
    augmentation arguments of :func:`data.transforms.build_transform`, and for FAKE
    ``args.fake_size`` (training images; validation gets a quarter, at least 16)."""
    name = canonical_name(args.data_set)
    d = dataset_defaults(name)
    transform = build_transform(is_train, args, hflip=d["hflip"], crop_padding=d["crop_padding"],
                                native=name not in ("IMNET", "FOLDER"))
    if name == "IMNET":
        ds = _image_folder(_require_path(args, name), is_train, transform, args, IMNET_LAYOUT, "ImageNet")
        if len(ds.classes) != d["num_classes"]:
            raise DatasetError(f"{ds.root}: found {len(ds.classes)} class folders, expected 1000 (for a "
                               "data set of your own use --data-set FOLDER); "
                               + IMNET_LAYOUT.format(root=_require_path(args, name)))
    elif name == "FOLDER":
        ds = _image_folder(_require_path(args, name), is_train, transform, args, FOLDER_LAYOUT, "image")
        return ds, len(ds.classes)
    elif name == "CIFAR100":
        ds = _cifar100(_require_path(args, name), is_train, transform)
    elif name == "DIGITS":
        ds = DigitsDataset(train=is_train, image_size=min(32, int(args.input_size)), transform=transform)
    else:
        n = int(getattr(args, "fake_size", 1024) or 1024)
        size = int(args.input_size)
        ds = datasets.FakeData(size=n if is_train else max(16, n // 4), image_size=(3, size, size),
                               num_classes=d["num_classes"], transform=transform,
                               random_offset=0 if is_train else 10 ** 7)
    return ds, d["num_classes"]
