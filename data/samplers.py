"""Repeated-augmentation sampler (Hoffer et al. 2020; DeiT's ``RASampler``) for DDP."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.utils.data import Sampler


class RASampler(Sampler):
    """Each rank sees a shard of a shuffled index list in which every sample appears ``num_repeats``
    times in a row, so the copies of one image (augmented differently) land on different ranks.

    As DeiT, an epoch has ``floor(len // 256 * 256 / world)`` samples per rank (data sets of fewer
    than 256 images: ``ceil(len / world)``). The order depends on ``seed`` and the epoch only
    (:meth:`set_epoch`), so runs and resumed runs see the same batches.
    """

    def __init__(self, dataset, num_replicas=None, rank=None, shuffle=True, num_repeats: int = 3,
                 seed: int = 0):
        if num_replicas is None:
            num_replicas = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if num_repeats < 1:
            raise ValueError(f"num_repeats must be >= 1, got {num_repeats}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in [0, {num_replicas})")
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0
        self.seed = seed
        self.shuffle = shuffle
        self.num_repeats = num_repeats
        n = len(dataset)
        self.num_samples = int(math.ceil(n * num_repeats / num_replicas))
        self.total_size = self.num_samples * num_replicas
        selected = n // 256 * 256 // num_replicas
        self.num_selected_samples = selected if selected > 0 else int(math.ceil(n / num_replicas))

    def __iter__(self):
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(len(self.dataset), generator=g).tolist()
        else:
            indices = list(range(len(self.dataset)))
        indices = [i for i in indices for _ in range(self.num_repeats)]
        indices += indices[:self.total_size - len(indices)]
        assert len(indices) == self.total_size
        indices = indices[self.rank:self.total_size:self.num_replicas]
        assert len(indices) == self.num_samples
        return iter(indices[:self.num_selected_samples])

    def __len__(self) -> int:
        return self.num_selected_samples

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
