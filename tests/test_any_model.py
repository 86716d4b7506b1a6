"""Issue 35: any model is either handled correctly or told what stayed exact. Item 3: group
counts are valid by construction (a head count that does not divide a layer's channels gives the
largest divisor below it, said in the report), so compress's success is never followed by a
crash in the first training step."""
from __future__ import annotations

import copy
import importlib

import pytest
import timm
import torch

import mesa_ops as ms


def test_heads_that_do_not_divide_the_mlp_width_get_a_divisor_and_are_reported():
    """vit_little_patch16_reg4_gap_256: 5 heads, MLP width 1792 (= 2^8 * 7): before, compress
    reported success and the first training forward raised 'quant_groups=5 does not divide'."""
    torch.manual_seed(0)
    model = timm.create_model("vit_little_patch16_reg4_gap_256", img_size=32, depth=2)
    ref = copy.deepcopy(model).train()
    model, report = ms.compress(model, "mesa8", return_report=True, warn=False)
    changed = {n: (a, c, g) for n, a, c, g in report.groups}
    assert changed == {f"blocks.{i}.mlp.{m}": (5, 1792, 4) for i in range(2) for m in ("act", "fc2")}
    assert model.blocks[0].mlp.fc2.quant_groups == 4 and model.blocks[0].mlp.fc1.quant_groups == 5
    assert "5 groups do not divide 1792 channels: 4" in report.summary()
    x = torch.randn(2, 3, 32, 32)
    model.train()
    y = model(x)
    assert torch.allclose(y, ref(x), atol=1e-5)
    y.square().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_divisible_models_report_no_group_change():
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, depth=1)
    _, report = ms.compress(model, "mesa8", return_report=True, warn=False)
    assert report.groups == [] and "groups changed" not in report.summary()


