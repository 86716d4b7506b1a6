"""FSDP2 (``torch.distributed.fsdp.fully_shard``) with Mesa in one process (a 1-rank gloo group):
the saved-activation meter on a sharded model (DTensor parameters, and the unsharded ones FSDP
registers during forward are not activations), the DCP checkpoint round trip and its export to one
file. The 2-process ``tools/train.py --fsdp`` runs are in tests/test_train_dist.py."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import mesa_ops as ms
import models
from training import fsdp


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=(tmp_path / "store").as_uri(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _mesa_model():
    torch.manual_seed(0)
    m = models.create_model("deit_tiny_patch16_224", patch_size=8, depth=2, embed_dim=32, num_heads=2,
                            img_size=32, num_classes=10)
    models.apply_policy(m, "mesa8", verbose=lambda *_: None)
    return m.train()


def test_saved_activation_meter_on_an_fsdp2_model(one_rank):
    plain = _mesa_model()
    sharded = fsdp.wrap(copy.deepcopy(plain), torch.device("cpu"))
    assert len(fsdp.shard_units(plain)) == 2 and fsdp.is_fsdp(sharded)
    x = torch.randn(4, 3, 32, 32)
    with ms.SavedActivationMeter(plain) as want:
        plain(x).sum()
    with ms.SavedActivationMeter(sharded) as got:  # crashed on DTensor storages before
        sharded(x).sum()
    assert got.total_bytes > 0
    assert got.total_bytes == want.total_bytes, (got.by_type, want.by_type)
