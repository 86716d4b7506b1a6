"""The DeiT / Swin / PVT models of ``models/``: architecture (parameter counts, key layout), agreement
with timm's implementations, Mesa on vs off, SDPA vs explicit attention, registry and timm
registration, forward + backward of every registered model, and the saved-activation savings.

CPU and small: reduced resolutions where the architecture allows (DeiT 32 px, Swin 64 px with
window 4, PVT 64 px); the timm comparisons and memory ratios run at 224 px, batch 1-2.
"""
from __future__ import annotations

import os
import subprocess
import sys
import weakref

import pytest
import timm
import torch
import torch.nn as nn

import mesa_ops as ms
import models
from models.checkpoint import QUANT_BUFFERS
from models.layers import AttentionOps, set_attn_impl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POLICY_DIR = os.path.join(ROOT, "configs", "mesa")


def official_state_dict(model):
    """The model's state dict without Mesa quantizer state: the official checkpoints' layout."""
    return {k: v for k, v in model.state_dict().items() if k.rsplit(".", 1)[-1] not in QUANT_BUFFERS}


def set_fused(model, fused: bool):
    for m in model.modules():
        if isinstance(m, AttentionOps):
            m.fused_attn = fused


def small_kwargs(name: str) -> dict:
    """Reduced-resolution constructor arguments per family (same architecture otherwise)."""
    family = models.registry.model_entry(name).family
    if family == "deit":
        return dict(img_size=32)
    if family == "swin":
        return dict(img_size=64, window_size=4, drop_path_rate=0.0)
    return dict(img_size=64)


def policy(name: str, fallback):
    path = os.path.join(POLICY_DIR, name)
    return path if os.path.isfile(path) else fallback


def loss_of(out):
    if isinstance(out, tuple):  # distilled DeiT in training mode: (cls logits, dist logits)
        return sum(o.float().pow(2).mean() for o in out)
    return out.float().pow(2).mean()


# ---- architecture --------------------------------------------------------------------------------
@pytest.mark.parametrize("name,millions", [
    ("deit_tiny_patch16_224", 5.72), ("deit_small_patch16_224", 22.05), ("deit_base_patch16_224", 86.57),
    ("swin_tiny_patch4_window7_224", 28.29), ("swin_small_patch4_window7_224", 49.61),
    ("swin_base_patch4_window7_224", 87.77),
    ("pvt_tiny", 13.2), ("pvt_small", 24.5), ("pvt_medium", 44.2), ("pvt_large", 61.4)])
def test_parameter_counts(name, millions):
    model = models.create_model(name)
    n = sum(p.numel() for p in model.parameters()) / 1e6
    assert abs(n - millions) <= 0.005 * millions, f"{name}: {n:.3f}M parameters, expected {millions}M"
    # quantizer state are buffers, never parameters
    assert not any(k.rsplit(".", 1)[-1] in QUANT_BUFFERS for k, _ in model.named_parameters())


def test_pvt_key_layout():
    """pvt_tiny's keys are exactly whai362/PVT's classification layout (plus quantizer state)."""
    model = models.create_model("pvt_tiny")
    expected = {"norm.weight", "norm.bias", "cls_token", "head.weight", "head.bias"}
    for i, sr in enumerate((8, 4, 2, 1), 1):
        expected |= {f"patch_embed{i}.{n}.{s}" for n in ("proj", "norm") for s in ("weight", "bias")}
        expected.add(f"pos_embed{i}")
        for j in range(2):
            b = f"block{i}.{j}."
            names = ["norm1", "attn.q", "attn.kv", "attn.proj", "norm2", "mlp.fc1", "mlp.fc2"]
            if sr > 1:
                names += ["attn.sr", "attn.norm"]
            expected |= {b + n + s for n in names for s in (".weight", ".bias")}
    assert set(official_state_dict(model)) == expected
    assert model.pos_embed4.shape == (1, 7 * 7 + 1, 512) and model.pos_embed1.shape == (1, 56 * 56, 64)
    assert model.block1[0].attn.sr.kernel_size == (8, 8) and model.block3[0].attn.num_heads == 5
    assert model.block1[0].mlp.fc1.out_features == 64 * 8 and model.block4[0].mlp.fc1.out_features == 512 * 4
    assert model.block1[0].norm1.eps == 1e-6 and model.block1[0].attn.norm.eps == 1e-5