def _grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_efficientvit_hybrid_gradients_close_and_finite():
    """efficientvit_m0 (BatchNormAct2d, 1x1 maps at its last stage): the issue measured a global
    gradient error of 378 and non-finite values after one SGD step. Now: forward bit-identical,
    global gradient error below 2% at init and after an SGD step (Mesa's weights set to the exact
    run's, its running ranges its own), everything finite."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    ref = timm.create_model("efficientvit_m0", img_size=64).train()
    mesa = ms.compress(copy.deepcopy(ref), "mesa8", warn=False).train()
    for step in range(2):
        x, lab = torch.randn(2, 3, 64, 64), torch.randint(0, 1000, (2,))
        outs = []
        for model in (ref, mesa):
            model.zero_grad()
            torch.manual_seed(step)
            outs.append(model(x))
            F.cross_entropy(outs[-1], lab).backward()
        assert torch.equal(outs[0], outs[1])
        g, gr = _grads(mesa), _grads(ref)
        assert torch.isfinite(g).all()
        assert float((g - gr).norm() / gr.norm()) < 0.02, step
        with torch.no_grad():  # one SGD step of each, then the exact weights for both
            for pm, pr in zip(mesa.parameters(), ref.parameters()):
                pm.sub_(0.01 * pm.grad)
                assert torch.isfinite(pm).all()
                pr.sub_(0.01 * pr.grad)
                pm.copy_(pr)


def test_batch_norm_with_few_values_per_channel_stores_its_input_exactly():
    """Below 16 values per channel the batch-norm backward is ill-conditioned (at 2 the exact
    gradient is ~0): the input is stored as it is, and the gradient is exact."""
    from mesa_ops.functional.norm import BN_MIN_PER_CHANNEL

    assert BN_MIN_PER_CHANNEL == 16
    for shape, exact in (((2, 8, 1, 1), True), ((2, 8, 2, 2), True), ((2, 8, 4, 4), False)):
        bn = ms.BatchNorm2d(8).train()
        ms.policy.set_mesa(bn, True, 8)
        ref = torch.nn.BatchNorm2d(8).train()
        x = torch.randn(shape, requires_grad=True)
        with ms.SavedActivationMeter(bn) as meter:
            y = bn(x)
        g = torch.randn_like(y)
        (y * g).sum().backward()
        xr = x.detach().clone().requires_grad_()
        (ref(xr) * g).sum().backward()
        assert (meter.total_bytes >= x.numel() * 4) == exact, shape
        if exact:
            assert torch.allclose(x.grad, xr.grad, atol=1e-6) and torch.allclose(bn.weight.grad, ref.weight.grad)


def test_verify_flags_the_stored_copy_that_causes_an_error_and_can_leave_it_exact():
    """Item 4: ms.compress(model, policy, verify=batch): exact vs Mesa gradients on the batch,
    per parameter; a layer stored at 1 bit is named as the cause of its weight's error, and with
    leave_exact it is switched to exact, the errors then under the threshold. The model's state
    (running ranges, draw counters, gradients, RNG) is as before the check."""
    from mesa_ops.verify import VerifyReport

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    net = ms.compress(net, "mesa8", warn=False)
    net[2].bits = 2  # a deliberately bad copy: the head's input at 2 bits
    x = torch.randn(32, 16)
    state = {k: v.clone() for k, v in net.state_dict().items()}
    rng = torch.get_rng_state()
    report = ms.verify(net, x, draws=2)
    assert isinstance(report, VerifyReport) and set(report.errors) == {n for n, _ in net.named_parameters()}
    assert [(p, c) for p, _, c in report.flagged] == [("2.weight", "2")]
    assert report.errors["0.weight"] < 0.05 and report.errors["2.weight"] > 0.2
    assert all(torch.equal(state[k], v) for k, v in net.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng) and all(p.grad is None for p in net.parameters())
    assert net[2].enable and "2.weight" in report.summary() and "from 2" in report.summary()

    rep = ms.verify(net, x, draws=2, leave_exact=True)
    assert rep.left_exact == ["2"] and not net[2].enable and net[0].enable
    assert max(rep.after.values()) < 0.05 and "left exact: 2" in rep.summary()


def test_verify_passes_a_mesa8_vit():
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2)
    model, report = ms.compress(model, "mesa8", verify=torch.randn(4, 3, 32, 32), return_report=True,
                                warn=False)
    assert report.verify.flagged == [] and 0 < report.verify.worst[1] < 0.05
    assert 0 < max(report.verify.vs_noise.values()) < 0.5 and "0 above 0.5x" in report.summary()


def test_verify_reads_dict_and_hugging_face_outputs():
    """A model returning a dict or a Hugging Face ModelOutput: verify projects its first
    floating-point tensor with a gradient (the logits; the loss where one is returned), as the
    same model returning the tensor; an output without one is a TypeError naming it."""
    SemanticSegmenterOutput = pytest.importorskip("transformers.modeling_outputs").SemanticSegmenterOutput

    class Net(torch.nn.Module):
        def __init__(self, wrap):
            super().__init__()
            self.body = torch.nn.Sequential(ms.Linear(16, 32), ms.GELU(), ms.Linear(32, 8))
            self.wrap = wrap

        def forward(self, x):
            return self.wrap(self.body(x))

    x = torch.randn(6, 16)
    wraps = {"tensor": lambda y: y, "dict": lambda y: {"mask": y > 0, "logits": y},
             "ModelOutput": lambda y: SemanticSegmenterOutput(logits=y)}
    reports = {}
    for name, wrap in wraps.items():
        torch.manual_seed(0)
        net = Net(wrap)
        ms.policy.set_mesa(net, True, 8)
        reports[name] = ms.verify(net, x, draws=2)
    assert reports["tensor"].errors == reports["dict"].errors == reports["ModelOutput"].errors
    assert 0 < reports["tensor"].worst[1] < 0.05
    net = Net(lambda y: {"mask": y > 0})
    ms.policy.set_mesa(net, True, 8)
    with pytest.raises(TypeError, match=r"output \(dict\) holds no floating-point tensor with a gradient"):
        ms.verify(net, x, draws=1)


# Item 2: attention forms spelled out in timm's own forward, routed to Mesa ops (64 px, batch 2,
# random init; Swin-V2's zero-init post-norm weights set to 1, else its attention gets no
# gradient). Measured: saved bytes 0.294x / 0.283x / 0.296x / 0.211x of exact, global gradient
# error 0.8% / 0.7% / 1.3% / 2.5% (cross-entropy on random labels).
EXPLICIT_CASES = {
    "cait_xxs24_224": (dict(img_size=64, depth=2), 0.33, 0.02),          # talking heads, class attn
    "xcit_nano_12_p16_224": (dict(img_size=64, depth=2), 0.31, 0.02),    # XCA (cosine), class attn
    "coat_lite_tiny": (dict(img_size=64), 0.33, 0.03),                   # factorised attention
    "swinv2_tiny_window8_256": (dict(img_size=64, window_size=4, depths=(1, 1, 1, 1)), 0.25, 0.04),
}


@pytest.mark.parametrize("name", list(EXPLICIT_CASES))
def test_explicit_and_cosine_attention_converted(name):
    """Every attention module converted (none reported left exact), every routed Mesa op used in
    the training forward (its running range set), the forward bit-identical, the saved bytes
    and the gradient error within the bounds above."""
    import torch.nn.functional as F

    kw, max_ratio, max_err = EXPLICIT_CASES[name]
    torch.manual_seed(0)
    ref = timm.create_model(name, **kw).train()
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "norm" in n and n.endswith("weight") and not p.any():
                p.fill_(1.0)
    mesa, report = ms.compress(copy.deepcopy(ref), "mesa8", warn=False, return_report=True)
    assert report.unsupported == [] and report.attention
    x, lab = torch.randn(2, 3, 64, 64), torch.randint(0, ref.num_classes, (2,))
    outs, saved = [], []
    for model in (ref, mesa.train()):
        torch.manual_seed(1)  # (the same drop-path draws)
        with ms.SavedActivationMeter(model) as meter:
            outs.append(model(x))
        saved.append(meter.total_bytes)
        F.cross_entropy(outs[-1], lab).backward()
    assert torch.equal(outs[0], outs[1])
    ops_of = importlib.import_module("mesa_ops.compress")._mesa_ops_of
    routed = [m for a in report.attention for m in ops_of(mesa.get_submodule(a))]
    assert routed and all(any(float(q.iteration.sum()) > 0 for q in m.modules()
                              if isinstance(q, ms.QuantMixin)) for m in routed)
    assert saved[1] / saved[0] < max_ratio, saved
    g, gr = _grads(mesa), _grads(ref)
    assert float((g - gr).norm() / gr.norm()) < max_err


def test_layer_scale_stores_its_input_packed():
    """timm's LayerScale (DeiT-III, ViTs with init_values) and LayerScale2d: x * gamma saved x
    exact for gamma's gradient (deit3_small, depth 2, 64 px: 48% of the saved bytes exact);
    converted, they store x packed, the gradient of x exact, gamma's close."""
    torch.manual_seed(0)
    ref = timm.create_model("deit3_small_patch16_224", depth=2, img_size=64).train()
    x = torch.randn(2, 3, 64, 64)
    mesa, report = ms.compress(copy.deepcopy(ref), "mesa8", example_inputs=x, return_report=True,
                               warn=False)
    assert report.unsupported == [] and report.converted["MesaLayerScale"] == 4
    # what stays exact: the image at the stem conv, per-row statistics
    assert report.audit.exact_bytes / report.audit.total_bytes < 0.21
    outs = []
    for model in (ref, mesa.train()):
        outs.append(model(x))
        outs[-1].square().sum().backward()
    assert torch.equal(outs[0], outs[1])
    for (n, p), q in zip(ref.named_parameters(), mesa.parameters()):
        if n.endswith("gamma"):
            assert float((q.grad - p.grad).norm() / p.grad.norm()) < 0.02, n



