"""The checkpoints users bring (issue 37, items 1 and 2).

* The original Mesa code's checkpoints (ziplab/Mesa: DeiT with ``convert_by_num_groups(model, 3)``,
  the patch embedding's conv with 3 groups; Swin with ``convert_by_group_size(model, 32)``, the
  3-channel stem with 0 groups), built here from the documented key names and shapes: the weights
  load, the quantizers that do not fit are named in one line (``--eval``: not used;
  ``--resume``: start afresh, the others continue).
* Full checkpoints holding a yacs ``CfgNode`` (the official Swin code's ``config``): refused under
  ``weights_only=True`` with the flag that reads them named; ``--trust-checkpoint`` evaluates them
  at the accuracy of the weights they hold.
* safetensors: timm's key layout (Swin's too) and ours for ``--finetune`` / ``--resume`` /
  ``--eval``; an export stock timm loads (``pretrained_cfg_overlay=dict(file=...)``), bit for bit.
"""
from __future__ import annotations

import argparse
import re
import sys
import types

import pytest
import timm
import torch
from safetensors.torch import load_file, save_file

import models
import training
from models.checkpoint import CheckpointError
from training.args import parse_args

# a DeiT-Ti of 1 block, width 48, 3 heads (so that the original's 3 groups divide every layer) on
# 32 px DIGITS, patch 8: seconds per epoch
TINY = ["--model", "deit_tiny_patch16_224", "--model-kwargs", "patch_size=8", "depth=1", "embed_dim=48",
        "num_heads=3", "--input-size", "32", "--num-workers", "0", "--print-freq", "100", "--device", "cpu",
        "--data-set", "DIGITS", "--batch-size", "128", "--unscale-lr", "--lr", "2e-3", "--warmup-epochs", "0",
        "--mixup", "0", "--cutmix", "0", "--no-tensorboard"]
DEIT_KW = dict(img_size=32, patch_size=8, depth=1, embed_dim=48, num_heads=3, num_classes=10)
SWIN_KW = dict(img_size=32, patch_size=4, window_size=4, embed_dim=32, depths=(1, 1), num_heads=(1, 2),
               num_classes=5)
ACC = re.compile(r"^\* Acc@1 [\d.]+ Acc@5 [\d.]+ loss [\d.]+$", re.MULTILINE)
QUIET = dict(verbose=lambda *_: None)


def run(argv) -> dict:
    return training.main(parse_args([str(a) for a in argv]))


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch, tmp_path):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(k, raising=False)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One epoch of Mesa 8-bit training on DIGITS: (checkpoint path, its --eval accuracy line)."""
    out = tmp_path_factory.mktemp("digits")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run(TINY + ["--epochs", "1", "--output-dir", out, "--mesa-bits", "8"])
    finally:
        torch.set_num_threads(n)
    return out / "checkpoint.pth"


def _eval(path, capsys, *extra):
    run(TINY + ["--eval", "--resume", path, *extra])
    text = capsys.readouterr().out
    return ACC.findall(text), text


def _original_deit_layout(sd: dict) -> dict:
    """This repo's DeiT state dict -> the original Mesa DeiT after ``convert_by_num_groups(model, 3)``:
    quantizer Parameters ``clip_val`` / ``shift`` (3,) and ``iteration`` (1,) on every layer it
    converted, the patch embedding's conv included; no draw counters, no SDPA quantizers."""
    out = {k: v for k, v in sd.items() if not k.endswith(".draws") and ".attn.sdpa." not in k}
    it = max((v for k, v in sd.items() if k.endswith(".iteration")), key=float)
    out["patch_embed.proj.clip_val"] = torch.tensor([2.0, 2.5, 3.0])
    out["patch_embed.proj.shift"] = torch.tensor([-2.0, -2.1, -1.9])
    out["patch_embed.proj.iteration"] = it.clone().reshape(1)
    return out


