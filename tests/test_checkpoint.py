"""models.load_checkpoint / save_checkpoint: every supported format, written here, loads (official
DeiT / Swin / PVT layouts as bare state dicts or ``{'model': ...}``, this repo's checkpoints with
quantizer state, the original Mesa code's training checkpoints), resizing for another resolution
or window works, and wrong checkpoints fail with errors naming the keys."""
from __future__ import annotations

import argparse
import pathlib

import pytest
import timm
import torch
import torch.nn.functional as F

import mesa_ops as ms
import models
from models.checkpoint import QUANT_BUFFERS, CheckpointError, quantizer_keys


def official_state_dict(model):
    return {k: v for k, v in model.state_dict().items() if k.rsplit(".", 1)[-1] not in QUANT_BUFFERS}


def quiet(*_):
    pass


def train_step(model, x):
    out = model.train()(x)
    (sum(o.pow(2).mean() for o in out) if isinstance(out, tuple) else out.pow(2).mean()).backward()


# ---- official formats ----------------------------------------------------------------------------
@pytest.mark.parametrize("wrap", [True, False], ids=["model-dict", "bare"])
def test_official_deit_checkpoint(tmp_path, wrap):
    """timm's deit_tiny has the official DeiT key layout: its weights, saved as the official
    files are, load into our Mesa model; only the quantizer state is missing, and the outputs match."""
    ref = timm.create_model("deit_tiny_patch16_224", pretrained=False).eval()
    sd = ref.state_dict()
    path = tmp_path / "deit_tiny_patch16_224.pth"
    torch.save({"model": sd} if wrap else sd, path)
    model = models.create_model("deit_tiny_patch16_224", ms_policy="mesa8")
    report = models.load_checkpoint(model, path, verbose=quiet)
    assert report.format == "official"
    assert set(report.missing_quantizer_keys) == quantizer_keys(model)  # exactly the quantizer state
    assert set(report.loaded_keys) == set(sd)
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        assert (model.eval()(x) - ref(x)).abs().max() <= 1e-5
    # create_model(pretrained=path) takes the same route
    m2 = models.create_model("deit_tiny_patch16_224", pretrained=str(path),
                             checkpoint_kwargs={"verbose": quiet})
    assert torch.equal(m2.pos_embed, sd["pos_embed"])


def test_official_swin_and_pvt_checkpoints(tmp_path):
    for name in ("swin_tiny_patch4_window7_224", "pvt_tiny"):
        src = models.create_model(name)
        sd = official_state_dict(src)
        if name.startswith("swin"):
            assert "layers.0.blocks.1.attn_mask" in sd
            assert "layers.0.blocks.0.attn.relative_position_index" in sd
        path = tmp_path / f"{name}.pth"
        torch.save({"model": sd} if name.startswith("swin") else sd, path)
        dst = models.create_model(name, ms_policy="mesa8")
        report = models.load_checkpoint(dst, path, verbose=quiet)
        assert set(report.missing_quantizer_keys) == quantizer_keys(dst)
        x = torch.randn(1, 3, 224, 224)
        with torch.no_grad():
            assert torch.equal(src.eval()(x), dst.eval()(x))


def test_url_and_ddp_prefix(tmp_path, monkeypatch):
    src = models.create_model("pvt_tiny", img_size=64)
    path = tmp_path / "pvt_tiny_ddp.pth"
    torch.save({"model": {"module." + k: v for k, v in official_state_dict(src).items()}}, path)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "hub"))  # torch.hub's download cache
    dst = models.create_model("pvt_tiny", img_size=64)
    report = models.load_checkpoint(dst, pathlib.Path(path).as_uri(), verbose=quiet)
    assert report.source.startswith("file://")
    assert torch.equal(dst.head.weight, src.head.weight)


