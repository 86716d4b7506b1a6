"""Every ``mesa_*`` model follows timm's model contract (issue 11), with Mesa off and on.

Reproduces the checks of timm's own ``tests/test_models.py`` (huggingface/pytorch-image-models;
the file is not in the wheel): ``test_model_forward`` (and grad checkpointing gives the same
output), ``test_model_backward`` (every parameter gets a gradient, 42 classes),
``test_model_default_cfgs`` for Swin (NHWC ``forward_features`` matching ``pool_size``) and
``test_model_default_cfgs_non_std`` for DeiT / PVT (token features), each with ``forward_head(...,
pre_logits=True)``, ``reset_classifier(0)`` / ``(0, '')`` and ``num_classes=0, global_pool=''``
at construction, ``test_model_forward_features`` / ``test_model_forward_intermediates_features``
(``features_only``: ``feature_info`` channels / reductions match the maps) and
``test_model_forward_intermediates`` (final output == ``forward_features``); plus
``group_matcher`` with timm's layer-wise LR decay, ``no_weight_decay``, ``pretrained_cfg``
values, ``prune_intermediate_layers``, and loading a checkpoint into a ``features_only`` model.

Sizes: timm's tests cap the input size (96-384 px) but keep depth and width; here too only the
input is reduced: DeiT 32 px (2x2 patches), Swin 64 px with window 4 (stages 16/8/4/2 px: shifted
windows in the first two, one window in the last two), PVT 64 px.

Runtime: the checks that need no forward (cfg, feature_info, group_matcher, drop-path defaults)
build all 16 models on the meta device. The tests that run models cover by default the smallest
model of each family: DeiT-Ti (plain and distilled), Swin-T, PVT-Ti; the 12 others (DeiT-S/B,
Swin-S/B, PVT-S/M/L: the same code at other widths / depths, 2-8 s each to build on this 2-core
machine) run the same tests under ``-m slow``.
"""
from __future__ import annotations

import contextlib
import importlib.util
import math

import pytest
import timm
import torch
from timm.models import FeatureInfo, group_parameters
from timm.optim import create_optimizer_v2

try:
    from timm.optim import param_groups_layer_decay
except ImportError:  # timm < 1.0.12 (the floor is 1.0.3)
    from timm.optim.optim_factory import param_groups_layer_decay

import mesa_ops as ms
import models
from models.checkpoint import save_checkpoint

ALL = sorted(timm.list_models("mesa_*"))
FAST = {"mesa_deit_tiny_patch16_224", "mesa_deit_tiny_distilled_patch16_224",
        "mesa_swin_tiny_patch4_window7_224", "mesa_pvt_tiny"}
RUN = [pytest.param(n, marks=() if n in FAST else pytest.mark.slow) for n in ALL]
HAS_CCKPT = importlib.util.find_spec("mesa_ops.checkpoint") is not None


def family(name: str) -> str:
    return models.registry.model_entry(name).family


def small(name: str) -> dict:
    """The reduced input size (see the module docstring); drop path off so that runs compare."""
    return {"deit": dict(img_size=32), "swin": dict(img_size=64, window_size=4),
            "pvt": dict(img_size=64)}[family(name)] | dict(drop_path_rate=0.0)


def image(model, batch=2):
    return torch.randn(batch, *model.pretrained_cfg["input_size"])


def cat(out):
    return torch.cat(out) if isinstance(out, tuple) else out


def quantizers_ran(model) -> int:
    return sum(int(float(m.iteration) > 0) for m in model.modules()
               if isinstance(m, ms.QuantMixin) and m.enable)