# ---- item 1: the original Mesa's checkpoints ----------------------------------------------------------
def test_original_num_groups_layout_loads_with_its_stem_reset():
    model = models.create_model("deit_tiny_patch16_224", **DEIT_KW, ms_policy="mesa8")
    sd = _original_deit_layout(model.state_dict())
    fresh = models.create_model("deit_tiny_patch16_224", **DEIT_KW, ms_policy="mesa8")
    with pytest.raises(CheckpointError, match=r"(?s)patch_embed.proj.clip_val: checkpoint \(3,\) vs model "
                                              r"\(1,\).*reset_quantizers=True"):
        models.load_checkpoint(fresh, sd, **QUIET)
    report = models.load_checkpoint(fresh, sd, reset_quantizers=True, **QUIET)
    assert report.reset_quantizers == [("patch_embed.proj", (3,), (1,))]
    assert "1 quantizers' state did not fit" in report.summary()
    own = fresh.state_dict()
    stem = [k for k in own if k.startswith("patch_embed.proj.") and k.rsplit(".", 1)[-1] in
            ("clip_val", "shift", "iteration", "draws")]
    # all of the stem's quantizer state stays initial (not its iteration beside a fresh range)
    assert float(own["patch_embed.proj.iteration"]) == 0 and len(stem) == 4
    for k, v in sd.items():
        if k not in ("patch_embed.proj.clip_val", "patch_embed.proj.shift", "patch_embed.proj.iteration"):
            assert torch.equal(own[k], v), k


def test_original_group_size_layout_swin_zero_group_stem():
    """swin-mesa's ``convert_by_group_size(model, 32)``: every quantizer with channels // 32
    groups, the 3-channel stem with 0 (shape (0,))."""
    model = models.create_model("swin_tiny_patch4_window7_224", **SWIN_KW)
    sd = {k: v for k, v in model.state_dict().items() if not k.endswith((".draws",)) and ".sdpa." not in k}
    sd["patch_embed.proj.clip_val"] = torch.ones(0)
    sd["patch_embed.proj.shift"] = torch.zeros(0)
    sd["patch_embed.proj.iteration"] = torch.tensor([7.0])
    sd["layers.0.blocks.0.mlp.fc1.clip_val"] = torch.full((1,), 3.0)  # 32 channels / 32: fits
    fresh = models.create_model("swin_tiny_patch4_window7_224", **SWIN_KW)
    report = models.load_checkpoint(fresh, sd, reset_quantizers=True, **QUIET)
    assert report.reset_quantizers == [("patch_embed.proj", (0,), (1,))]
    assert float(fresh.patch_embed.proj.iteration) == 0 and fresh.patch_embed.proj.clip_val.shape == (1,)
    assert float(fresh.layers[0].blocks[0].mlp.fc1.clip_val) == 3.0
    fresh.train()
    fresh(torch.randn(2, 3, 32, 32)).sum().backward()  # the model trains after the load


def _yacs_module(monkeypatch):
    """A stand-in for ``yacs.config`` (not a dependency here): its ``CfgNode`` pickles under the
    name the official Swin code's checkpoints carry, ``yacs.config.CfgNode``."""
    yacs, config = types.ModuleType("yacs"), types.ModuleType("yacs.config")

    class CfgNode(dict):
        pass
    CfgNode.__module__, CfgNode.__qualname__ = "yacs.config", "CfgNode"
    config.CfgNode = CfgNode
    yacs.config = config
    monkeypatch.setitem(sys.modules, "yacs", yacs)
    monkeypatch.setitem(sys.modules, "yacs.config", config)
    return CfgNode