def test_swin_key_layout():
    sd = official_state_dict(models.create_model("swin_tiny_patch4_window7_224"))
    for key in ("layers.0.blocks.1.attn.relative_position_bias_table",
                "layers.0.blocks.1.attn.relative_position_index", "layers.0.blocks.1.attn_mask",
                "layers.0.downsample.reduction.weight", "layers.2.downsample.norm.weight",
                "patch_embed.proj.weight", "patch_embed.norm.weight", "norm.weight", "head.weight"):
        assert key in sd, key
    assert "layers.0.blocks.0.attn_mask" not in sd and "layers.3.downsample.reduction.weight" not in sd
    assert "layers.3.blocks.1.attn_mask" not in sd  # 7x7 at stage 4: one window, no shift


# ---- timm agreement, Mesa on == off ------------------------------------------------------------------
@pytest.mark.parametrize("name", ["deit_tiny_patch16_224", "deit_tiny_distilled_patch16_224"])
def test_deit_matches_timm_and_mesa_is_exact(name):
    ours = models.create_model(name, fused_attn=False)
    ref = timm.create_model(name, pretrained=False)
    ref.load_state_dict(official_state_dict(ours))  # strict: same key layout
    x = torch.randn(2, 3, 224, 224)
    ours.eval(), ref.eval()
    with torch.no_grad():
        assert (ours(x) - ref(x)).abs().max() <= 1e-5
    ours.train(), ref.train()
    off = ours(x)
    if ours.distilled:
        ref.set_distilled_training(True)  # timm returns (cls, dist) in training like the official code
        ref_out = ref(x)
        for a, b in zip(off, ref_out):
            assert (a - b).abs().max() <= 1e-5
    else:
        assert (off - ref(x)).abs().max() <= 1e-5
    models.apply_policy(ours, "mesa8")
    assert all(m.enable for m in ours.modules() if isinstance(m, (ms.Linear, ms.MatMul, ms.Softmax)))
    on = ours(x)
    for a, b in zip(on if ours.distilled else (on,), off if ours.distilled else (off,)):
        assert torch.equal(a, b), "Mesa on in train mode must give the Mesa-off forward bit for bit"
    assert float(ours.blocks[0].attn.mm1.quant1.iteration) == 1  # the Mesa path ran


def test_swin_matches_timm_and_mesa_is_exact():
    from timm.models.swin_transformer import checkpoint_filter_fn

    ours = models.create_model("swin_tiny_patch4_window7_224", drop_path_rate=0.0, fused_attn=False)
    ref = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, drop_path_rate=0.0)
    ref.load_state_dict(checkpoint_filter_fn(official_state_dict(ours), ref))  # strict
    x = torch.randn(1, 3, 224, 224)
    ours.eval(), ref.eval()
    with torch.no_grad():
        assert (ours(x) - ref(x)).abs().max() <= 1e-5
    ours.train(), ref.train()
    off = ours(x)
    assert (off - ref(x)).abs().max() <= 1e-5
    models.apply_policy(ours, policy("swin_8bit.txt", "mesa8"), verbose=lambda s: None)
    on = ours(x)
    assert torch.equal(on, off)
    assert float(ours.layers[0].blocks[1].attn.softmax.quant2.iteration) == 1


@pytest.mark.parametrize("name,size", [("deit_small_patch16_224", 64), ("swin_tiny_patch4_window7_224", 224),
                                       ("pvt_small", 64)])
