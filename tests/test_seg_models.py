"""Segmentation backbones and configs (models.seg, configs/seg): every config builds, the
backbones compute what the classification models compute, Mesa leaves the forward unchanged and
cuts the saved activations of a segmentation train step, classification checkpoints load."""
from __future__ import annotations

import pytest

# the segmentation stack is optional (pip install -e ".[seg]"): without it these tests skip
for _mod in ("mmengine", "mmcv", "mmseg"):
    pytest.importorskip(_mod, reason=f"{_mod} is not installed (the optional segmentation stack)",
                        exc_type=ImportError)

import glob
import os
import sys

import torch
from mmengine.config import Config
from mmengine.model import revert_sync_batchnorm
from mmengine.registry import init_default_scope
from mmseg.registry import MODELS

import mesa_ops as ms
import models
import models.seg  # noqa: F401  (registers the backbones; stubs mmcv._ext under mmcv-lite)
from models.seg import MesaPVT, MesaSwinTransformer, mmcv_ext_stub

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEG_CONFIGS = sorted(glob.glob(os.path.join(REPO, "configs", "seg", "*.py")))
EXPECTED = 14  # Semantic FPN + PVT-Ti/S/M/L and UperNet + Swin-T/S/B, each exact and Mesa 8-bit
DEPTHS = {("MesaPVT", "tiny"): (2, 2, 2, 2), ("MesaPVT", "small"): (3, 4, 6, 3),
          ("MesaPVT", "medium"): (3, 4, 18, 3), ("MesaPVT", "large"): (3, 8, 27, 3),
          ("MesaSwinTransformer", "tiny"): (2, 2, 6, 2), ("MesaSwinTransformer", "small"): (2, 2, 18, 2),
          ("MesaSwinTransformer", "base"): (2, 2, 18, 2)}

init_default_scope("mmseg")


def _outputs_close(a, b, atol):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.shape == y.shape
        torch.testing.assert_close(x, y, rtol=0, atol=atol)


# ---- mmcv-lite ---------------------------------------------------------------------------------
def test_mmcv_ext_stub_only_when_compiled_ops_missing():
    import importlib.util

    import mmcv.ops  # noqa: F401  (imports every op module: fails without _ext or its stub)

    stub = mmcv_ext_stub.is_stub_active()
    assert stub == (importlib.util.find_spec("mmcv._ext").loader is None)
    assert mmcv_ext_stub.install() == stub  # idempotent
    if stub:
        with pytest.raises(NotImplementedError, match="nms.*mmcv-lite"):
            sys.modules["mmcv._ext"].nms(torch.zeros(1, 4), torch.zeros(1), 0.5)


# ---- configs ---------------------------------------------------------------------------------
@pytest.fixture
def no_weight_init(monkeypatch):
    """Random weight init is most of the build time of 14 models (up to Swin-B + UperNet): this
    test checks structure and wiring, so the init functions leave the tensors as allocated."""
    def keep(t, *args, **kwargs):
        return t
    for mod in (models.layers, models.pvt, models.swin):
        monkeypatch.setattr(mod, "trunc_normal_", keep)
    for name in ("trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "uniform_", "normal_", "constant_",
                 "xavier_uniform_"):
        monkeypatch.setattr(torch.nn.init, name, keep)