# ---- this repo and the original Mesa code -----------------------------------------------------------
def test_this_repo_checkpoint_roundtrip(tmp_path):
    model = models.create_model("swin_tiny_patch4_window7_224", img_size=64, window_size=4, ms_policy="mesa8")
    train_step(model, torch.randn(2, 3, 64, 64))
    q = model.layers[0].blocks[0].attn.sdpa.quant_q  # mesa8: attention through the Mesa SDPA
    assert float(q.iteration) == 1 and not torch.equal(q.clip_val, torch.ones_like(q.clip_val))
    path = tmp_path / "ours.pth"
    models.save_checkpoint(model, path, extra={"epoch": 3})
    obj = torch.load(path, weights_only=True)  # plain types only
    assert obj["epoch"] == 3 and obj["meta"]["architecture"] == "swin_tiny_patch4_window7_224"
    assert obj["meta"]["mesa"]["layers.0.blocks.0.attn.sdpa"] == {"enable": True, "bits": 8}
    fresh = models.create_model("swin_tiny_patch4_window7_224", img_size=64, window_size=4)
    report = models.load_checkpoint(fresh, path, verbose=quiet)
    assert report.format == "mesa-repro" and not report.missing_quantizer_keys
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    with pytest.raises(ValueError, match="reserved"):
        models.save_checkpoint(model, tmp_path / "x.pth", extra={"model": 1})


def _original_mesa_deit_state_dict(model):
    """What the original Mesa DeiT demo saves: every Linear / LayerNorm / GELU with quantizer
    Parameters clip_val (G,), shift (G,), iteration (1,); MatMul and Softmax with quant1 / quant2;
    the patch embedding a plain nn.Conv2d (no quantizer state)."""
    sd = {}
    for k, v in official_state_dict(model).items():
        sd[k] = v.clone()
    for name, m in model.named_modules():
        if isinstance(m, (ms.MatMul, ms.Softmax)):
            holders = [(f"{name}.quant1", m.quant_groups), (f"{name}.quant2", m.quant_groups)]
        elif isinstance(m, (ms.Linear, ms.LayerNorm, ms.GELU)):
            holders = [(name, m.quant_groups)]
        else:
            continue
        for prefix, g in holders:
            sd[f"{prefix}.clip_val"] = torch.rand(g) + 0.5
            sd[f"{prefix}.shift"] = -torch.rand(g)
            sd[f"{prefix}.iteration"] = torch.tensor([1250.0])
    return sd


def test_original_mesa_checkpoint(tmp_path):
    model = models.create_model("deit_tiny_patch16_224", img_size=32)
    sd = _original_mesa_deit_state_dict(model)
    path = tmp_path / "mesa_deit_tiny.pth"
    args = argparse.Namespace(model="deit_ms_tiny_patch16_224", lr=5e-4,
                              ms_policy="config/policy_tiny-8bit.txt")
    torch.save({"model": sd, "optimizer": {"state": {}, "param_groups": []}, "epoch": 299, "args": args},
               path)
    dst = models.create_model("deit_tiny_patch16_224", img_size=32, ms_policy="mesa8")
    report = models.load_checkpoint(dst, path, verbose=quiet)  # weights_only=True, Namespace allowed
    assert report.format == "mesa"
    # the original code has no quantizer on the patch embedding and no fused-attention SDPA module
    sdpa = [k for k in report.missing_quantizer_keys if ".attn.sdpa." in k]
    assert len(sdpa) == 12 * 4 * 4  # blocks x (q, k, v, out) x (clip_val, shift, iteration, draws)
    assert sorted(set(report.missing_quantizer_keys) - set(sdpa)) == [
        "patch_embed.proj.clip_val", "patch_embed.proj.draws", "patch_embed.proj.iteration",
        "patch_embed.proj.shift"]
    # where the original has the iteration, the draw counter (not in its checkpoints) follows it
    assert int(dst.head.draws) == 1250 and "head.draws" in report.derived_keys
    assert torch.equal(dst.blocks[3].attn.softmax.quant2.clip_val,
                       sd["blocks.3.attn.softmax.quant2.clip_val"])
    assert torch.equal(dst.blocks[0].mlp.act.shift, sd["blocks.0.mlp.act.shift"])
    assert float(dst.head.iteration) == 1250
    # the running estimates continue from the checkpoint (EMA, not a fresh first-step range)
    # (the head: qkv, fc1 and fc2 reuse the packed copies of the LayerNorms and the GELU)
    clip = dst.head.clip_val.clone()
    train_step(dst, torch.randn(2, 3, 32, 32))
    assert float(dst.head.iteration) == 1251
    assert not torch.equal(dst.head.clip_val, clip)