def test_sdpa_and_explicit_attention_agree(name, size):
    """Mesa off: the fused SDPA path and the explicit mm1/softmax/mm2 path agree within float
    tolerance, forward and gradients; Mesa on (train) takes the explicit path, bit-exactly."""
    kw = dict(img_size=size, drop_path_rate=0.0)
    model = models.create_model(name, **kw).train()
    x = torch.randn(1, 3, size, size)
    attn = next(m for m in model.modules() if isinstance(m, AttentionOps))
    assert attn.uses_fused()
    calls = []
    hook = attn.mm1.register_forward_hook(lambda *a: calls.append(1))
    fused = model(x)
    assert not calls, "Mesa off with fused_attn: mm1 must not run"
    fused.pow(2).mean().backward()
    g_fused = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    set_fused(model, False)
    explicit = model(x)
    assert calls, "fused_attn=False: the explicit path must run"
    explicit.pow(2).mean().backward()
    assert (fused - explicit).abs().max() <= 1e-5
    for n, p in model.named_parameters():
        scale = g_fused[n].abs().max().clamp_min(1e-3)
        assert ((p.grad - g_fused[n]).abs().max() / scale) <= 1e-4, n
    # Mesa on with attn_impl='explicit' (the paper's path; the default fused Mesa path is tested in
    # test_attention.py): fused_attn stays True, but training with compression forces the explicit path
    set_fused(model, True)
    models.apply_policy(model, "mesa8")
    set_attn_impl(model, "explicit")
    assert not attn.uses_fused()
    calls.clear()
    with torch.no_grad():  # no gradient: nothing to compress, SDPA is used again
        assert attn.uses_fused()
    mesa = model(x)
    assert calls and torch.equal(mesa, explicit)
    model.eval()
    assert attn.uses_fused()
    hook.remove()


# ---- every registered model ---------------------------------------------------------------------
@pytest.mark.parametrize("name", models.list_models())
def test_forward_backward_every_model(name):
    kw = small_kwargs(name)
    model = models.create_model(name, **kw).train()
    size = kw["img_size"]
    x = torch.randn(2, 3, size, size)
    # the Linears fed by a Mesa LayerNorm's or GELU's output reuse its packed copy (they store
    # nothing)
    norm_out, fed = {}, set()  # id -> weak reference (an id alone may be reused)

    def fed_by_norm(n, x):
        ref = norm_out.get(id(x))
        if ref is not None and ref() is x:
            fed.add(n)

    hooks = [m.register_forward_hook(lambda m, i, o: norm_out.__setitem__(id(o), weakref.ref(o)))
             for m in model.modules() if isinstance(m, (ms.LayerNorm, ms.GELU))]
    hooks += [m.register_forward_pre_hook(lambda m, i, n=n: fed_by_norm(n, i[0]))
              for n, m in model.named_modules() if isinstance(m, ms.Linear)]
    for mesa in (False, True):
        if mesa:
            models.apply_policy(model, "mesa8")
        model.zero_grad(set_to_none=True)
        norm_out.clear()
        fed.clear()
        out = model(x)
        outs = out if isinstance(out, tuple) else (out,)
        assert all(o.shape == (2, 1000) for o in outs)
        loss_of(out).backward()
        no_grad = [n for n, p in model.named_parameters()
                   if p.grad is None or not torch.isfinite(p.grad).all()]
        assert not no_grad, f"{name} (mesa={mesa}): parameters without a finite gradient: {no_grad[:10]}"
        zero = [n for n, p in model.named_parameters() if not p.grad.abs().sum() > 0]
        assert not zero, f"{name} (mesa={mesa}): all-zero gradients: {zero[:10]}"
    # with Mesa on (fused attention, the default), every enabled quantizer was updated once (its
    # layer stored a packed copy), except that the attention output is stored once: by the SDPA's
    # quant_o (fused kernels) or by the projection Linear (the math path Swin's masks take)
    stale, once = [], []
    proj = {f"{n}.proj" for n, m in model.named_modules() if isinstance(m, AttentionOps)}
    for n, m in model.named_modules():
        if isinstance(m, ms.Linear) and n in fed:
            assert float(m.iteration) == 0, f"{name}: {n} stored a copy of a LayerNorm/GELU output"
            qs = []
        elif isinstance(m, (ms.Linear, ms.LayerNorm, ms.GELU)) and n not in proj:
            qs = [(n, m)]
        elif isinstance(m, ms.SDPA):
            qs = [(f"{n}.quant_{c}", getattr(m, f"quant_{c}")) for c in "qkv"]
            once.append(float(m.quant_o.iteration) + float(model.get_submodule(n[:-5] + ".proj").iteration))
        else:
            qs = []
        stale += [qn for qn, q in qs if q.enable and float(q.iteration) != 1]
    assert not stale, f"{name}: enabled quantizers that did not run: {stale[:10]}"
    assert once and all(c == 1 for c in once), f"{name}: attention output stored {once} times"
    assert fed, f"{name}: no Linear reused a LayerNorm's or GELU's copy"
    for h in hooks:
        h.remove()
    model.eval()
    with torch.no_grad():
        assert model(x).shape == (2, 1000)


