"""The Mesa segmentation backbones against mmseg's and mmdet's own backbone tests (issue 26).

mmseg 1.2.2's ``tests/test_models/test_backbones/test_swin.py`` and mmdet's ``test_pvt.py``
(mmseg 1.2.2 has no PVT v1), rewritten against :class:`MesaSwinTransformer` / :class:`MesaPVT`,
with Mesa off and on ('mesa8') and a backward added, and mmseg's test_swin_transformer itself where
the mmsegmentation wheel ships it; then ``with_cp`` (counting recomputations; per block, as mmseg's
``SwinBlock.with_cp``), ``frozen_stages`` / ``norm_eval`` and mmseg-layout checkpoints.
"""
from __future__ import annotations

import pytest

# the segmentation stack is optional (pip install -e ".[seg]"): without it these tests skip
for _mod in ("mmengine", "mmcv", "mmseg"):
    pytest.importorskip(_mod, reason=f"{_mod} is not installed (the optional segmentation stack)",
                        exc_type=ImportError)

import torch
from mmengine.registry import init_default_scope

import mesa_ops as ms
import models
import models.seg  # noqa: F401  (registers the backbones)
from models.seg import MesaPVT, MesaSwinTransformer
from models.seg.swin_backbone import mmseg_swin_to_official
from models.swin import SwinTransformerBlock

init_default_scope("mmseg")
MESA = [None, "mesa8"]


def _backward(outs):
    g = torch.Generator().manual_seed(0)
    sum((o * torch.randn(o.shape, generator=g)).mean() for o in outs).backward()


def _grads_ok(model):
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)


# ---- mmseg test_swin.py ------------------------------------------------------------------------
@pytest.mark.parametrize("ms_policy", MESA)
def test_swin_block(ms_policy):
    """mmseg's test_swin_block: a block of 32 channels, 4 heads, FFN 128 on 56x56 tokens (here the
    first block of a one-stage backbone, run by the backbone's any-size block path)."""
    bb = MesaSwinTransformer(embed_dims=32, depths=(2,), num_heads=(4,), strides=(4,), out_indices=(0,),
                             mlp_ratio=4, ms_policy=ms_policy)
    blk = bb.body.layers[0].blocks[0]
    assert blk.dim == 32 and blk.attn.num_heads == 4 and blk.mlp.fc1.out_features == 128
    x = torch.randn(1, 56 * 56, 32)
    assert bb._block(blk, x, 56, 56, None).shape == (1, 56 * 56, 32)
    bb = MesaSwinTransformer(embed_dims=64, depths=(2,), num_heads=(4,), strides=(4,), out_indices=(0,),
                             with_cp=True, ms_policy=ms_policy)
    assert bb.with_cp
    x = torch.randn(1, 3, 56 * 4, 56 * 4)
    out = bb(x)
    assert out[0].shape == (1, 64, 56, 56)
    _backward(out)
    _grads_ok(bb)


@pytest.fixture(scope="module")
def default_models():
    """One default-constructed backbone per (class, policy), shared by the inference cases
    (mmseg's test builds a new default model per input size; these are the same model)."""
    cache = {}

    def get(cls, ms_policy):
        if (cls, ms_policy) not in cache:
            torch.manual_seed(0)
            cache[cls, ms_policy] = cls(ms_policy=ms_policy)
        return cache[cls, ms_policy]
    return get


@pytest.mark.parametrize("ms_policy", MESA)
def test_swin_transformer_checks(ms_policy):
    """mmseg's test_swin_transformer, first part: argument checks, absolute position embedding,
    patch norm off."""
    kw = dict(ms_policy=ms_policy)
    with pytest.raises(TypeError):
        MesaSwinTransformer(pretrained=123, **kw)  # pretrained must be a str or None
    with pytest.raises(AssertionError):
        MesaSwinTransformer(strides=(2, 2, 2, 2), patch_size=4, **kw)  # non-overlapping patch embed
    with pytest.raises(AssertionError):
        MesaSwinTransformer(pretrain_img_size=(112, 112, 112), **kw)

    temp = torch.randn((1, 3, 112, 112))  # absolute position embedding
    model = MesaSwinTransformer(pretrain_img_size=112, use_abs_pos_embed=True, **kw)
    model.init_weights()
    assert model.body.absolute_pos_embed.shape == (1, 28 * 28, 96)
    model(temp)
    model = MesaSwinTransformer(patch_norm=False, **kw)  # patch norm
    assert model.body.patch_embed.norm is None
    model(temp)