def test_every_seg_config_loads_and_builds(no_weight_init):
    """All configs/seg/ configs load and build their segmentor on CPU: Mesa on exactly in the
    -mesa8 ones, the paper's recipes, the heads wired to the backbones' stage widths."""
    names = [os.path.basename(p) for p in SEG_CONFIGS]
    assert len(names) == EXPECTED, names
    for path in SEG_CONFIGS:
        cfg = Config.fromfile(path)
        mesa = "mesa8" in os.path.basename(path)
        bb = cfg.model.backbone
        assert (bb.ms_policy is not None) == mesa, path
        assert cfg.custom_imports.imports == ["models.seg"]
        assert cfg.crop_size == (512, 512) and cfg.model.data_preprocessor.size == (512, 512)
        assert cfg.model.decode_head.num_classes == 150
        opt = cfg.optim_wrapper.optimizer
        if bb.type == "MesaPVT":
            assert (opt.type, opt.lr, opt.weight_decay) == ("AdamW", 2e-4, 1e-4)
            assert cfg.train_cfg.max_iters == 40000 and cfg.train_dataloader.batch_size == 4
            assert [(s.type, s.power) for s in cfg.param_scheduler] == [("PolyLR", 0.9)]
            assert (cfg.model.neck.type, cfg.model.decode_head.type) == ("FPN", "FPNHead")
        else:
            assert (opt.type, opt.lr, opt.weight_decay) == ("AdamW", 6e-5, 0.01)
            assert cfg.train_cfg.max_iters == 160000 and cfg.train_dataloader.batch_size == 2
            warm, poly = cfg.param_scheduler
            assert (warm.type, warm.end, poly.type, poly.power) == ("LinearLR", 1500, "PolyLR", 1.0)
            keys = cfg.optim_wrapper.paramwise_cfg.custom_keys
            assert all(keys[k].decay_mult == 0 for k in ("absolute_pos_embed", "relative_position_bias_table",
                                                         "norm"))
            assert (cfg.model.decode_head.type, cfg.model.auxiliary_head.type) == ("UPerHead", "FCNHead")
            assert cfg.model.auxiliary_head.loss_decode.loss_weight == 0.4
        model = MODELS.build(cfg.model)
        enabled = sum(bool(m.enable) for m in model.backbone.modules()
                      if isinstance(m, ms.layers.MESA_LAYERS))
        assert (enabled > 0) == mesa, (path, enabled)
        body = model.backbone.body
        depths = tuple(body.depths) if bb.type == "MesaPVT" else tuple(len(la.blocks) for la in body.layers)
        assert depths == DEPTHS[bb.type, bb.arch], path
        if bb.type == "MesaSwinTransformer":
            assert body.embed_dim == (128 if bb.arch == "base" else 96)
            assert body.layers[2].blocks[0].attn.window_size == (7, 7)
        # the heads are wired to the backbone's stages (a forward checks it for the Tiny models)
        if bb.type == "MesaPVT":
            assert list(model.neck.in_channels) == list(body.embed_dims)
        else:
            assert list(model.decode_head.in_channels) == model.backbone.num_features
            assert model.auxiliary_head.in_channels == model.backbone.num_features[2]
        if bb.arch == "tiny":
            model = revert_sync_batchnorm(model).eval()
            with torch.no_grad():
                for t in model.parameters():
                    t.zero_()  # defined values (the init was skipped)
                out = model.encode_decode(torch.zeros(1, 3, 32, 32),
                                          [dict(img_shape=(32, 32), pad_shape=(32, 32))])
            assert out.shape == (1, 150, 32, 32), path
        del model


def test_configs_inherit_one_hop():
    for path in SEG_CONFIGS:
        text = open(path).read()
        assert "_base_" in text
        for base in glob.glob(os.path.join(REPO, "configs", "seg", "_base_", "*", "*.py")) + \
                glob.glob(os.path.join(REPO, "configs", "seg", "_base_", "*.py")):
            assert "_base_" not in open(base).read(), base


