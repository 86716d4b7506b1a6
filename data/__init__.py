"""Classification data sets and samplers for ``tools/train.py`` (no data is stored here).

    from data import build_dataset, build_transform, RASampler
    train_set, num_classes = build_dataset(is_train=True, args=args)   # args: see training.args

Data sets (``--data-set``):

* ``IMNET``    ImageNet as an ImageFolder: ``<data-path>/train/<class>/*.JPEG``,
  ``<data-path>/val/<class>/...``
* ``FOLDER``   any ImageFolder: ``<data-path>/train/<class>/<image>``, ``<data-path>/val/<class>/...``,
  as many classes as folders (the same in both)
* ``CIFAR100`` torchvision's on-disk format ``<data-path>/cifar-100-python/{meta,train,test}``; never
  downloaded (``CIFAR`` is accepted, DeiT's name)
* ``DIGITS``   the 1797 8x8 handwritten digits that scikit-learn ships, upscaled to RGB (32 px by
  default), a fixed stratified 1497 / 300 train / val split: a real data set that needs no download
* ``FAKE``     synthetic images (torchvision ``FakeData``: random pixels, random labels)

Missing or malformed data raises :class:`DatasetError` with the expected layout. In image folders
an unreadable image is skipped with a warning naming it (``--strict-data``: an error), see
:mod:`data.images`.
"""
from .datasets import DATASETS, DatasetError, DigitsDataset, build_dataset, dataset_defaults, digits_split
from .samplers import RASampler
from .transforms import build_transform

__all__ = [
                       "DATASETS",
                       "DatasetError",
                       "DigitsDataset",
                       "RASampler",
                       "build_dataset",
                       "build_transform",
                       "dataset_defaults",
                       "digits_split",
]
