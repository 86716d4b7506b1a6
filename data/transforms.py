"""Image transforms, as DeiT's ``build_transform``: timm's ``create_transform`` for training
(RandAugment, color jitter, random erasing), resize + center crop for evaluation.

Data sets whose images are stored at 32 px or less (CIFAR, DIGITS) are not resized at such
input sizes: training replaces timm's random-resized crop by ``RandomCrop(size, padding=4)``
(DIGITS: no crop) and evaluation only normalizes, as DeiT does. Image folders (``native=False``:
images of any size) are always resized, at any input size.
"""
from __future__ import annotations

from PIL import Image
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, auto_augment, create_transform
from torchvision import transforms


def _posterize(img, bits_to_keep, **_):
    """timm's ``posterize`` as older Pillows behave: keeping 0 bits gives a black image.

    DeiT's ``rand-m9-mstd0.5-inc1`` draws magnitudes up to 10, where ``PosterizeIncreasing`` keeps
    0 bits; Pillow 13 raises ``ValueError`` for that (12.3 does not), which would stop a training
    run at random."""
    if bits_to_keep <= 0:
        return Image.new(img.mode, img.size)
    return auto_augment.posterize(img, bits_to_keep)


def _augment_ops(t):
    """The timm ``AugmentOp`` objects inside a transform (RandAugment, AutoAugment, AugMix)."""
    for op in getattr(t, "transforms", ()):
        yield from _augment_ops(op)
    for attr in ("ops", "policy"):
        for item in getattr(t, attr, ()) or ():
            for op in (item if isinstance(item, (list, tuple)) else (item,)):
                if isinstance(op, auto_augment.AugmentOp):
                    yield op


def fix_posterize(t):
    """Route every posterize op of ``t`` through :func:`_posterize` (in place); returns ``t``."""
    for op in _augment_ops(t):
        if op.aug_fn is auto_augment.posterize:
            op.aug_fn = _posterize
    return t


def build_transform(is_train: bool, args, hflip: float = 0.5, crop_padding: int = 4, native: bool = True):
    """Transform PIL image -> normalized (3, S, S) float tensor, S = ``args.input_size``.

    Reads ``args.input_size, color_jitter, aa, train_interpolation, reprob, remode, recount,
    eval_crop_ratio``. ``hflip``: horizontal flip probability (0 for digits); ``crop_padding``:
    of the random crop of images of <= 32 px (0: no crop); ``native``: the images are stored at
    the input size (CIFAR, DIGITS, FAKE), else (image folders) of any size."""
    size = int(args.input_size)
    resize_im = size > 32 or not native
    if is_train:
        aa = None if args.aa in (None, "", "none", "None") else args.aa
        t = create_transform(input_size=size, is_training=True, color_jitter=args.color_jitter or None,
                             auto_augment=aa, interpolation=args.train_interpolation, hflip=hflip,
                             re_prob=args.reprob, re_mode=args.remode, re_count=args.recount,
                             mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD)
        if not resize_im:
            if crop_padding:
                t.transforms[0] = transforms.RandomCrop(size, padding=crop_padding)
            else:
                t.transforms[0] = transforms.CenterCrop(size)
        return fix_posterize(t)
    ops = []
    if resize_im:
        ops += [transforms.Resize(int(size / args.eval_crop_ratio),
                                  interpolation=transforms.InterpolationMode.BICUBIC),
                transforms.CenterCrop(size)]
    ops += [transforms.ToTensor(), transforms.Normalize(IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD)]
    return transforms.Compose(ops)