@pytest.mark.parametrize("ms_policy", MESA)
def test_swin_transformer_inference(ms_policy, default_models):
    """mmseg's test_swin_transformer: normal and abnormal input sizes, plus a backward."""
    model = default_models(MesaSwinTransformer, ms_policy)
    for size, want in (((256, 256), [(64, 64), (32, 32), (16, 16), (8, 8)]),
                       ((255, 255), [(64, 64), (32, 32), (16, 16), (8, 8)]),  # abnormal size
                       ((112, 137), [(28, 35), (14, 18), (7, 9), (4, 5)])):
        outs = model(torch.randn((1, 3) + size))
        assert [tuple(o.shape) for o in outs] == [(1, c) + hw for c, hw in zip((96, 192, 384, 768), want)]
    _backward(outs)  # added: a backward through the odd-size (padded) path
    _grads_ok(model)


@pytest.mark.parametrize("ms_policy", MESA)
def test_swin_transformer_frozen_and_cp(ms_policy):
    """mmseg's test_swin_transformer, last part: frozen_stages=4 freezes everything (with and
    without the absolute position embedding); with_cp forward (here with a backward)."""
    kw = dict(ms_policy=ms_policy)
    model = MesaSwinTransformer(frozen_stages=4, **kw)
    model.train()
    assert not any(p.requires_grad for p in model.parameters())
    model = MesaSwinTransformer(frozen_stages=4, use_abs_pos_embed=True, **kw)
    model.train()
    assert not any(p.requires_grad for p in model.parameters())

    temp = torch.randn((1, 3, 56, 56))
    model = MesaSwinTransformer(with_cp=True, **kw)
    assert model.with_cp
    model.init_weights()
    model.train()
    _backward(model(temp))
    _grads_ok(model)


def test_swin_contract_extras():
    """The mmseg defaults; timm-style names are refused naming mmseg's; the config checks."""
    m = MesaSwinTransformer(embed_dims=32, depths=(1, 1), num_heads=(1, 2), strides=(4, 2), out_indices=(0, 1))
    assert (m.frozen_stages, m.with_cp, m.use_abs_pos_embed, m.num_features) == (-1, False, False, [32, 64])
    with pytest.raises(TypeError, match=r"in_chans \(mmseg's name: in_channels\)"):
        MesaSwinTransformer(in_chans=3)
    with pytest.raises(TypeError, match=r"ape \(mmseg's name: use_abs_pos_embed\)"):
        MesaSwinTransformer(ape=True)
    with pytest.raises(ValueError, match="norm_cfg"):
        MesaSwinTransformer(norm_cfg=dict(type="BN"))
    with pytest.raises(ValueError, match="act_cfg"):
        MesaSwinTransformer(act_cfg=dict(type="ReLU"))
    with pytest.raises(ValueError, match="arch='small' sets depths"):
        MesaSwinTransformer(arch="small", depths=(2, 2, 2, 2))
    m = MesaSwinTransformer(arch="base", norm_cfg=dict(type="LN", requires_grad=False))
    assert m.num_features == [128, 256, 512, 1024]
    assert not m.norm0.weight.requires_grad and m.body.layers[0].blocks[0].attn.qkv.weight.requires_grad