def test_quantizer_state_into_plain_model_is_ignored_and_reported():
    from functools import partial
    import torch.nn as nn

    mesa = models.create_model("deit_tiny_patch16_224", img_size=32)
    sd = _original_mesa_deit_state_dict(mesa)
    plain = models.create_model("deit_tiny_patch16_224", img_size=32, linear_layer=nn.Linear,
                                norm_layer=partial(nn.LayerNorm, eps=1e-6), act_layer=nn.GELU)
    report = models.load_checkpoint(plain, sd, verbose=quiet)
    assert "blocks.0.attn.qkv.clip_val" in report.ignored_quantizer_keys
    assert "blocks.0.attn.mm1.quant1.clip_val" not in report.ignored_quantizer_keys  # still a Mesa MatMul


# ---- resizing -------------------------------------------------------------------------------------
def test_deit_pos_embed_resized():
    src = models.create_model("deit_tiny_distilled_patch16_224")
    sd = official_state_dict(src)
    dst = models.create_model("deit_tiny_distilled_patch16_224", img_size=160)
    report = models.load_checkpoint(dst, sd, verbose=quiet)
    assert report.resized_keys == ["pos_embed (1, 198, 192)->(1, 102, 192)"]
    pe = sd["pos_embed"]
    assert torch.equal(dst.pos_embed[:, :2], pe[:, :2])  # cls and dist tokens kept
    grid = F.interpolate(pe[:, 2:].reshape(1, 14, 14, -1).permute(0, 3, 1, 2), size=(10, 10), mode="bicubic",
                         align_corners=False).permute(0, 2, 3, 1).reshape(1, 100, -1)
    assert torch.allclose(dst.pos_embed[:, 2:], grid)
    dst.eval()(torch.randn(1, 3, 160, 160))


def test_swin_window_resized():
    """A window-7 / 224px checkpoint into a window-4 / 64px model: the bias tables are resized,
    relative_position_index and attn_mask come from the model's own geometry."""
    src = models.create_model("swin_tiny_patch4_window7_224")
    dst = models.create_model("swin_tiny_patch4_window7_224", img_size=64, window_size=4)
    report = models.load_checkpoint(dst, {"model": official_state_dict(src)}, verbose=quiet)
    resized = [k.split()[0] for k in report.resized_keys]
    assert len(resized) == 12 and all(k.endswith("relative_position_bias_table") for k in resized)
    assert "layers.0.blocks.1.attn_mask" in report.derived_keys
    blk = dst.layers[0].blocks[1]
    assert blk.attn.relative_position_bias_table.shape == (49, 3)
    assert torch.equal(blk.attn.relative_position_index, models.swin.relative_position_index((4, 4)))
    assert torch.equal(blk.attn_mask, blk._attn_mask())
    assert torch.equal(dst.layers[0].blocks[0].attn.qkv.weight, src.layers[0].blocks[0].attn.qkv.weight)
    dst.eval()(torch.randn(1, 3, 64, 64))


def test_pvt_pos_embed_resized():
    src = models.create_model("pvt_tiny")
    dst = models.create_model("pvt_tiny", img_size=128)
    report = models.load_checkpoint(dst, official_state_dict(src), verbose=quiet)
    assert sorted(k.split()[0] for k in report.resized_keys) == ["pos_embed1", "pos_embed2", "pos_embed3",
                                                                  "pos_embed4"]
    assert dst.pos_embed4.shape == (1, 4 * 4 + 1, 512)
    assert torch.equal(dst.pos_embed4[:, :1], src.pos_embed4[:, :1])