def test_layer_scale_2d_stores_its_input_packed():
    LayerScale2d = pytest.importorskip("timm.layers.layer_scale").LayerScale2d  # (timm >= 1.0.8)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), LayerScale2d(8, init_values=0.5))
    ref2 = copy.deepcopy(net)
    net = ms.compress(net, {"bits": 8}, warn=False).train()
    assert type(net[1]).__name__ == "MesaLayerScale2d" and net[1].enable
    xa = torch.randn(4, 3, 16, 16)
    with ms.SavedActivationMeter(net) as meter:
        y = net(xa)
    assert torch.equal(y, ref2(xa)) and meter.by_type["MesaLayerScale2d"] < 4 * 8 * 16 * 16 * 4 / 3
    g = torch.randn_like(y)
    y.backward(g)
    ref2(xa).backward(g)
    assert float((net[1].gamma.grad - ref2[1].gamma.grad).norm() / ref2[1].gamma.grad.norm()) < 0.02


# "Done when": timm models this issue does not name pass the same checks (64 px, batch 2,
# random init, 10 classes): forward bit-identical, every parameter's gradient within 5% (verify,
# 2 draws; measured worst 0.9-3.3%), nothing non-finite, and every module left saving exact
# tensors named in the report (compress's static listing plus its audit of one forward).
UNNAMED = {
    "deit3_small_patch16_224": dict(depth=2, img_size=64),      # LayerScale
    "beit_base_patch16_224": dict(depth=2, img_size=64),        # relative position bias in SDPA
    "eva02_tiny_patch14_224": dict(depth=2, img_size=56),       # rotary embedding, SwiGLU (listed)
    "pit_ti_224": dict(img_size=64),                            # pooling-based ViT
    "mixer_s16_224": dict(img_size=64),                         # MLP-Mixer
    "resmlp_12_224": dict(img_size=64),                         # Affine norms (listed)
    "convnext_atto": {},                                        # LayerNorm2d (listed)
    "resnet18": {},                                             # batch norms, ReLU
    "levit_128s": dict(img_size=64),                            # BN-linear attention (listed)
}