# ---- mmdet test_pvt.py -------------------------------------------------------------------------
@pytest.mark.parametrize("ms_policy", MESA)
def test_pvt_block(ms_policy):
    """mmdet's test_pvt_block: 64 channels, 4 heads, FFN 256 on 56x56 tokens (the first block of a
    backbone with embed_dims 16 x 4 heads)."""
    bb = MesaPVT(embed_dims=16, num_stages=1, num_layers=[1], num_heads=[4], patch_sizes=[4], strides=[4],
                 paddings=[0], sr_ratios=[8], mlp_ratios=[4], out_indices=(0,), ms_policy=ms_policy)
    blk = bb.body.block1[0]
    assert blk.mlp.fc1.in_features == 64 and blk.attn.num_heads == 4 and blk.mlp.fc1.out_features == 256
    x = torch.randn(1, 56 * 56, 64, requires_grad=True)
    x_out = blk(x, 56, 56)
    assert x_out.shape == (1, 56 * 56, 64)
    _backward([x_out])
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("ms_policy", MESA)
def test_pvt_checks(ms_policy):
    """mmdet's test_pvt, first part: argument checks, absolute position embedding at 224."""
    kw = dict(ms_policy=ms_policy)
    with pytest.raises(TypeError):
        MesaPVT(pretrained=123, **kw)
    with pytest.raises(AssertionError):
        MesaPVT(pretrain_img_size=(224, 224, 224), **kw)

    temp = torch.randn((1, 3, 224, 224))  # absolute position embedding
    model = MesaPVT(pretrain_img_size=224, use_abs_pos_embed=True, **kw)
    model.init_weights()
    assert model.body.pos_embed1.shape == (1, 56 * 56, 64)
    model(temp)


@pytest.mark.parametrize("ms_policy", MESA)
def test_pvt_inference(ms_policy, default_models):
    """mmdet's test_pvt: normal and abnormal input sizes, plus a backward."""
    model = default_models(MesaPVT, ms_policy)
    for size, want in (((32, 32), [(8, 8), (4, 4), (2, 2), (1, 1)]),
                       ((33, 33), [(8, 8), (4, 4), (2, 2), (1, 1)]),  # abnormal size
                       ((112, 137), [(28, 34), (14, 17), (7, 8), (3, 4)])):
        outs = model(torch.randn((1, 3) + size))
        assert [tuple(o.shape) for o in outs] == [(1, c) + hw for c, hw in zip((64, 128, 320, 512), want)]
    _backward(outs)  # added
    _grads_ok(model)


def test_pvt_contract_extras():
    """mmdet's defaults (PVT-Small, embed_dims an int), its assertions, and what this PVT v1 refuses."""
    m = MesaPVT()
    assert m.num_features == [64, 128, 320, 512] and list(m.body.depths) == [3, 4, 6, 3]
    assert m.body.block1[0].norm1.eps == 1e-6  # norm_cfg=dict(type='LN', eps=1e-6)
    assert list(MesaPVT(arch="tiny").body.depths) == [2, 2, 2, 2]
    with pytest.raises(AssertionError):
        MesaPVT(num_layers=[2, 2, 2])  # num_stages == len(num_layers) == ...
    with pytest.raises(AssertionError):
        MesaPVT(out_indices=(0, 4))
    with pytest.raises(ValueError, match="use_conv_ffn"):
        MesaPVT(use_conv_ffn=True)
    with pytest.raises(ValueError, match="non-overlapping"):
        MesaPVT(patch_sizes=[7, 3, 3, 3], paddings=[3, 1, 1, 1])
    with pytest.raises(TypeError, match=r"depths \(mmseg's name: num_layers\)"):
        MesaPVT(depths=(2, 2, 2, 2))
    m = MesaPVT(arch="tiny", use_abs_pos_embed=False, norm_after_stage=True)
    assert not any("pos_embed" in n for n, _ in m.named_parameters())
    assert isinstance(m.stage_norms[3], ms.LayerNorm) and m.stage_norms[3].eps == 1e-6
    outs = m(torch.randn(1, 3, 64, 64))
    assert [o.shape[1] for o in outs] == [64, 128, 320, 512]


# ---- with_cp: recomputations counted -----------------------------------------------------------
def _small(kind, **kw):
    if kind == "swin":
        return MesaSwinTransformer(embed_dims=16, depths=(2, 2), num_heads=(1, 2), strides=(4, 2),
                                   out_indices=(0, 1), window_size=4, drop_path_rate=0., **kw)
    return MesaPVT(embed_dims=16, num_layers=[1, 1, 1, 1], num_heads=[1, 2, 2, 4], drop_path_rate=0.,
                   pretrain_img_size=64, **kw)