# ---- backbones vs the classification models ----------------------------------------------------
def test_swin_backbone_stages_equal_classification_model():
    kw = dict(depths=(2, 2, 2, 2), num_heads=(1, 2, 4, 8), drop_path_rate=0.)
    bb = MesaSwinTransformer(embed_dims=32, window_size=2, **kw).eval()
    ref = models.swin.SwinTransformer(img_size=128, embed_dim=32, window_size=2, num_classes=0, **kw).eval()
    missing = ref.load_state_dict(bb.body.state_dict(), strict=False).missing_keys
    assert all(k.endswith("attn_mask") or k.startswith("norm.") for k in missing), missing
    for i in range(4):
        getattr(bb, f"norm{i}").forward = lambda x: x  # compare the stage outputs before the norms
    stages = []
    hooks = [layer.blocks[-1].register_forward_hook(lambda m, a, o: stages.append(o)) for layer in ref.layers]
    x = torch.randn(2, 3, 128, 128)
    with torch.no_grad():
        outs = bb(x)
        ref.forward_features(x)
    for h in hooks:
        h.remove()
    want = [s.view(2, 32 // 2 ** i, 32 // 2 ** i, -1).permute(0, 3, 1, 2) for i, s in enumerate(stages)]
    _outputs_close(outs, want, atol=1e-5)
    with torch.no_grad():  # any size: padded to the patch, the windows, the merges
        shapes = [tuple(o.shape) for o in bb(torch.randn(1, 3, 50, 70))]
    assert shapes == [(1, 32, 13, 18), (1, 64, 7, 9), (1, 128, 4, 5), (1, 256, 2, 3)]


def test_pvt_backbone_stages_equal_classification_model():
    bb = MesaPVT(arch="tiny", img_size=64, drop_path_rate=0.).eval()
    ref = models.create_model("pvt_tiny", img_size=64, num_classes=0, drop_path_rate=0.).eval()
    result = ref.load_state_dict(bb.body.state_dict(), strict=False)
    assert all(k == "cls_token" or k.startswith("norm.") for k in result.missing_keys), result.missing_keys
    stages = []
    hooks = [getattr(ref, f"block{i}")[-1].register_forward_hook(lambda m, a, o: stages.append(o))
             for i in range(1, 4)]
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        outs = bb(x)
        ref.forward_features(x)
    for h in hooks:
        h.remove()
    want = [s.reshape(2, 16 // 2 ** i, 16 // 2 ** i, -1).permute(0, 3, 1, 2) for i, s in enumerate(stages)]
    _outputs_close(outs[:3], want, atol=1e-5)  # stage 4 differs: the class token is not used here
    assert tuple(outs[3].shape) == (2, 512, 2, 2)
    with torch.no_grad():  # another size: position embeddings interpolated
        assert [tuple(o.shape[-2:]) for o in bb(torch.randn(1, 3, 96, 128))] == [(24, 32), (12, 16), (6, 8),
                                                                                   (3, 4)]


@pytest.mark.parametrize("kind", ["pvt", "swin"])
def test_mesa_backbone_forward_equals_exact(kind):
    """Mesa stores compressed activations for backward only: the forward (train and eval) equals
    the same backbone's with Mesa off; and it does save fewer bytes."""
    if kind == "pvt":
        bb = MesaPVT(arch="tiny", img_size=64, drop_path_rate=0., ms_policy="configs/mesa/pvt_8bit.txt")
    else:
        bb = MesaSwinTransformer(drop_path_rate=0., ms_policy="configs/mesa/swin_8bit.txt",
                                 embed_dims=48, depths=(2, 2, 2, 2), num_heads=(2, 4, 8, 16))
    x = torch.randn(2, 3, 64, 64)
    results = {}
    for mode in ("mesa", "exact"):
        if mode == "exact":
            ms.policy.set_mesa(bb, enable=False)
        bb.train()
        torch.manual_seed(1)
        with ms.SavedActivationMeter(bb) as meter:
            train_out = bb(x)
        sum(o.float().mean() for o in train_out).backward()
        bb.eval()
        with torch.no_grad():
            eval_out = bb(x)
        results[mode] = (train_out, eval_out, meter.total_bytes)
    _outputs_close([o.detach() for o in results["mesa"][0]], [o.detach() for o in results["exact"][0]], 1e-5)
    _outputs_close(results["mesa"][1], results["exact"][1], 0)
    assert results["mesa"][2] < 0.5 * results["exact"][2], (results["mesa"][2], results["exact"][2])


# ---- checkpoints -----------------------------------------------------------------------------
def test_pvt_init_from_classification_checkpoint(tmp_path):
    """An official-layout PVT checkpoint (224 px, with class token, norm and head) initialises the
    backbone through init_cfg=Pretrained; position embeddings are resized to the crop grid."""
    cls_model = models.create_model("pvt_tiny")
    sd = {k: v for k, v in cls_model.state_dict().items() if k.rsplit(".", 1)[-1] not in
          ("clip_val", "shift", "iteration", "draws")}
    path = tmp_path / "pvt_tiny.pth"
    torch.save({"model": sd}, path)
    bb = MODELS.build(dict(type="MesaPVT", arch="tiny", img_size=128,
                           init_cfg=dict(type="Pretrained", checkpoint=str(path))))
    bb.init_weights()
    torch.testing.assert_close(bb.body.block2[1].attn.q.weight, sd["block2.1.attn.q.weight"])
    assert bb.body.pos_embed1.shape == (1, 32 * 32, 64)
    want = models.checkpoint.resize_pos_embed(sd["pos_embed1"], (32, 32), 0)
    torch.testing.assert_close(bb.body.pos_embed1.data, want)
    with pytest.raises(ValueError, match="init_cfg"):
        MesaPVT(init_cfg=dict(type="Normal"))


def test_swin_init_from_classification_checkpoint(tmp_path):
    kw = dict(embed_dim=32, depths=(2, 2, 2, 2), num_heads=(1, 2, 4, 8))
    cls_model = models.create_model("swin_tiny_patch4_window7_224", **kw)  # window 7, head, norm, masks
    sd = {k: v for k, v in cls_model.state_dict().items() if k.rsplit(".", 1)[-1] not in
          ("clip_val", "shift", "iteration", "draws")}
    path = tmp_path / "swin.pth"
    torch.save(sd, path)
    with pytest.warns(UserWarning, match="pretrained is deprecated"):  # as mmseg's
        bb = MesaSwinTransformer(pretrained=str(path), embed_dims=32, depths=kw["depths"],
                                 num_heads=kw["num_heads"])
    bb.init_weights()
    name = "layers.2.blocks.1.attn.relative_position_bias_table"
    torch.testing.assert_close(bb.body.state_dict()[name], sd[name])
