"""mmseg drop-in (issue 26): mmseg's own Swin UperNet config with only the backbone ``type``
swapped (plus ``ms_policy``) and a PVT Semantic FPN config written as mmseg's sem_fpn ones build
and train one step; ``dict(type='MesaCompressed', backbone=...)`` gives Mesa to mmseg's own Swin
and MiT (one train step, saved bytes vs exact, gradients close, the coverage report logged)."""
from __future__ import annotations

import pytest

# the segmentation stack is optional (pip install -e ".[seg]"): without it these tests skip
for _mod in ("mmengine", "mmcv", "mmseg"):
    pytest.importorskip(_mod, reason=f"{_mod} is not installed (the optional segmentation stack)",
                        exc_type=ImportError)

import copy
import os

import mmseg
import torch
from mmengine.config import Config
from mmengine.model import revert_sync_batchnorm
from mmengine.optim import build_optim_wrapper
from mmengine.registry import init_default_scope
from mmseg.registry import MODELS

import mesa_ops as ms
import models.seg  # noqa: F401  (registers the backbones and MesaCompressed)
import models.seg.compressed as compressed
from benchmarks.seg import random_batch

init_default_scope("mmseg")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MMSEG_CONFIGS = os.path.join(os.path.dirname(mmseg.__file__), ".mim", "configs")
SWIN_UPERNET = "swin/swin-tiny-patch4-window7-in1k-pre_upernet_8xb2-160k_ade20k-512x512.py"
OURS_SWIN = os.path.join(REPO, "configs/seg_mmseg/upernet_mesa-swin-tiny-patch4-window7-in1k-pre_8xb2-160k"
                               "_ade20k-512x512.py")
OURS_PVT = os.path.join(REPO, "configs/seg_mmseg/fpn_mesa-pvt-tiny_4xb4-160k_ade20k-512x512.py")


def _batch(n=2, size=64, classes=150, seed=0):
    """(images (n, 3, size, size), n SegDataSample with random labels): the benchmark's batch."""
    return random_batch(n, size, num_classes=classes, seed=seed)


def _one_train_step(cfg, size=64):
    """Build the config's segmentor (SyncBN -> BN, as mmengine's Runner does on one process) and
    its optimizer wrapper, and run one step of loss, backward, update on a small batch (the
    data preprocessor's 512x512 padding bypassed: the model itself is the config's)."""
    model = revert_sync_batchnorm(MODELS.build(cfg.model)).train()
    optim = build_optim_wrapper(model, cfg.optim_wrapper)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    inputs, samples = _batch(size=size)
    losses = model.loss(inputs, samples)
    loss, log_vars = model.parse_losses(losses)
    optim.update_params(loss)
    assert torch.isfinite(loss)
    moved = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])]
    return model, optim, log_vars, moved


def _unscoped(node):
    """A config dict without the ``_scope_`` keys mmengine adds to an ``mmseg::`` base's dicts."""
    if isinstance(node, dict):
        return {k: _unscoped(v) for k, v in node.items() if k != "_scope_"}
    if isinstance(node, (list, tuple)):
        return type(node)(_unscoped(v) for v in node)
    return node


def _no_decay_numel(model, optim) -> int:
    ids = {id(p) for g in optim.optimizer.param_groups if g["weight_decay"] == 0 for p in g["params"]}
    return sum(p.numel() for p in model.backbone.parameters() if id(p) in ids)


def test_mmseg_swin_upernet_config_with_backbone_type_swapped():
    """mmseg's swin-tiny UperNet config, backbone type -> MesaSwinTransformer (+ ms_policy): the
    only differences from mmseg's config; it builds, its paramwise no-decay rules hit the same
    parameters as on mmseg's SwinTransformer, and one train step updates the backbone."""
    theirs = Config.fromfile(os.path.join(MMSEG_CONFIGS, SWIN_UPERNET))
    ours = Config.fromfile(OURS_SWIN)
    a, b = copy.deepcopy(theirs.to_dict()), _unscoped(copy.deepcopy(ours.to_dict()))
    assert b["model"]["backbone"].pop("type") == "MesaSwinTransformer"
    assert b["model"]["backbone"].pop("ms_policy") == "mesa8"
    assert a["model"]["backbone"].pop("type") == "SwinTransformer"
    b.pop("custom_imports")
    assert a == b  # nothing else changed

    model, optim, log_vars, moved = _one_train_step(ours)
    bb = model.backbone
    assert type(bb).__name__ == "MesaSwinTransformer" and bb.num_features == [96, 192, 384, 768]
    assert sum(bool(m.enable) for m in bb.modules() if isinstance(m, ms.layers.MESA_LAYERS)) > 0
    assert any(n.startswith("backbone.body.layers.0.blocks.0.attn.qkv") for n in moved)
    assert {"decode.loss_ce", "aux.loss_ce"} <= set(log_vars)
    ref = revert_sync_batchnorm(MODELS.build(theirs.model))
    assert sum(p.numel() for p in bb.parameters()) == sum(p.numel() for p in ref.backbone.parameters())
    assert _no_decay_numel(model, optim) == _no_decay_numel(ref, build_optim_wrapper(ref, theirs.optim_wrapper))