@pytest.mark.parametrize("name", list(UNNAMED))
def test_unnamed_timm_models(name):
    kw = dict(UNNAMED[name])
    size = kw.get("img_size", 64)
    torch.manual_seed(0)
    ref = timm.create_model(name, num_classes=10, **kw).train()
    x = torch.randn(2, 3, size, size)
    mesa, report = ms.compress(copy.deepcopy(ref), "mesa8", example_inputs=x, return_report=True,
                               warn=False)
    listed = {n for n, _, _ in report.unsupported}
    silent = [r.name for r in report.audit.uncompressed() if not r.is_mesa and r.name not in listed]
    assert silent == []
    outs = []
    for model in (ref, mesa.train()):
        torch.manual_seed(1)
        outs.append(model(x))
    assert torch.equal(outs[0], outs[1])
    check = ms.verify(mesa, x, draws=2)
    assert check.errors and all(e == e for e in check.errors.values())  # (NaN != NaN)
    assert check.flagged == [], check.summary()


def test_verify_judges_errors_against_minibatch_noise():
    """Item 4: efficientnet_b0's expand batch norms, whose exact weight gradients nearly cancel,
    have relative errors above 5% (measured 12-16%, 16 parameters), but Mesa's error is a small
    fraction of the spread of exact gradients over minibatches (at most 0.17x): nothing is
    flagged. The 2-bit copy of test_verify_flags_... is still flagged (that test)."""
    torch.manual_seed(0)
    model = ms.compress(timm.create_model("efficientnet_b0", num_classes=10), "mesa8", warn=False)
    report = ms.verify(model, torch.randn(8, 3, 64, 64), draws=2)
    assert sum(e > 0.05 for e in report.errors.values()) >= 5
    assert report.splits == 4 and set(report.vs_noise) == set(report.noise)
    assert report.flagged == [] and max(report.vs_noise.values()) < 0.5
    assert "0 above 0.5x" in report.summary()


def test_verify_minibatch_noise_is_the_spread_of_part_gradients():
    """The noise estimate on a case computed by hand: one Mesa Linear, the default projection
    loss sum(y * P) (P fixed, (8, 3)); parts of 2 rows, each part's weight gradient P_i^T x_i
    scaled to the whole batch (x4: a summed loss), their standard deviation / sqrt(4). A batch
    of 3 rows cannot be split: the relative-error criterion is used."""
    import math

    torch.manual_seed(0)
    lin = ms.Linear(6, 3)
    ms.policy.set_mesa(lin, True, 8)
    x = torch.randn(8, 6)
    report = ms.verify(lin, x, draws=1)
    P = torch.randn((8, 3), generator=torch.Generator().manual_seed(0)) / math.sqrt(24)
    gw = torch.stack([P[i:i + 2].T @ x[i:i + 2] for i in range(0, 8, 2)])  # (4, 3, 6)
    assert report.noise["weight"] == pytest.approx(float(4 * gw.std(0).norm() / 2), rel=1e-4)
    assert report.vs_noise["weight"] < 0.5 and report.flagged == []
    small = ms.verify(lin, x[:3], draws=1)
    assert small.noise == {} and small.vs_noise == {} and "above 5%" in small.summary()
