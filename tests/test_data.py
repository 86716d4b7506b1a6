"""data/: DIGITS (scikit-learn's digits, fixed split), FAKE, the errors for missing ImageNet /
CIFAR-100 (with the expected layout), transforms, and the repeated-augmentation sampler."""
from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

import data
from data import DatasetError, RASampler


def data_args(**kw):
    base = dict(data_set="DIGITS", data_path=None, input_size=32, color_jitter=0.3, aa="rand-m9-mstd0.5-inc1",
                train_interpolation="bicubic", reprob=0.25, remode="pixel", recount=1, eval_crop_ratio=0.875,
                fake_size=64)
    base.update(kw)
    return argparse.Namespace(**base)


def test_digits_split_is_fixed_stratified_and_disjoint():
    xtr, ytr, xva, yva = data.digits_split()
    assert xtr.shape == (1497, 8, 8) and xva.shape == (300, 8, 8) and xtr.dtype == np.uint8
    assert xtr.max() == 255 and xtr.min() == 0
    assert np.bincount(yva, minlength=10).min() >= 28  # stratified: ~30 per class
    again = data.digits_split()
    assert np.array_equal(again[0], xtr) and np.array_equal(again[3], yva)
    train_rows = {x.tobytes() for x in xtr}
    assert sum(x.tobytes() in train_rows for x in xva) < 5  # (the set has a few duplicate images)


def test_digits_dataset_images_and_transforms():
    train, n = data.build_dataset(True, data_args())
    val, _ = data.build_dataset(False, data_args())
    assert n == 10 and len(train) == 1497 and len(val) == 300
    x, y = val[0]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and 0 <= y < 10
    assert torch.equal(val[0][0], x)  # evaluation transform is deterministic
    xt, _ = train[0]
    assert xt.shape == (3, 32, 32)
    raw = data.DigitsDataset(train=False, image_size=16)
    assert raw[0][0].size == (16, 16) and raw[0][0].mode == "RGB"


def test_fake_dataset_is_deterministic_per_index():
    a = data_args(data_set="FAKE", input_size=48, aa="none", reprob=0.0)
    train, n = data.build_dataset(False, a)
    assert n == 10 and len(train) == 16  # validation: a quarter of fake_size, at least 16
    assert torch.equal(train[3][0], train[3][0]) and train[3][0].shape == (3, 48, 48)
    tr, _ = data.build_dataset(True, a)
    assert len(tr) == 64


def test_missing_imagenet_names_the_layout(tmp_path):
    with pytest.raises(DatasetError, match=r"train/n01440764"):
        data.build_dataset(True, data_args(data_set="IMNET", data_path=str(tmp_path / "nope"),
                                           input_size=224))
    (tmp_path / "train" / "a").mkdir(parents=True)
    (tmp_path / "val").mkdir()
    with pytest.raises(DatasetError, match="val"):
        data.build_dataset(False, data_args(data_set="IMNET", data_path=str(tmp_path), input_size=224))
    with pytest.raises(DatasetError, match="needs --data-path"):
        data.build_dataset(True, data_args(data_set="IMNET", data_path=None))


def test_missing_cifar100_names_the_layout_and_never_downloads(tmp_path):
    with pytest.raises(DatasetError, match=r"cifar-100-python/train"):
        data.build_dataset(True, data_args(data_set="CIFAR", data_path=str(tmp_path)))
    assert list(tmp_path.iterdir()) == []  # nothing was downloaded


def test_unknown_dataset():
    with pytest.raises(DatasetError, match="unknown data set"):
        data.build_dataset(True, data_args(data_set="MNIST"))


def test_eval_transform_resizes_and_crops():
    from PIL import Image
    t = data.build_transform(False, data_args(input_size=64))
    assert t(Image.new("RGB", (100, 80))).shape == (3, 64, 64)
    t = data.build_transform(True, data_args(input_size=64))
    assert t(Image.new("RGB", (100, 80))).shape == (3, 64, 64)


@pytest.mark.parametrize("n,world", [(1000, 2), (1000, 4), (100, 2)])
def test_ra_sampler_shards(n, world):
    ds = list(range(n))
    shards = [list(RASampler(ds, num_replicas=world, rank=r, seed=5)) for r in range(world)]
    per_rank = n // 256 * 256 // world or -(-n // world)
    assert all(len(s) == per_rank for s in shards)
    # the three copies of an image go to different ranks (consecutive positions across ranks)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(5)).tolist()
    full = [i for i in perm for _ in range(3)]
    assert shards[0][:4] == full[0::world][:4]
    first = [s[0] for s in shards]
    assert len(set(first[:3])) == 1 if world >= 3 else first[0] == first[1]
    # deterministic per (seed, epoch), different across epochs
    s = RASampler(ds, num_replicas=world, rank=0, seed=5)
    s.set_epoch(1)
    assert list(s) == list(s) and list(s) != shards[0]


def test_ra_sampler_rejects_bad_rank():
    with pytest.raises(ValueError):
        RASampler(list(range(10)), num_replicas=2, rank=2)


def test_randaugment_posterize_at_magnitude_10_keeps_running():
    """DeiT's RandAugment draws magnitude 10 (PosterizeIncreasing keeps 0 bits); with Pillow 13
    timm's posterize raises there (12.3 does not). The training transform gives a black image
    with either, as older Pillows did."""
    from PIL import Image
    from timm.data import auto_augment

    from data.transforms import build_transform

    t = build_transform(True, data_args(aa="rand-m10-n1-mstd0-inc1", reprob=0, color_jitter=0))
    ops = [op for tr in t.transforms if isinstance(tr, auto_augment.RandAugment) for op in tr.ops]
    post = [op for op in ops if op.name == "PosterizeIncreasing"]
    assert len(post) == 1 and post[0].aug_fn is not auto_augment.posterize
    img = Image.new("RGB", (32, 32), (200, 120, 40))
    import PIL

    if int(PIL.__version__.split(".")[0]) >= 13:
        with pytest.raises(ValueError):
            auto_augment.posterize(img, 0)  # the library call this guards against
    post[0].prob = 1.0
    out = post[0](img)
    assert out.size == (32, 32) and out.getextrema() == ((0, 0), (0, 0), (0, 0))
    assert post[0].aug_fn(img, 4).getpixel((0, 0)) == (192, 112, 32)