def test_pvt_fpn_config_like_mmseg_sem_fpn():
    """A Semantic FPN config on mmseg's sem_fpn one with mmdet's PVT v1 arguments and type
    MesaPVT builds (PVT-Tiny widths wired into the FPN) and trains one step; Mesa off
    (ms_policy=None) builds the same model."""
    cfg = Config.fromfile(OURS_PVT)
    assert cfg.model.neck.type == "FPN" and cfg.model.decode_head.type == "FPNHead"
    model, _, log_vars, moved = _one_train_step(cfg)
    bb = model.backbone
    assert type(bb).__name__ == "MesaPVT" and bb.num_features == [64, 128, 320, 512]
    assert list(bb.body.depths) == [2, 2, 2, 2]
    assert any(n.startswith("backbone.body.block1.0.attn.q") for n in moved)
    assert "decode.loss_ce" in log_vars
    cfg.model.backbone.ms_policy = None
    exact = MODELS.build(cfg.model).backbone
    assert not any(m.enable for m in exact.modules() if isinstance(m, ms.layers.MESA_LAYERS))


# ---- MesaCompressed ----------------------------------------------------------------------------
INNER = {
    "SwinTransformer": dict(type="SwinTransformer", embed_dims=32, depths=(2, 2), num_heads=(2, 4),
                            strides=(4, 2), out_indices=(0, 1), window_size=4, drop_path_rate=0.),
    "MixVisionTransformer": dict(type="MixVisionTransformer", embed_dims=16, num_layers=[1, 1, 1, 1],
                                 num_heads=[1, 2, 4, 8], drop_path_rate=0.),
}


@pytest.mark.parametrize("name", sorted(INNER))
def test_mesa_compressed_mmseg_backbone(name, monkeypatch):
    """MesaCompressed on mmseg's own SwinTransformer and MixVisionTransformer: the backbone's own
    class and state-dict keys (plus quantizer state), the coverage report in the log, and one
    train step (AdamW) vs the exact backbone: fewer saved bytes, gradients close."""
    logged = []
    monkeypatch.setattr(compressed, "print_log", lambda msg, logger=None: logged.append(msg))
    inner = INNER[name]
    torch.manual_seed(0)
    exact = MODELS.build(inner)
    torch.manual_seed(0)
    mesa = MODELS.build(dict(type="MesaCompressed", backbone=inner, ms_policy="mesa8"))
    assert type(mesa).__name__ == name
    extra = set(mesa.state_dict()) - set(exact.state_dict())
    assert set(exact.state_dict()) <= set(mesa.state_dict())
    assert extra and all(k.rsplit(".", 1)[-1] in ("clip_val", "shift", "iteration", "draws") for k in extra)
    mesa.load_state_dict(exact.state_dict(), strict=False)
    text = "\n".join(logged)
    assert f"MesaCompressed({name}): mesa compress (mesa8):" in text
    assert "total saved for backward" in text and "uncompressed remainder" in text
    print("\n" + text)
    report = mesa.mesa_compress_report
    assert report.audit is not None and report.converted.get("Linear", 0) > 0
    # mmseg's attention code (WindowMSA matmuls / nn.MultiheadAttention) stays exact and is listed
    assert any(("attn" in n) for n, _, _ in report.unsupported), report.unsupported

    x = torch.randn(2, 3, 64, 64)
    res = {}
    for tag, m in (("exact", exact), ("mesa", mesa)):
        m.train()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        with ms.SavedActivationMeter(m) as meter:
            outs = m(x)
        g = torch.Generator().manual_seed(1)
        sum((o * torch.randn(o.shape, generator=g)).mean() for o in outs).backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters()}
        opt.step()
        res[tag] = (meter.total_bytes, grads)
    ratio = res["mesa"][0] / res["exact"][0]
    ge = torch.cat([g.flatten() for g in res["exact"][1].values()])
    gm = torch.cat([res["mesa"][1][n].flatten() for n in res["exact"][1]])
    err = ((gm - ge).norm() / ge.norm()).item()
    worst = max(((res["mesa"][1][n] - g).norm() / g.norm()).item() for n, g in res["exact"][1].items())
    print(f"{name}: saved {res['mesa'][0] / 2**20:.2f} MiB with Mesa vs {res['exact'][0] / 2**20:.2f} MiB "
          f"exact ({ratio:.3f}x); gradient error {err:.4f} (worst tensor {worst:.4f})")
    assert ratio < 0.6, ratio
    assert 0 < err < 0.05 and worst < 0.1, (err, worst)
    assert all(torch.isfinite(p).all() for p in mesa.parameters())


def test_mesa_compressed_errors():
    with pytest.raises(TypeError, match="config dict"):
        MODELS.build(dict(type="MesaCompressed", backbone="SwinTransformer"))
    with pytest.raises(ValueError, match="audit_input_size"):
        MODELS.build(dict(type="MesaCompressed", backbone=INNER["SwinTransformer"], audit_input_size=(64,)))
    m = MODELS.build(dict(type="MesaCompressed", backbone=INNER["SwinTransformer"], ms_policy="off",
                          audit_input_size=None))
    assert m.mesa_compress_report.audit is None
    assert not any(q.enable for q in m.modules() if isinstance(q, ms.layers.MESA_LAYERS))