def _blocks(bb, kind):
    if kind == "swin":
        return [blk for layer in bb.body.layers for blk in layer.blocks]
    return [blk for i in range(4) for blk in getattr(bb.body, f"block{i + 1}")]


def _attn_modules(bb, kind):
    return [blk.attn for blk in _blocks(bb, kind)]


@pytest.mark.parametrize("ms_policy", MESA)
@pytest.mark.parametrize("kind", ["swin", "pvt"])
@pytest.mark.parametrize("mode", [(False, None), (True, None), (True, 8)])
def test_with_cp_recomputes_every_block(kind, mode, ms_policy):
    """with_cp=True runs each block's attention twice per step (forward + recomputation in
    backward), with_cp_bits=8 too (from the packed 8-bit input); without Mesa plain checkpointing
    gives the gradients of no checkpointing exactly; with Mesa (the recomputation packs again,
    with new stochastic rounding) and compressed they are close; eval: no recomputation."""
    with_cp, bits = mode
    torch.manual_seed(0)
    ref = _small(kind, ms_policy=ms_policy)
    torch.manual_seed(0)
    bb = _small(kind, ms_policy=ms_policy, with_cp=with_cp, with_cp_bits=bits)
    bb.load_state_dict(ref.state_dict())
    calls = []
    for a in _attn_modules(bb, kind):
        a.register_forward_hook(lambda m, i, o: calls.append(m))
    x = torch.randn(2, 3, 64, 64)
    grads = []
    for m in (ref, bb):
        torch.manual_seed(1)  # the same stochastic rounding draws
        _backward(m.train()(x))
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters()]))
    n = len(_attn_modules(bb, kind))
    assert len(calls) == (2 * n if with_cp else n)
    err = ((grads[1] - grads[0]).norm() / grads[0].norm()).item()
    if bits is None and (ms_policy is None or not with_cp):
        assert err == 0.0
    else:
        assert 0.0 < err < 0.05, err
    calls.clear()
    with torch.no_grad():
        bb.eval()(x)
    assert len(calls) == n
    with pytest.raises(ValueError, match="with_cp_bits=8 needs with_cp=True"):
        _small(kind, with_cp_bits=8)