def test_plain_nn_layers():
    """The blocks take their layers as arguments: plain nn classes build the same model."""
    from functools import partial

    plain = models.create_model("deit_tiny_patch16_224", img_size=32, linear_layer=nn.Linear,
                                conv_layer=nn.Conv2d,
                                norm_layer=partial(nn.LayerNorm, eps=1e-6), act_layer=nn.GELU)
    mesa = models.create_model("deit_tiny_patch16_224", img_size=32)
    assert not any(isinstance(m, (ms.Linear, ms.LayerNorm, ms.GELU, ms.Conv2d)) for m in plain.modules())
    report = models.load_checkpoint(plain, official_state_dict(mesa))
    # what is left of Mesa: the attention's MatMul / Softmax / SDPA modules (plain unless passed too)
    assert report.missing_quantizer_keys and all(".attn.mm" in k or ".attn.softmax" in k or ".attn.sdpa." in k
                                                 for k in report.missing_quantizer_keys)
    x = torch.randn(2, 3, 32, 32)
    mesa.eval(), plain.eval()
    with torch.no_grad():
        assert torch.equal(plain(x), mesa(x))


# ---- Mesa settings -------------------------------------------------------------------------------
def test_quantization_groups():
    m = models.create_model("deit_small_patch16_224", img_size=32)
    blk = m.blocks[0]
    assert blk.attn.mm1.quant_groups == blk.attn.softmax.quant_groups == 6  # head-wise (the paper)
    assert blk.attn.qkv.quant_groups == blk.mlp.act.quant_groups == blk.norm1.quant_groups == 6
    s = models.create_model("swin_tiny_patch4_window7_224", img_size=64, window_size=4, quant_group_size=32)
    b = s.layers[1].blocks[0]
    assert b.attn.mm1.quant_groups == b.attn.softmax.quant_groups == 6  # heads
    assert b.mlp.act.quant_groups == 192 * 4 // 32 and b.mlp.fc2.quant_groups == 192 * 4 // 32
    assert s.layers[0].downsample.norm.quant_groups == 96 * 4 // 32 and s.head.quant_groups == 768 // 32
    assert s.patch_embed.proj.quant_groups == 1
    with pytest.raises(ValueError, match="quant_group_size=7 does not divide"):
        models.create_model("swin_tiny_patch4_window7_224", img_size=64, window_size=4, quant_group_size=7)
    with pytest.raises(ValueError, match="quant_groups must be"):
        models.create_model("deit_tiny_patch16_224", img_size=32, quant_groups="channels")


def test_policies():
    m = models.create_model("swin_tiny_patch4_window7_224", img_size=64, window_size=4,
                            ms_policy=policy("swin_8bit.txt", "mesa8"), policy_verbose=lambda s: None)
    assert m.layers[0].blocks[0].attn.qkv.enable and m.layers[0].blocks[0].mlp.act.enable
    assert m.layers[0].blocks[0].attn.mm2.enable and m.norm.enable
    assert not m.patch_embed.proj.enable  # conv not in the policy
    if os.path.isfile(os.path.join(POLICY_DIR, "swin_8bit.txt")):
        assert not m.patch_embed.norm.enable  # layernorm index 0 stays exact in swin_8bit.txt
    m4 = models.create_model("pvt_tiny", img_size=64, ms_policy="mesa4")
    attn = m4.block1[0].attn
    assert attn.q.bits == 4 and attn.softmax.bits == 4 and attn.q.enable
    md = models.create_model("pvt_tiny", img_size=64, ms_policy={"bits": 8, "tags": ["conv"]})
    assert md.block1[0].attn.sr.enable and not md.block1[0].attn.q.enable
    off = models.create_model("deit_tiny_patch16_224", img_size=32, ms_policy=None)
    assert not any(getattr(m, "enable", False) for m in off.modules())
    with pytest.raises(ValueError, match="ms_policy='mesa3'"):
        models.create_model("deit_tiny_patch16_224", img_size=32, ms_policy="mesa3")