def test_eval_of_original_layouts_gives_the_weights_accuracy(trained, tmp_path, capsys, monkeypatch):
    ours, _ = _eval(trained, capsys)
    assert len(ours) == 1
    ck = torch.load(trained, weights_only=True)
    # the deit-mesa layout after convert_by_num_groups(model, 3), with argparse args as its main.py saves
    path = tmp_path / "deit_mesa.pth"
    torch.save({"model": _original_deit_layout(ck["model"]), "epoch": 299, "max_accuracy": 72.1,
                "args": argparse.Namespace(model="deit_tiny_patch16_224", ms_policy="policy_tiny-8bit.txt")}, path)
    got, text = _eval(path, capsys)
    assert got == ours
    line = [ln for ln in text.splitlines() if "did not fit" in ln]
    assert len(line) == 1 and "1 quantizers' state" in line[0] and "are not used in evaluation" in line[0]
    # the Swin code's full layout: its yacs config is refused without the flag, the flag is named
    cfg = _yacs_module(monkeypatch)
    full = tmp_path / "full.pth"
    torch.save({"model": _original_deit_layout(ck["model"]), "config": cfg(MODEL=cfg(TYPE="deit")),
                "epoch": 299, "max_accuracy": 72.1}, full)
    with pytest.raises(CheckpointError, match=r"yacs\.config\.CfgNode.*add --trust-checkpoint"):
        run(TINY + ["--eval", "--resume", full])
    got, text = _eval(full, capsys, "--trust-checkpoint")
    assert got == ours
    assert "WARNING: --trust-checkpoint: reading" in text


def test_resume_of_original_layout_keeps_fitting_ranges(trained, tmp_path, capsys):
    ck = torch.load(trained, weights_only=True)
    path = tmp_path / "orig_full.pth"
    sd = _original_deit_layout(ck["model"])
    groups = ck["model"]["blocks.0.norm1.clip_val"].numel()
    sd["blocks.0.norm1.clip_val"] = torch.ones(2 * groups)  # trained with other groups than this model's
    sd["blocks.0.norm1.shift"] = torch.zeros(2 * groups)
    ema = {"module." + k: v for k, v in _original_deit_layout(
        {k[len("module."):]: v for k, v in ck["model_ema"].items()}).items()}
    ema["module.blocks.0.norm1.clip_val"] = torch.ones(2 * groups)  # the EMA holds the same shapes
    ema["module.blocks.0.norm1.shift"] = torch.zeros(2 * groups)
    obj = dict(ck, model=sd, model_ema=ema)
    obj.pop("checksum")
    torch.save(obj, path)
    out = tmp_path / "cont"
    run(TINY + ["--epochs", "2", "--mesa-bits", "8", "--output-dir", out, "--resume", path])
    text = capsys.readouterr().out
    line = [ln for ln in text.splitlines() if "did not fit" in ln]
    assert len(line) == 1 and line[0].endswith(
        f"2 quantizers' state did not fit this model's groups and was not loaded (e.g. blocks.0.norm1: "
        f"checkpoint ({2 * groups},) vs model ({groups},)): they start afresh"), line
    after = torch.load(out / "checkpoint.pth", weights_only=True)["model"]
    steps = 1497 // 128
    before = float(ck["model"]["blocks.0.norm2.iteration"])
    assert before == steps
    # norm1 started afresh (all its state: iteration too), norm2 continued from the checkpoint
    assert float(after["blocks.0.norm1.iteration"]) == steps
    assert float(after["blocks.0.norm2.iteration"]) == before + steps
    assert float(after["patch_embed.proj.iteration"]) == 0  # (mesa8 leaves the stem exact)
    # the EMA was taken from the checkpoint (its weights), its mismatched quantizers afresh
    ema_after = torch.load(out / "checkpoint.pth", weights_only=True)["model_ema"]
    assert ema_after["module.blocks.0.norm1.clip_val"].shape == (groups,)
    w0, w1 = ck["model_ema"]["module.head.weight"], ema_after["module.head.weight"]
    assert (w1 - w0).abs().max() < 1e-3 < (w1 - after["head.weight"]).abs().max()