# ---- with_cp per block (mmseg's SwinBlock.with_cp) ---------------------------------------------
def _mmseg_upstream_test_swin():
    """mmseg's own tests/test_models/test_backbones/test_swin.py, where the mmsegmentation wheel
    ships it (as a top-level ``tests`` package, so it is loaded from its file under another
    module name), or None."""
    import importlib.metadata
    import importlib.util

    try:
        path = importlib.metadata.distribution("mmsegmentation").locate_file(
            "tests/test_models/test_backbones/test_swin.py")
    except importlib.metadata.PackageNotFoundError:
        return None
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location("mmseg_upstream_test_swin", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_mmseg_test_swin_transformer_verbatim():
    """mmseg 1.2.2's test_swin_transformer itself, its ``SwinTransformer`` bound to
    MesaSwinTransformer and its ``SwinBlock`` to the Mesa Swin block: every assertion, including
    ``m.with_cp`` for every block of a ``with_cp=True`` model."""
    mod = _mmseg_upstream_test_swin()
    if mod is None:
        pytest.skip("this mmsegmentation install does not ship tests/test_models/test_backbones/test_swin.py")
    mod.SwinTransformer = MesaSwinTransformer
    mod.SwinBlock = SwinTransformerBlock
    mod.test_swin_transformer()


@pytest.mark.parametrize("with_cp", [True, False])
def test_every_block_carries_with_cp(with_cp):
    """The with_cp part of mmseg's test_swin_transformer (also where its file is not shipped), and
    the same for MesaPVT's blocks: each block's ``with_cp`` is the backbone's argument."""
    model = MesaSwinTransformer(with_cp=with_cp)
    blocks = [m for m in model.modules() if isinstance(m, SwinTransformerBlock)]
    assert len(blocks) == 12 and blocks == model.transformer_blocks()
    assert all(m.with_cp is with_cp for m in blocks) and model.with_cp is with_cp
    pvt = MesaPVT(arch="tiny", with_cp=with_cp)
    assert pvt.transformer_blocks() == _blocks(pvt, "pvt") and len(_blocks(pvt, "pvt")) == 8
    assert all(m.with_cp is with_cp for m in _blocks(pvt, "pvt")) and pvt.with_cp is with_cp


def _recomputed(bb, kind, x):
    """(attention calls per block, in block order) for one training step of ``bb``: 2 for a
    checkpointed block (forward + recomputation in backward), 1 for a plain one."""
    attns = _attn_modules(bb, kind)
    calls = {id(a): 0 for a in attns}

    def hook(m, i, o):
        calls[id(m)] += 1
    handles = [a.register_forward_hook(hook) for a in attns]
    torch.manual_seed(1)
    _backward(bb.train()(x))
    for h in handles:
        h.remove()
    return [calls[id(a)] for a in attns]


@pytest.mark.parametrize("kind", ["swin", "pvt"])
@pytest.mark.parametrize("bits", [None, 8])
def test_with_cp_followed_per_block(kind, bits):
    """Each block follows its own ``with_cp``: all on -> every block recomputed; one block's set
    False after construction -> that block only runs plainly (one fewer recomputation), with the
    backbone's with_cp_bits kept for the others; the backbone's ``with_cp`` reads any block's and
    setting it (or set_grad_checkpointing) sets every block's."""
    bb = _small(kind, with_cp=True, with_cp_bits=bits)
    blocks = _blocks(bb, kind)
    n = len(blocks)
    x = torch.randn(2, 3, 64, 64)
    assert _recomputed(bb, kind, x) == [2] * n
    blocks[1].with_cp = False
    assert bb.with_cp and bb.grad_checkpointing and bb.grad_checkpointing_bits == bits
    assert _recomputed(bb, kind, x) == [2, 1] + [2] * (n - 2)
    bb.with_cp = False
    assert not bb.with_cp and not any(b.with_cp for b in blocks)
    assert _recomputed(bb, kind, x) == [1] * n
    blocks[0].with_cp = True
    assert bb.with_cp
    assert _recomputed(bb, kind, x) == [2] + [1] * (n - 1)
    bb.set_grad_checkpointing(True)
    assert all(b.with_cp for b in blocks) and bb.grad_checkpointing_bits == bits
    assert _recomputed(bb, kind, x) == [2] * n
    bb.set_grad_checkpointing(False)
    assert not any(b.with_cp for b in blocks)
    with torch.no_grad():  # eval: no checkpointing whatever with_cp says
        bb.with_cp = True
        calls = []
        for a in _attn_modules(bb, kind):
            a.register_forward_hook(lambda m, i, o: calls.append(m))
        bb.eval()(x)
    assert len(calls) == n


@pytest.mark.parametrize("kind", ["swin", "pvt"])
def test_with_cp_grads_equal_without(kind):
    """Mesa off: the gradients (parameters and input) with every block checkpointed, with every
    other block's with_cp turned off (those blocks then run plainly: counted), and without
    checkpointing are the same; compressed (8-bit) checkpointing of the with_cp blocks is close."""
    torch.manual_seed(0)
    ref = _small(kind)
    x = torch.randn(2, 3, 64, 64)

    def step(bb):
        """(gradients of the parameters and the input, attention calls per block)."""
        bb.load_state_dict(ref.state_dict())
        attns = _attn_modules(bb, kind)
        calls = []
        handles = [a.register_forward_hook(lambda m, i, o: calls.append(m)) for a in attns]
        xi = x.clone().requires_grad_(True)
        _backward(bb.train()(xi))
        for h in handles:
            h.remove()
        g = torch.cat([p.grad.flatten() for p in bb.parameters()] + [xi.grad.flatten()])
        return g, [sum(c is a for c in calls) for a in attns]

    want, counts = step(ref)
    n = len(counts)
    assert counts == [1] * n
    full = _small(kind, with_cp=True)
    mixed = _small(kind, with_cp=True)
    packed = _small(kind, with_cp=True, with_cp_bits=8)
    for bb in (mixed, packed):
        for blk in _blocks(bb, kind)[::2]:
            blk.with_cp = False
    alternate = [1 if i % 2 == 0 else 2 for i in range(n)]
    for bb, recomputed in ((full, [2] * n), (mixed, alternate)):
        g, counts = step(bb)
        assert counts == recomputed
        torch.testing.assert_close(g, want, rtol=1e-6, atol=1e-7)
    g, counts = step(packed)
    assert counts == alternate
    err = ((g - want).norm() / want.norm()).item()
    assert 0.0 < err < 0.05, err


def test_policy_checkpoint_choice_sets_block_with_cp(tmp_path):
    """A policy file's ``on checkpoint:`` choice for a block is what its ``with_cp`` reads after
    construction (and it runs so: here block 1 of a with_cp=False backbone, 8-bit)."""
    pol = tmp_path / "ckpt.txt"
    pol.write_text("on checkpoint:\n    by_index: 1\n    enable: True\n    bits: 8\n")
    bb = _small("swin", ms_policy=str(pol))
    blocks = _blocks(bb, "swin")
    assert [b.with_cp for b in blocks] == [False, True, False, False] and bb.with_cp
    assert blocks[1].mesa_checkpoint == (True, 8)
    assert _recomputed(bb, "swin", torch.randn(2, 3, 64, 64)) == [1, 2, 1, 1]


def test_classification_swin_blocks_follow_with_cp():
    """The classification Swin (timm's set_grad_checkpointing, the official use_checkpoint) keeps
    its blocks' ``with_cp`` consistent and runs each block as its ``with_cp`` says."""
    kw = dict(img_size=64, embed_dim=16, depths=(2, 2), num_heads=(1, 2), window_size=4,
              num_classes=10, drop_path_rate=0.)
    m = models.create_model("swin_tiny_patch4_window7_224", **kw)
    blocks = [b for layer in m.layers for b in layer.blocks]
    assert not m.grad_checkpointing and not any(b.with_cp for b in blocks)
    m.set_grad_checkpointing(True)
    assert m.grad_checkpointing and all(b.with_cp for b in blocks) and m.layers[0].use_checkpoint
    attns = [b.attn for b in blocks]
    calls = []
    for a in attns:
        a.register_forward_hook(lambda mod, i, o: calls.append(mod))
    x = torch.randn(2, 3, 64, 64)
    m.train()(x).sum().backward()
    assert [sum(c is a for c in calls) for a in attns] == [2, 2, 2, 2]
    blocks[2].with_cp = False
    calls.clear()
    m(x).sum().backward()
    assert [sum(c is a for c in calls) for a in attns] == [2, 2, 1, 2]
    m.set_grad_checkpointing(False)
    assert not m.grad_checkpointing and not any(b.with_cp for b in blocks)
    s = models.create_model("swin_tiny_patch4_window7_224", use_checkpoint=True, **kw)
    assert all(b.with_cp for layer in s.layers for b in layer.blocks)


# ---- frozen_stages / norm_eval -----------------------------------------------------------------
@pytest.mark.parametrize("kind", ["swin", "pvt"])
def test_frozen_stages_store_nothing_with_mesa(kind):
    """frozen_stages=1 (mmseg's meaning): the patch embedding and stage 1 (and Swin's norm0) in
    eval mode without gradients after train(); with Mesa, one training forward stores nothing
    for them and leaves their quantizer ranges alone; the other stages store packed activations."""
    bb = _small(kind, ms_policy="mesa8", frozen_stages=1)
    bb.train()
    b = bb.body
    frozen = (["body.patch_embed", "body.layers.0", "norm0"] if kind == "swin" else
              ["body.patch_embed1", "body.pos_embed1", "body.block1", "stage_norms.0"])
    for name, p in bb.named_parameters():
        assert p.requires_grad == (not name.startswith(tuple(frozen))), name
    for name, m in bb.named_modules():
        if name.startswith(tuple(frozen)):
            assert not m.training, name
    live = b.layers[1] if kind == "swin" else b.block2
    assert live.training
    before = {n: q.iteration.clone() for n, q in bb.named_modules() if isinstance(q, ms.quant.QuantMixin)}
    report = ms.audit(bb, torch.randn(2, 3, 64, 64), verbose=False)
    per = report.by_module()
    assert all(not n.startswith(tuple(frozen)) for n in per), [n for n in per if n.startswith(tuple(frozen))]
    later = b.layers[1] if kind == "swin" else b.block2
    later_name = "body.layers.1" if kind == "swin" else "body.block2"
    assert sum(r.packed_bytes for r in report.modules if r.name.startswith(later_name)) > 0
    changed = {n for n, q in bb.named_modules() if isinstance(q, ms.quant.QuantMixin)
               and not torch.equal(q.iteration, before[n])}
    assert changed and not any(n.startswith(tuple(frozen)) for n in changed), changed
    assert later.training
    _backward(bb(torch.randn(2, 3, 64, 64)))
    assert all(p.grad is None for n, p in bb.named_parameters() if n.startswith(tuple(frozen)))


def test_frozen_stages_bounds_and_zero():
    with pytest.raises(ValueError, match="frozen_stages=5"):
        MesaSwinTransformer(frozen_stages=5)
    bb = _small("pvt", frozen_stages=0).train()
    assert not bb.body.patch_embed1.proj.weight.requires_grad and not bb.body.pos_embed1.requires_grad
    assert bb.body.block1[0].attn.q.weight.requires_grad and bb.body.patch_embed2.proj.weight.requires_grad


def test_pvt_norm_eval():
    """norm_eval=True: every LayerNorm in eval mode after train() (mmseg's ViT / BEiT); the rest
    trains; the outputs are those of norm_eval=False (a LayerNorm has no running statistics)."""
    torch.manual_seed(0)
    a = _small("pvt", norm_eval=True).train()
    torch.manual_seed(0)
    b = _small("pvt").train()
    lns = [m for m in a.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert lns and not any(m.training for m in lns)
    assert a.body.block1[0].attn.training and a.training
    assert all(m.training for m in b.modules() if isinstance(m, torch.nn.LayerNorm))
    x = torch.randn(1, 3, 64, 64)
    for u, v in zip(a(x), b(x)):
        torch.testing.assert_close(u, v, rtol=0, atol=0)


# ---- checkpoints: the paper's (official layout) and mmseg's (OpenMMLab layout) -----------------
def test_swin_loads_official_and_mmseg_layout_checkpoints(tmp_path):
    """An official Swin checkpoint and its mmseg conversion (mmseg's own swin2mmseg converter,
    run here) initialise the backbone to the same weights; the paper's keys all fit."""
    import importlib.util
    import os

    import mmseg
    conv_path = os.path.join(os.path.dirname(mmseg.__file__), ".mim", "tools", "model_converters",
                             "swin2mmseg.py")
    if not os.path.isfile(conv_path):
        pytest.skip("mmseg's swin2mmseg.py is not shipped with this mmseg install")
    spec = importlib.util.spec_from_file_location("swin2mmseg", conv_path)
    conv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conv)

    kw = dict(embed_dim=32, depths=(2, 2, 2, 2), num_heads=(1, 2, 4, 8))
    cls_model = models.create_model("swin_tiny_patch4_window7_224", **kw)
    sd = {k: v for k, v in cls_model.state_dict().items() if k.rsplit(".", 1)[-1] not in
          ("clip_val", "shift", "iteration", "draws")}
    mmseg_sd = conv.convert_swin(sd)
    assert any(k.startswith("stages.") for k in mmseg_sd)
    for k, v in mmseg_swin_to_official(mmseg_sd).items():
        torch.testing.assert_close(v, sd[k], rtol=0, atol=0)
    torch.save(sd, tmp_path / "official.pth")
    torch.save({"state_dict": mmseg_sd}, tmp_path / "mmseg.pth")
    loaded = []
    for name in ("official.pth", "mmseg.pth"):
        bb = MesaSwinTransformer(embed_dims=32, depths=kw["depths"], num_heads=kw["num_heads"],
                                 init_cfg=dict(type="Pretrained", checkpoint=str(tmp_path / name)))
        bb.init_weights()
        loaded.append(bb.body.state_dict())
    for k, v in loaded[0].items():
        torch.testing.assert_close(loaded[1][k], v, rtol=0, atol=0)
    name = "layers.1.downsample.reduction.weight"
    torch.testing.assert_close(loaded[1][name], sd[name], rtol=0, atol=0)