# ---- wrong checkpoints ----------------------------------------------------------------------------
def test_wrong_architecture_fails_naming_keys():
    swin = official_state_dict(models.create_model("swin_tiny_patch4_window7_224", img_size=64,
                                                   window_size=4))
    deit = models.create_model("deit_tiny_patch16_224", img_size=32)
    with pytest.raises(CheckpointError) as err:
        models.load_checkpoint(deit, swin, verbose=quiet)
    msg = str(err.value)
    assert "missing from the checkpoint" in msg and "blocks.0.attn.qkv.weight" in msg
    assert "not in the model" in msg and "layers.0.blocks.0.attn.relative_position_bias_table" in msg
    assert "clip_val" not in msg.split("missing from the checkpoint")[1].split("not in the model")[0]


def test_distilled_mismatch_and_missing_key():
    dist = official_state_dict(models.create_model("deit_tiny_distilled_patch16_224", img_size=32))
    plain = models.create_model("deit_tiny_patch16_224", img_size=32)
    with pytest.raises(CheckpointError, match=r"not in the model \(3\):\n  dist_token\n  head_dist.weight"):
        models.load_checkpoint(plain, dist, verbose=quiet)
    sd = official_state_dict(plain)
    del sd["blocks.5.mlp.fc2.bias"]
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint \(1\):\n  blocks.5.mlp.fc2.bias"):
        models.load_checkpoint(plain, sd, verbose=quiet)


def test_head_mismatch_and_skip():
    sd = official_state_dict(models.create_model("deit_tiny_patch16_224", img_size=32))
    model = models.create_model("deit_tiny_patch16_224", img_size=32, num_classes=10)
    with pytest.raises(CheckpointError, match=r"head.weight: checkpoint \(1000, 192\) vs model \(10, 192\)"):
        models.load_checkpoint(model, sd, verbose=quiet)
    head = model.head.weight.clone()
    report = models.load_checkpoint(model, sd, skip=("head.*",), verbose=quiet)  # fine-tuning on 10 classes
    assert report.skipped_keys == ["head.bias", "head.clip_val", "head.draws", "head.iteration", "head.shift",
                                   "head.weight"]
    assert torch.equal(model.head.weight, head)
    assert torch.equal(model.blocks[0].attn.qkv.weight, sd["blocks.0.attn.qkv.weight"])


def test_quantizer_group_mismatch_fails_with_hint():
    demo = models.create_model("swin_tiny_patch4_window7_224", img_size=64, window_size=4,
                               quant_group_size=32)
    ours = models.create_model("swin_tiny_patch4_window7_224", img_size=64, window_size=4)
    with pytest.raises(CheckpointError, match=r"(?s)layers.0.blocks.0.mlp.act.clip_val: checkpoint "
                                              r"\(12,\) vs model \(3,\).*reset_quantizers=True.*quant_group_size"):
        models.load_checkpoint(ours, demo.state_dict(), verbose=quiet)
    report = models.load_checkpoint(ours, demo.state_dict(), verbose=quiet, reset_quantizers=True)
    assert ("layers.0.blocks.0.mlp.act", (12,), (3,)) in report.reset_quantizers
    models.load_checkpoint(models.create_model("swin_tiny_patch4_window7_224", img_size=64, window_size=4,
                                               quant_group_size=32), demo.state_dict(), verbose=quiet)


def test_unreadable_files(tmp_path):
    model = models.create_model("deit_tiny_patch16_224", img_size=32)
    with pytest.raises(CheckpointError, match="checkpoint not found"):
        models.load_checkpoint(model, tmp_path / "nope.pth")
    garbage = tmp_path / "garbage.pth"
    garbage.write_bytes(b"this is not a checkpoint")
    with pytest.raises(CheckpointError, match="garbage.pth"):
        models.load_checkpoint(model, garbage)
    unsafe = tmp_path / "unsafe.pth"
    torch.save({"model": official_state_dict(model), "extra": pathlib.PurePosixPath("/x")}, unsafe)
    with pytest.raises(CheckpointError, match="weights_only=False"):
        models.load_checkpoint(model, unsafe)
    models.load_checkpoint(model, unsafe, weights_only=False, verbose=quiet)  # trusted: explicit opt-in
    not_sd = tmp_path / "not_sd.pth"
    torch.save({"epoch": 3, "acc": 0.5}, not_sd)
    with pytest.raises(CheckpointError, match="not a state dict"):
        models.load_checkpoint(model, not_sd)