# ---- item 2: safetensors -------------------------------------------------------------------------------
@pytest.mark.parametrize("name,kw", [("deit_tiny_patch16_224", DEIT_KW), ("swin_tiny_patch4_window7_224", SWIN_KW)])
def test_timm_safetensors_load_and_export_loads_in_stock_timm(name, kw, tmp_path):
    torch.manual_seed(0)
    ref = timm.create_model(name, **kw).eval()
    src = tmp_path / "model.safetensors"  # what timm's hub holds: timm's keys
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(src))
    ours = models.create_model(name, **kw).eval()
    report = models.load_checkpoint(ours, src, **QUIET)
    assert report.format == "official" and not report.reset_quantizers
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(ours(x), ref(x), atol=1e-5, rtol=0)
    out = tmp_path / "export.safetensors"
    written = models.export.export_safetensors(ours, out)
    assert not [k for k in written if k.endswith(("clip_val", "iteration", "draws"))]
    assert set(load_file(str(out))) == set(ref.state_dict())
    back = timm.create_model(name, pretrained=True, **kw,
                             pretrained_cfg_overlay=dict(file=str(out), num_classes=kw["num_classes"])).eval()
    for k, v in ref.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


def test_safetensors_for_finetune_eval_and_the_export_tool(trained, tmp_path, capsys):
    from tools import export_weights

    ours, _ = _eval(trained, capsys)
    out = tmp_path / "run.safetensors"
    export_weights.main([str(trained), str(out)])
    text = capsys.readouterr().out
    assert "wrote" in text and "timm layout" in text
    call = re.search(r"load with timm: (timm\.create_model\(.*\))$", text, re.MULTILINE).group(1)
    tm = eval(call, {"timm": timm})  # the printed call, as a user pastes it
    assert isinstance(tm, timm.models.VisionTransformer)
    assert torch.equal(tm.head.weight, torch.load(trained, weights_only=True)["model"]["head.weight"])
    got, _ = _eval(out, capsys)  # --eval of the safetensors file: the same accuracy
    assert got == ours
    ema = tmp_path / "ema.safetensors"
    export_weights.main([str(trained), str(ema), "--ema"])
    capsys.readouterr()
    ck = torch.load(trained, weights_only=True)
    assert torch.equal(load_file(str(ema))["head.weight"], ck["model_ema"]["module.head.weight"])  # (ModelEmaV3: module.)
    assert not torch.equal(ck["model_ema"]["module.head.weight"], ck["model"]["head.weight"])
    # --finetune from the file: weights loaded, training runs
    run(TINY + ["--epochs", "1", "--finetune", out, "--output-dir", tmp_path / "ft"])
    assert "loaded" in capsys.readouterr().out
    # --resume from weights alone: the model EMA starts from them, not from the initialisation
    run(TINY + ["--epochs", "1", "--resume", out, "--output-dir", tmp_path / "rs", "--model-ema-eval"])
    text = capsys.readouterr().out
    assert "it starts from the loaded weights" in text
    assert len([ln for ln in text.splitlines() if ln.startswith("Accuracy of the EMA model")]) == 1
    ema_head = torch.load(tmp_path / "rs" / "checkpoint.pth", weights_only=True)["model_ema"]["module.head.weight"]
    loaded = load_file(str(out))["head.weight"]
    assert (ema_head - loaded).abs().max() < 1e-3 < (ema_head - ck["model_ema"]["module.head.weight"]).abs().max()
    # PVT v1 has no timm counterpart: the timm layout is refused, this repo's layout round-trips
    pvt = models.create_model("pvt_tiny", img_size=32, num_classes=3, depths=(1, 1, 1, 1))
    with pytest.raises(ValueError, match="timm has no model"):
        models.export.export_safetensors(pvt, tmp_path / "pvt.safetensors")
    models.export.export_safetensors(pvt, tmp_path / "pvt.safetensors", layout="mesa")
    again = models.create_model("pvt_tiny", img_size=32, num_classes=3, depths=(1, 1, 1, 1))
    models.load_checkpoint(again, tmp_path / "pvt.safetensors", **QUIET)
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in pvt.state_dict().items()
               if not k.endswith(("clip_val", "shift", "iteration", "draws")))
    with pytest.raises(CheckpointError, match="not a readable safetensors"):
        (tmp_path / "bad.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
        models.load_checkpoint(again, tmp_path / "bad.safetensors", **QUIET)
