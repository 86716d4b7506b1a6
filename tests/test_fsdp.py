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


def test_sharded_checkpoint_round_trip_and_full_export(one_rank, tmp_path):
    """save_sharded -> load_sharded into a fresh sharded model and optimizer (equal state, the
    same next step); export_full_checkpoint -> one file models.load_checkpoint reads."""
    def train_step(m, opt, x):
        m(x).sum().backward()
        opt.step()
        opt.zero_grad()

    x = torch.randn(4, 3, 32, 32)
    a = fsdp.wrap(_mesa_model(), torch.device("cpu"))
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-2)
    train_step(a, opt_a, x)
    folder = str(tmp_path / "checkpoint")
    fsdp.save_sharded(folder, a, opt_a, {"epoch": 3, "meta": {"mesa": {}}})
    assert fsdp.is_sharded_checkpoint(folder) and not (tmp_path / "checkpoint.tmp").exists()

    torch.manual_seed(1)
    b = fsdp.wrap(_mesa_model(), torch.device("cpu"))
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2)
    assert fsdp.load_sharded(folder, b, opt_b)["epoch"] == 3
    rng = torch.get_rng_state()
    train_step(a, opt_a, x)
    torch.set_rng_state(rng)
    train_step(b, opt_b, x)
    sa, sb = fsdp.full_model_state_dict(a), fsdp.full_model_state_dict(b)
    assert any(k.endswith(".draws") and int(v) == 2 for k, v in sb.items())
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k

    full = fsdp.export_full_checkpoint(folder, str(tmp_path / "full.pth"))
    m = _mesa_model()
    report = models.load_checkpoint(m, str(tmp_path / "full.pth"), verbose=lambda *_: None)
    assert not report.missing_quantizer_keys
    assert all(torch.equal(m.state_dict()[k], v) for k, v in full.items())
    assert any(k.endswith(".iteration") and float(v) == 1 for k, v in full.items())


def test_sharded_model_ema_is_model_ema_v3_and_applied_restores(one_rank):
    """ShardedModelEma on an FSDP2 model == timm's ModelEmaV3 on the same model unsharded, bit for
    bit, after steps that change weights and quantizer ranges; ``applied`` puts the EMA into the
    model and the exact weights back after."""
    from timm.utils import ModelEmaV3

    def step(m, opt, x):
        m(x).sum().backward()
        opt.step()
        opt.zero_grad()

    plain = _mesa_model()
    # (reshard_after_forward=False: after a forward the unsharded parameters stay registered)
    sharded = fsdp.wrap(copy.deepcopy(plain), torch.device("cpu"), reshard_after_forward=False)
    ref = ModelEmaV3(plain, decay=0.8)
    ema = fsdp.ShardedModelEma(sharded, 0.8)
    opt_p = torch.optim.SGD(plain.parameters(), lr=0.1)
    opt_s = torch.optim.SGD(sharded.parameters(), lr=0.1)
    for i in range(3):
        x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(i))
        rng = torch.get_rng_state()
        step(plain, opt_p, x)
        torch.set_rng_state(rng)
        step(sharded, opt_s, x)
        ref.update(plain)
        ema.update(sharded)
    want = ref.module.state_dict()
    got = ema.full_state_dict()
    assert any(k.endswith(".iteration") and float(v) > 0 for k, v in got.items())
    for k in want:
        assert torch.equal(got[k], want[k]), k
    before = fsdp.full_model_state_dict(sharded)
    assert not torch.equal(before["head.weight"], got["head.weight"])
    x = torch.randn(4, 3, 32, 32)
    sharded.eval(), plain.eval(), ref.module.eval()
    with torch.no_grad():
        assert torch.equal(sharded(x), plain(x))  # (leaves the root's parameters unsharded)
        with ema.applied(sharded):
            inside = fsdp.full_model_state_dict(sharded)
            assert all(torch.equal(inside[k], got[k]) for k in got)
            assert torch.equal(sharded(x), ref.module(x))  # the forward runs on the EMA
        assert torch.equal(sharded(x), plain(x))  # and on the model's own weights after
    after = fsdp.full_model_state_dict(sharded)
    assert all(torch.equal(after[k], before[k]) for k in before)