# ---- registry and timm ----------------------------------------------------------------------------
def test_registry():
    names = models.list_models()
    assert len(names) == 16
    swins = models.list_models("swin*")
    assert swins == [n for n in names if n.startswith("swin")] and len(swins) == 4
    assert models.list_models(family="pvt") == ["pvt_large", "pvt_medium", "pvt_small", "pvt_tiny"]
    assert set(models.list_models("deit*distilled*")) == {
        "deit_tiny_distilled_patch16_224", "deit_small_distilled_patch16_224",
        "deit_base_distilled_patch16_224", "deit_base_distilled_patch16_384"}
    with pytest.raises(KeyError, match="unknown model 'deit_huge_patch16_224'"):
        models.create_model("deit_huge_patch16_224")
    m = models.create_model("mesa_deit_tiny_patch16_224", img_size=48, num_classes=10)
    assert m.pretrained_cfg["input_size"] == (3, 48, 48) and m.pretrained_cfg["num_classes"] == 10
    assert m.pretrained_cfg["url"].startswith("https://dl.fbaipublicfiles.com/deit/")


def test_timm_registration():
    mesa_names = timm.list_models("mesa_*")
    assert sorted(mesa_names) == sorted(models.TIMM_PREFIX + n for n in models.list_models())
    # timm's own entries are untouched
    assert timm.models.model_entrypoint("deit_tiny_patch16_224").__module__ == "timm.models.deit"
    swin = timm.models.model_entrypoint("swin_tiny_patch4_window7_224")
    assert swin.__module__ == "timm.models.swin_transformer"
    m = timm.create_model("mesa_pvt_tiny", pretrained=False, img_size=64, num_classes=5)
    assert isinstance(m, models.pvt.PyramidVisionTransformer) and m.head.out_features == 5
    cfg = timm.data.resolve_data_config({}, model=m)
    assert cfg["input_size"] == (3, 64, 64) and cfg["interpolation"] == "bicubic"
    with pytest.raises(RuntimeError, match="not overwriting"):
        _register_clash()


def _register_clash():
    """Register a model whose timm name (mesa_clash_probe) timm already holds: must raise."""
    import timm.models._registry as tr

    fake = models.TIMM_PREFIX + "clash_probe"
    tr._model_entrypoints[fake] = lambda **kw: None
    try:
        models.registry._register_with_timm("clash_probe")
    finally:
        tr._model_entrypoints.pop(fake, None)


def test_import_has_no_registry_warnings():
    code = ("import warnings\nwarnings.simplefilter('always')\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    import timm, models\n"
            "bad = [str(x.message) for x in w\n"
            "       if 'Overwriting' in str(x.message) or 'registry' in str(x.message)]\n"
            "assert not bad, bad\nprint(len(timm.list_models('mesa_*')))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "16"


# ---- memory ---------------------------------------------------------------------------------------
def _saved_bytes(model, x):
    with ms.SavedActivationMeter(model, exclude=(x,)) as meter:  # the batch is held by the loop anyway
        loss = loss_of(model(x))
    loss.backward()
    return meter.total_bytes


@pytest.mark.parametrize("name,pol", [
    ("deit_small_patch16_224", policy("mesa_8bit.txt", "mesa8")),
    ("swin_tiny_patch4_window7_224", policy("swin_8bit.txt", "mesa8")),
    # PVT: the spatial-reduction convs see the full-resolution tokens; they are compressed too
    ("pvt_tiny", {"bits": 8, "tags": list(models.MESA_TAGS) + ["conv"]}),
])
def test_saved_activation_ratio(name, pol):
    """Saved-activation bytes of a train step, Mesa 8-bit vs off, fp32, same batch: <= 0.3x, both
    against the default Mesa-off model (SDPA attention) and the explicit-attention one."""
    x = torch.randn(2, 3, 224, 224)
    model = models.create_model(name).train()
    off_fused = _saved_bytes(model, x)
    set_fused(model, False)
    off_explicit = _saved_bytes(model, x)
    set_fused(model, True)
    models.apply_policy(model, pol, verbose=lambda s: None)
    on = _saved_bytes(model, x)
    r_fused, r_explicit = on / off_fused, on / off_explicit
    print(f"\n[memory] {name}: Mesa 8-bit {on / 2**20:.1f} MiB vs off {off_fused / 2**20:.1f} MiB (SDPA) "
          f"/ {off_explicit / 2**20:.1f} MiB (explicit): ratio {r_fused:.3f} / {r_explicit:.3f}")
    assert r_fused <= 0.3 and r_explicit <= 0.3