# ---- no forward needed: all 16 models (meta device) ----------------------------------------------
@pytest.mark.parametrize("name", ALL)
def test_pretrained_cfg(name):
    cfg = timm.models.get_pretrained_cfg(name).to_dict()
    fam = family(name)
    assert cfg["architecture"] == name and cfg["num_classes"] == 1000
    assert cfg["mean"] == timm.data.IMAGENET_DEFAULT_MEAN and cfg["std"] == timm.data.IMAGENET_DEFAULT_STD
    assert cfg["interpolation"] == "bicubic" and cfg["url"].endswith(".pth")
    assert cfg["license"] == {"deit": "apache-2.0", "swin": "mit", "pvt": "apache-2.0"}[fam]
    side = 384 if name.endswith("384") else 224
    assert cfg["input_size"] == (3, side, side)
    expected_crop = {"deit": 0.875, "swin": 0.9, "pvt": 0.875}[fam] if side == 224 else 1.0
    assert cfg["crop_pct"] == expected_crop
    assert cfg["first_conv"] == ("patch_embed1.proj" if fam == "pvt" else "patch_embed.proj")
    assert cfg["classifier"] == (("head", "head_dist") if "distilled" in name else "head")
    assert cfg.get("pool_size") == ((side // 32,) * 2 if fam != "deit" else None)
    assert cfg["fixed_input_size"] is (fam != "pvt")


@pytest.mark.parametrize("name", ALL)
def test_structure_feature_info_group_matcher(name):
    """feature_info, head / first-conv names, no_weight_decay, group_matcher and timm's layer-wise
    LR decay groups, Swin's official drop-path defaults (issue 12, item 8)."""
    with torch.device("meta"):
        model = timm.create_model(name)
    fam = family(name)
    params = dict(model.named_parameters())
    sd = model.state_dict()
    cfg = model.pretrained_cfg
    for key in (cfg["classifier"] if isinstance(cfg["classifier"], tuple) else (cfg["classifier"],)):
        assert key + ".weight" in sd
    assert cfg["first_conv"] + ".weight" in sd
    assert model.num_classes == 1000 and model.num_features == model.head_hidden_size > 0
    info = FeatureInfo(model.feature_info, len(model.feature_info))
    if fam == "deit":
        depth, patch = len(model.blocks), model.patch_embed.patch_size[0]
        assert info.channels() == [model.embed_dim] * depth and info.reduction() == [patch] * depth
        assert info.module_name() == [f"blocks.{i}" for i in range(depth)]
        n_blocks = depth
    elif fam == "swin":
        c = model.embed_dim
        assert info.channels() == [c, 2 * c, 4 * c, 8 * c] and info.reduction() == [4, 8, 16, 32]
        n_blocks = sum(len(layer.blocks) for layer in model.layers)
        rate = {"tiny": 0.2, "small": 0.3, "base": 0.5}[name.split("_")[2]]
        probs = [b.drop_path.drop_prob for layer in model.layers for b in layer.blocks[1:]]
        assert max(probs) == pytest.approx(rate), f"{name}: drop-path rate {max(probs)}, official {rate}"
    else:
        assert info.channels() == [64, 128, 320, 512] and info.reduction() == [4, 8, 16, 32]
        n_blocks = sum(len(getattr(model, f"block{i}")) for i in range(1, 5))
    assert set(model.no_weight_decay()) <= set(params) | {"dist_token"}
    if fam == "pvt":  # position embeddings get no weight decay (as timm's DeiT / PVT-v2)
        assert model.no_weight_decay() == {"cls_token", "pos_embed1", "pos_embed2", "pos_embed3", "pos_embed4"}
    # layer-wise LR decay: stem, one group per block, head; every parameter placed
    layer_of = group_parameters(model, model.group_matcher(), reverse=True)
    assert set(layer_of) == set(params)
    assert max(layer_of.values()) + 1 == n_blocks + 2
    stem = "pos_embed1" if fam == "pvt" else "patch_embed.proj.weight"
    assert layer_of[stem] == 0 and layer_of["head.weight"] == n_blocks + 1
    assert layer_of["norm.weight"] == n_blocks  # with the last block, as timm does
    coarse = group_parameters(model, model.group_matcher(coarse=True), reverse=True)
    assert max(coarse.values()) + 1 < max(layer_of.values()) + 1 or fam == "deit"
    groups = param_groups_layer_decay(model, weight_decay=0.05, no_weight_decay_list=model.no_weight_decay(),
                                      layer_decay=0.75)
    scales = {g["lr_scale"] for g in groups}
    assert max(scales) == 1.0 and min(scales) == pytest.approx(0.75 ** (n_blocks + 1))
    grouped = [p for g in groups for p in g["params"]]
    assert len(grouped) == len(params)


# ---- forward: timm's test_model_forward / default_cfgs / forward_intermediates ---------------------
@pytest.mark.parametrize("name", RUN)
def test_forward_default_cfgs_intermediates(name):
    """timm's test_model_forward, test_model_default_cfgs(_non_std) and
    test_model_forward_intermediates, Mesa off (eval: Mesa acts only in training)."""
    model = timm.create_model(name, **small(name)).eval()
    fam = family(name)
    x = image(model, batch=1)
    with torch.no_grad():
        out = model(x)
        assert out.shape == (1, 1000) and not torch.isnan(out).any()
        feats = model.forward_features(x)
        pre = model.forward_head(feats, pre_logits=True)
        assert torch.equal(model.forward_head(feats), out)
        assert pre.shape == (1, model.head_hidden_size)
        if fam == "swin":  # standard model: NHWC map of pool_size
            assert model.output_fmt == "NHWC"
            assert feats.shape == (1, *model.pretrained_cfg["pool_size"], model.num_features)
        else:  # token model (non-std in timm's tests)
            assert feats.dim() == 3 and feats.shape[-1] == model.num_features

        # forward_intermediates: one map per feature_info entry, final == forward_features
        info = FeatureInfo(model.feature_info, len(model.feature_info))
        final, inter = model.forward_intermediates(x, output_fmt="NCHW")
        assert len(inter) == len(info.channels()) and torch.equal(final, feats)
        H, W = x.shape[-2:]
        for c, r, o in zip(info.channels(), info.reduction(), inter):
            assert o.shape[:2] == (1, c) and not torch.isnan(o).any()
            assert o.shape[2] <= math.ceil(H / r) + 1 and o.shape[3] <= math.ceil(W / r) + 1
        # indices / norm / stop_early as timm's ViT / Swin
        last2 = model.forward_intermediates(x, indices=2, intermediates_only=True)
        assert len(last2) == 2 and all(torch.equal(a, b) for a, b in zip(last2, inter[-2:]))
        first = model.forward_intermediates(x, indices=[0], stop_early=True, intermediates_only=True)
        assert torch.equal(first[0], inter[0])
        normed = model.forward_intermediates(x, indices=[-1], norm=True, intermediates_only=True)[0]
        if fam == "deit":  # the final norm applied to the last block's tokens
            assert torch.equal(normed.flatten(2).transpose(1, 2), feats[:, model.num_prefix_tokens:])
        elif fam == "swin":
            assert torch.equal(normed, feats.permute(0, 3, 1, 2))
        else:
            assert torch.equal(normed.flatten(2).transpose(1, 2), feats[:, 1:])

        # grad checkpointing does not change the output (timm's test_model_forward)
        model.set_grad_checkpointing()
        assert torch.allclose(model(x), out, rtol=1e-4, atol=1e-5)
        with torch.enable_grad():
            ck = model.forward_intermediates(x)[0]
        assert torch.allclose(ck, final, rtol=1e-4, atol=1e-5)
        model.set_grad_checkpointing(False)

        # classifier removed: pooled features (B, head_hidden_size) == pre_logits
        model.reset_classifier(0)
        assert model.num_classes == 0
        assert torch.equal(model(x), pre)
        model.reset_classifier(0, "")
        unpooled = model(x)
        assert torch.equal(unpooled, feats)
        assert unpooled.dim() == (4 if fam == "swin" else 3)
    # classifier and pooling removed at construction
    bare = timm.create_model(name, num_classes=0, global_pool="", **small(name)).eval()
    assert bare.num_classes == 0 and bare.pretrained_cfg["num_classes"] == 0
    with torch.no_grad():
        assert bare(x).shape == feats.shape
    with pytest.raises(ValueError, match="global_pool='max'"):
        timm.create_model(name, global_pool="max", **small(name))
    with pytest.raises(ValueError, match="output_fmt='NHWC'"):
        model.forward_intermediates(x, output_fmt="NHWC")


# ---- backward: timm's test_model_backward, Mesa on and off --------------------------------------
@pytest.mark.parametrize("name", RUN)
def test_backward_mesa_on_and_off(name):
    """timm's test_model_backward (42 classes, batch 2, train): every parameter gets a gradient;
    Mesa switched on by ``timm.create_model(..., ms_policy='mesa8')`` and off by ``set_mesa``;
    the forwards agree (Mesa computes exactly; its attention path and the exact fused SDPA differ
    by float rounding only)."""
    model = timm.create_model(name, num_classes=42, ms_policy="mesa8", **small(name)).train()
    n_params = sum(p.numel() for p in model.parameters())
    x = image(model)
    outs = {}
    for mesa in (True, False):
        ms.policy.set_mesa(model, enable=mesa)
        model.zero_grad(set_to_none=True)
        out = cat(model(x))
        out.mean().backward()
        missing = [n for n, p in model.named_parameters() if p.grad is None]
        assert not missing, f"{name} (mesa={mesa}): no gradient for {missing[:5]}"
        assert sum(p.grad.numel() for p in model.parameters()) == n_params
        assert out.shape[-1] == 42 and not torch.isnan(out).any()
        outs[mesa] = out.detach()
        if mesa:
            assert quantizers_ran(model) > 0
    assert torch.allclose(outs[True], outs[False], rtol=1e-5, atol=1e-5)


# ---- features_only: timm's test_model_forward_features / _intermediates_features ---------------------
@pytest.mark.parametrize("name", RUN)
def test_features_only(name):
    """``features_only=True`` (timm's FeatureGetterNet over forward_intermediates): default
    out_indices and a pruned ``out_indices``; channels / reductions match the NCHW maps, which are
    the full model's intermediates; with Mesa on (train) the pruned extractor trains and
    compresses."""
    fam = family(name)
    full = timm.create_model(name, **small(name)).eval()
    x = image(full, batch=1)
    with torch.no_grad():
        ref = full.forward_intermediates(x, intermediates_only=True)
    feat = timm.create_model(name, features_only=True, **small(name)).eval()
    feat.model.load_state_dict(full.state_dict(), strict=False)  # pruned: a subset of the keys
    default = 3 if fam == "deit" else 4
    channels, reduction = feat.feature_info.channels(), feat.feature_info.reduction()
    assert len(channels) == default and feat.pretrained_cfg["input_size"] == full.pretrained_cfg["input_size"]
    with torch.no_grad():
        outs = feat(x)
    assert len(outs) == default
    H, W = x.shape[-2:]
    for c, r, o, want in zip(channels, reduction, outs, ref[-default:]):
        assert o.shape[1] == c and o.shape[0] == 1 and not torch.isnan(o).any()
        assert o.shape[2] <= math.ceil(H / r) + 1 and o.shape[3] <= math.ceil(W / r) + 1
        assert torch.equal(o, want)

    # a pruned extractor (stages / blocks after the last index dropped), Mesa on, training
    idx = (1, 2) if fam != "deit" else (1, 4)
    pruned = timm.create_model(name, features_only=True, out_indices=idx, ms_policy="mesa8", **small(name))
    pruned.model.load_state_dict(full.state_dict(), strict=False)
    assert [i["num_chs"] for i in pruned.feature_info.get_dicts()] == [full.feature_info[i]["num_chs"]
                                                                       for i in idx]
    if fam == "swin":
        assert len(pruned.model.layers) == 3 and pruned.model.layers[2].downsample is None
    elif fam == "pvt":
        assert pruned.model.num_stages == 3 and not hasattr(pruned.model, "block4")
    else:
        assert len(pruned.model.blocks) == 5
    pruned.train()
    outs = pruned(x)
    for o, i in zip(outs, idx):  # Mesa's forward is exact (its attention path: float rounding apart)
        assert torch.allclose(o.detach(), ref[i], rtol=1e-5, atol=1e-5)
    sum(o.float().pow(2).mean() for o in outs).backward()
    assert all(p.grad is not None for p in pruned.parameters())
    assert quantizers_ran(pruned) > 0


def test_checkpoint_into_features_only(tmp_path):
    """A checkpoint of this repo's format (with quantizer state) loads into a ``features_only``
    model through ``pretrained=<path>`` (weights loaded before the extractor prunes the model)."""
    src = timm.create_model("mesa_swin_tiny_patch4_window7_224", **small("mesa_swin_tiny_patch4_window7_224"))
    path = tmp_path / "swin.pth"
    save_checkpoint(src, path)
    feat = timm.create_model("mesa_swin_tiny_patch4_window7_224", pretrained=str(path), features_only=True,
                             out_indices=(0, 1), **small("mesa_swin_tiny_patch4_window7_224")).eval()
    x = image(src, batch=1)
    with torch.no_grad():
        want = src.eval().forward_intermediates(x, indices=[0, 1], intermediates_only=True)
        got = feat(x)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


# ---- grad checkpointing: plain and compressed, Mesa off and on --------------------------------------
CKPT_MODELS = ["mesa_deit_tiny_distilled_patch16_224", "mesa_swin_tiny_patch4_window7_224", "mesa_pvt_tiny"]


@contextlib.contextmanager
def mesa_disabled(model):
    """Every quantizer off for the block, its previous state restored after."""
    qs = [m for m in model.modules() if isinstance(m, ms.QuantMixin)]
    before = [q.enable for q in qs]
    for q in qs:
        q.enable = False
    try:
        yield
    finally:
        for q, e in zip(qs, before):
            q.enable = e


@pytest.mark.parametrize("bits", [None, pytest.param(8, marks=pytest.mark.skipif(
    not HAS_CCKPT, reason="mesa_ops.checkpoint (compressed checkpointing) is not in this tree"))])
@pytest.mark.parametrize("mesa", [False, True])
@pytest.mark.parametrize("name", CKPT_MODELS)
def test_grad_checkpointing(name, mesa, bits):
    """set_grad_checkpointing(True[, bits]) in training: the same forward; gradients equal to the
    exact step's (plain checkpointing, Mesa off: 1e-5 relative L2) or within quantization noise
    of it (Mesa on or the 8-bit compressed checkpoint: <= 0.25 relative L2; measured 0.01-0.13 on
    these tiny inputs, Mesa alone 0.01-0.04); fewer bytes saved for backward than the
    un-checkpointed step in the same Mesa setting."""
    model = timm.create_model(name, ms_policy="mesa8" if mesa else None, **small(name)).train()
    x = image(model)

    def step():
        model.zero_grad(set_to_none=True)
        with ms.SavedActivationMeter(model, exclude=(x,)) as meter:
            out = cat(model(x))
        out.float().pow(2).mean().backward()
        return out.detach(), torch.cat([p.grad.flatten() for p in model.parameters()]), meter.total_bytes

    with mesa_disabled(model):
        out_exact, g_exact, _ = step()
    out0, _, bytes0 = step()
    model.set_grad_checkpointing(True, bits=bits)
    assert model.grad_checkpointing
    out1, g1, bytes1 = step()
    assert torch.allclose(out1, out0, rtol=1e-5, atol=1e-5)
    assert torch.allclose(out1, out_exact, rtol=1e-5, atol=1e-5)
    err = float((g1 - g_exact).norm() / g_exact.norm())
    assert err <= (1e-5 if not mesa and bits is None else 0.25), f"relative gradient error {err:.2e}"
    assert bytes1 < 0.6 * bytes0, f"checkpointed {bytes1} B vs {bytes0} B"
    model.set_grad_checkpointing(False)
    assert not model.grad_checkpointing


def test_checkpointing_arguments():
    m = timm.create_model("mesa_deit_tiny_patch16_224", img_size=32, grad_checkpointing=True)
    assert m.grad_checkpointing and m.grad_checkpointing_bits is None
    s = timm.create_model("mesa_swin_tiny_patch4_window7_224", use_checkpoint=True, **small(
        "mesa_swin_tiny_patch4_window7_224"))
    assert all(layer.grad_checkpointing for layer in s.layers) and s.layers[0].use_checkpoint
    with pytest.raises(ValueError, match="grad_checkpointing_bits must be None"):
        m.set_grad_checkpointing(True, bits=3)
    if not HAS_CCKPT:
        with pytest.raises(RuntimeError, match="mesa_ops.checkpoint"):
            m.set_grad_checkpointing(True, bits=8)


def test_layer_decay_optimizer():
    """timm's optimizer factory with layer_decay uses the model's group_matcher: the patch
    embedding gets the smallest LR scale, the head 1.0; weight decay skips no_weight_decay()."""
    name = "mesa_swin_tiny_patch4_window7_224"
    model = timm.create_model(name, **small(name))
    opt = create_optimizer_v2(model, "adamw", lr=1e-3, weight_decay=0.05, layer_decay=0.8)
    scale_of = {id(p): (g["lr_scale"], g["weight_decay"]) for g in opt.param_groups for p in g["params"]}
    params = dict(model.named_parameters())
    n_layers = sum(len(layer.blocks) for layer in model.layers) + 2
    assert scale_of[id(params["patch_embed.proj.weight"])] == (pytest.approx(0.8 ** (n_layers - 1)), 0.05)
    assert scale_of[id(params["head.weight"])] == (1.0, 0.05)
    rpb = "layers.0.blocks.0.attn.relative_position_bias_table"
    assert scale_of[id(params[rpb])][1] == 0.0  # no_weight_decay
    # the patch merging of stage 0 shares the layer of stage 0's last block
    assert scale_of[id(params["layers.0.downsample.reduction.weight"])][0] == \
        scale_of[id(params["layers.0.blocks.1.mlp.fc1.weight"])][0]


def test_pvt_optimizer_skips_position_embeddings():
    """create_optimizer_v2 (weight decay off for no_weight_decay() and 1-d parameters): PVT's
    position embeddings and class token get none, its weights 0.05."""
    model = timm.create_model("mesa_pvt_tiny", img_size=64)
    opt = create_optimizer_v2(model, "adamw", lr=1e-3, weight_decay=0.05)
    wd = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    params = dict(model.named_parameters())
    for i in range(1, 5):
        assert wd[id(params[f"pos_embed{i}"])] == 0.0
    assert wd[id(params["cls_token"])] == 0.0 and wd[id(params["head.weight"])] == 0.05


# ---- FX and TorchScript: timm's test_model_forward_fx / backward_fx / forward_torchscript /
# forward_fx_torchscript / forward_torchscript_with_features_fx ------------------------------------
def fx_model(model, train=False):
    """timm's tests/test_models.py ``_create_fx_model``: torchvision's feature extractor over the
    graph output, traced with timm's notrace modules / functions (the Mesa layers among them)."""
    from timm.models import get_notrace_functions, get_notrace_modules
    from torchvision.models.feature_extraction import (NodePathTracer, create_feature_extractor,
                                                       get_graph_node_names)
    kw = dict(leaf_modules=get_notrace_modules(), autowrap_functions=get_notrace_functions(),
              param_shapes_constant=True)
    train_nodes, eval_nodes = get_graph_node_names(model, tracer_kwargs=kw)
    train_return = [train_nodes[-1]]
    if train:
        graph_nodes = list(reversed(NodePathTracer(**kw).trace(model).nodes))
        outs = [n.name for n in graph_nodes[0]._input_nodes.keys()]
        names = [n.name for n in graph_nodes]
        train_return = [train_nodes[-names.index(o)] for o in outs]
    return create_feature_extractor(model, train_return_nodes=train_return, eval_return_nodes=[eval_nodes[-1]],
                                    tracer_kwargs=kw)


def fx_out(fx, x):
    return cat(tuple(fx(x).values()))


def test_mesa_layers_are_fx_leaves():
    from timm.models import get_notrace_functions, get_notrace_modules
    assert set(ms.layers.MESA_LAYERS) <= set(get_notrace_modules())
    assert models.pvt.stage_pos_embed in get_notrace_functions()


@pytest.mark.parametrize("name", RUN)
def test_fx_trace_forward_backward(name):
    """timm's test_model_forward_fx (eval: the traced graph gives the same output, bit for bit)
    and test_model_backward_fx (train, 42 classes: every parameter gets a gradient); then the
    traced eval graph scripts (test_model_forward_fx_torchscript)."""
    model = timm.create_model(name, **small(name)).eval()
    x = image(model, batch=1)
    with torch.inference_mode():
        want = cat(model(x))
        got = fx_out(fx_model(model), x)
    assert torch.equal(got, want) and got.shape == (1, 1000)

    model = timm.create_model(name, num_classes=42, **small(name)).train()
    fx = fx_model(model, train=True)
    out = fx_out(fx, image(model))
    out.mean().backward()
    assert out.shape[-1] == 42 and not torch.isnan(out).any()
    missing = [n for n, p in fx.named_parameters() if p.grad is None]
    assert not missing, missing[:5]
    assert sum(p.grad.numel() for p in fx.parameters()) == sum(p.numel() for p in model.parameters())

    if "distilled" not in name:  # timm excludes the distilled DeiTs (train / eval outputs differ)
        model.eval()
        scripted = torch.jit.script(fx_model(model))
        with torch.inference_mode():
            assert torch.allclose(fx_out(scripted, x), cat(model(x)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", RUN)
def test_torchscript_eval(name):
    """timm's test_model_forward_torchscript: in eval mode a Mesa model (Mesa policy on, which
    acts only in training) scripts like timm's models, with the eager output."""
    with timm.set_scriptable(True):
        model = timm.create_model(name, ms_policy="mesa8", **small(name)).eval()
    scripted = torch.jit.script(model)
    x = image(model, batch=1)
    with torch.inference_mode():
        assert torch.allclose(scripted(x), model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(n for n in FAST if "distilled" not in n))
def test_features_fx(name):
    """features_only=True, feature_cls='fx' (timm's FeatureGraphNet: the outputs of the
    feature_info modules, tokens (B, [P +] N, C)): the feature channels, the stage's tokens of
    forward_intermediates; it scripts (timm's test_model_forward_torchscript_with_features_fx)."""
    full = timm.create_model(name, **small(name)).eval()
    x = image(full, batch=1)
    with torch.inference_mode():
        want = full.forward_intermediates(x, intermediates_only=True)
    with timm.set_scriptable(True):
        feat = timm.create_model(name, features_only=True, feature_cls="fx", **small(name)).eval()
    feat.graph_module.load_state_dict(full.state_dict(), strict=False)  # a subset of the keys
    with torch.inference_mode():
        outs = feat(x)
        scripted = torch.jit.script(feat)(x)
    n = len(feat.feature_info.channels())
    assert isinstance(scripted, list) and len(outs) == len(scripted) == n
    for o, s_, c, w in zip(outs, scripted, feat.feature_info.channels(), want[-n:]):
        assert o.shape[-1] == c and torch.equal(o, s_)
        tokens = w.flatten(2).transpose(1, 2)  # (B, N, C) of the NCHW map
        assert torch.equal(o[:, o.shape[1] - tokens.shape[1]:], tokens)


def test_size_checks_trace_and_name_the_problem():
    """The size checks are torch._assert (as timm's): they trace, and eagerly they still name
    the problem."""
    deit = timm.create_model("mesa_deit_tiny_patch16_224", img_size=32).eval()
    with pytest.raises(AssertionError, match=r"input image size \(48x48\) does not match the model's img_size 32x32"):
        deit(torch.randn(1, 3, 48, 48))
    with pytest.raises(AssertionError, match="expected 4x4 tokens, got 9"):
        models.timm_api.tokens_to_nchw(torch.randn(1, 9, 2), 4, 4)


# ---- pretrained weights: timm's test_model_load_pretrained / test_model_features_pretrained -------
def official_file(name, tmp_path, **kw):
    """A checkpoint in the official layout (no quantizer state) of a randomly initialised model."""
    src = timm.create_model(name, **kw)
    qkeys = models.checkpoint.quantizer_keys(src)
    sd = {k: v for k, v in src.state_dict().items() if k not in qkeys}
    path = tmp_path / f"{name}.pth"
    torch.save({"model": sd}, path)
    return path, sd


@pytest.mark.parametrize("name", RUN)
def test_load_pretrained_adapts_like_timm(name, tmp_path):
    """timm's test_model_load_pretrained / test_model_features_pretrained with the weights from a
    local file (pretrained_cfg_overlay=dict(file=...): no download): another num_classes (5, 0)
    leaves the classifier at its initialisation, in_chans=1 sums the first conv over its input
    channels (timm's adapt_input_conv), everything else loads; features_only loads too."""
    from timm.models import adapt_input_conv
    kw = small(name)
    path, sd = official_file(name, tmp_path, **kw)
    first = timm.models.get_pretrained_cfg(name).first_conv + ".weight"
    heads = [k for k in sd if k.split(".")[0] in ("head", "head_dist")]
    same = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), **kw)
    assert all(torch.equal(same.state_dict()[k], v) for k, v in sd.items())
    m = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), in_chans=1,
                          num_classes=5, **kw)
    own = m.state_dict()
    assert torch.allclose(own[first], adapt_input_conv(1, sd[first]))
    assert own["head.weight"].shape[0] == 5 and not torch.equal(own["head.weight"][:5], sd["head.weight"][:5])
    assert all(torch.equal(own[k], v) for k, v in sd.items() if k != first and k not in heads)
    assert m.pretrained_cfg["num_classes"] == 5 and m.pretrained_cfg["input_size"][0] == 1
    bare = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), in_chans=1,
                             num_classes=0, **kw)
    assert not any(k.startswith("head") for k in bare.state_dict()) and bare.num_classes == 0
    if family(name) != "deit":  # timm's test_model_features_pretrained (standard models)
        feat = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)),
                                 features_only=True, **kw)
        assert all(torch.equal(feat.model.state_dict()[k], sd[k]) for k in feat.model.state_dict() if k in sd)
    # pretrained=<path> takes the same route; a missing file is named
    again = timm.create_model(name, pretrained=str(path), num_classes=5, **kw)
    assert torch.equal(again.state_dict()[first], sd[first])
    with pytest.raises(models.CheckpointError, match="checkpoint not found"):
        timm.create_model(name, pretrained=str(tmp_path / "none.pth"), **kw)


def test_pretrained_cifar100_start(tmp_path):
    """timm.create_model('mesa_...', pretrained=True, num_classes=100) is the fine-tuning start:
    the backbone's weights, a new 100-class head; a Mesa checkpoint's quantizer state loads too."""
    name = "mesa_deit_tiny_patch16_224"
    src = timm.create_model(name, img_size=32, ms_policy="mesa8").train()
    src(torch.randn(2, 3, 32, 32)).mean().backward()  # quantizer state != its initial value
    path = tmp_path / "mesa.pth"
    save_checkpoint(src, path)
    m = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), img_size=32,
                          num_classes=100, ms_policy="mesa8")
    want, got = src.state_dict(), m.state_dict()
    assert got["head.weight"].shape == (100, 192)
    assert all(torch.equal(got[k], v) for k, v in want.items() if not k.startswith("head.") or
               k.rsplit(".", 1)[-1] in ("clip_val", "shift", "iteration"))
    assert float(want["blocks.0.norm1.iteration"]) > 0 and float(got["blocks.0.norm1.iteration"]) > 0
