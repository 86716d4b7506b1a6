"""Mesa layers against their plain ``nn`` counterparts and exact autograd.

* forward bit-identical (torch.equal, same dtype) in train mode with compression on, at 8/4/2 bits;
* gradient relative errors norm(g_mesa - g_exact) / norm(g_exact) within stated bounds;
  ReLU's gradient exact; gradients that do not use the saved activation exact;
* float64 gradcheck of every Function's backward formula with an identity "quantizer";
* disabled / eval / no-grad: plain behaviour, nothing extra saved, running state untouched;
* saved bytes: exactly the packed copies (+ per-group fp32 scale/shift, + what backward needs);
  Softmax -> MatMul stores the attention map once;
* quantizer state (clip_val, shift, iteration): first step, EMA, batch mode, groups, head-wise,
  state_dict; errors (bad quant_groups, NaN/Inf) name the layer;
* Mesa layers are instances of the nn layers with the same parameter names.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import mesa_ops as ms
from mesa_ops import functional as MF

from tests._mesa_cases import (CASES, NAMES, PlainMatMul, code_bytes, enable_mesa, inputs,
                               make_pair, meter_bytes, rel_err, run, scale_bytes, unique_bytes)

BITS = (8, 4, 2)

# Which gradients depend on the saved (quantized) activation. The others (the input gradient of
# Linear/Conv2d, which needs only the weight; bias gradients, which need only gy) must be exact.
QUANTIZED_GRADS = {
    "Linear": {"weight"},
    "Conv2d": {"weight"},
    "LayerNorm": {"x0", "weight"},
    "GELU": {"x0"},
    "Softmax": {"x0"},
    "MatMul": {"x0", "x1"},
    "BatchNorm2d": {"x0", "weight"},
    "ReLU": set(),  # 1-bit mask of y > 0: exact
    "Normalize": {"x0"},
    "Scale": {"x1"},  # the scale's gradient sums gy * x; x's is gy * s: exact
}

# Bounds on the relative gradient error, inputs U[-1, 1), gy ~ N(0, 1), the shapes of
# _mesa_cases.CASES, G = 1. Measured with torch.manual_seed(0) (in brackets: the max over seeds
# 0..15, i.e. over weights, inputs and rounding noise), 8 / 4 / 2 bits:
#   Linear      weight 5.2e-3 / 9.0e-2 / 4.6e-1  (5.7e-3 / 9.7e-2 / 4.8e-1)
#   Conv2d      weight 5.5e-3 / 9.6e-2 / 4.7e-1  (5.9e-3 / 9.9e-2 / 5.0e-1)
#   LayerNorm   input  1.0e-3 / 1.8e-2 / 9.1e-2  (1.1e-3 / 1.9e-2 / 1.0e-1)
#               weight 5.2e-3 / 1.1e-1 / 4.3e-1  (6.4e-3 / 1.1e-1 / 6.3e-1)
#   GELU        input  3.2e-3 / 5.4e-2 / 2.7e-1  (3.2e-3 / 5.4e-2 / 2.7e-1)
#   Softmax     input  3.8e-3 / 6.3e-2 / 3.3e-1  (4.4e-3 / 7.6e-2 / 3.9e-1)
#   MatMul      a      5.7e-3 / 9.5e-2 / 4.7e-1  (5.9e-3 / 1.0e-1 / 5.2e-1)
#               b      5.6e-3 / 1.0e-1 / 5.1e-1  (5.8e-3 / 1.0e-1 / 5.1e-1)
#   BatchNorm2d input  8.4e-4 / 1.4e-2 / 7.2e-2  (8.4e-4 / 1.4e-2 / 7.2e-2)
#               weight 5.4e-3 / 8.4e-2 / 4.1e-1  (7.0e-3 / 1.3e-1 / 6.9e-1)
#   Normalize   input  2.5e-3 / 4.5e-2 / 2.5e-1  (2.9e-3 / 5.1e-2 / 2.7e-1)
#   Scale       scale  8.1e-3 / 6.6e-2 / 6.5e-1  (9.1e-3 / 1.4e-1 / 7.7e-1)
# (the BatchNorm weight gradient, a per-channel sum of gy * x_hat, varies most with the seed;
# 32 channels keep that spread moderate; so does the per-head scale's, over 12 heads.) The 8-bit bound is the 1e-2 for every layer;
# 4 and 2 bits are ~1.3x the max over seeds.
UNIFORM_BOUNDS = {
    "Linear": {8: 1e-2, 4: 0.13, 2: 0.65},
    "Conv2d": {8: 1e-2, 4: 0.13, 2: 0.65},
    "LayerNorm": {8: 1e-2, 4: 0.15, 2: 0.8},
    "GELU": {8: 1e-2, 4: 0.075, 2: 0.37},
    "Softmax": {8: 1e-2, 4: 0.1, 2: 0.5},
    "MatMul": {8: 1e-2, 4: 0.14, 2: 0.7},
    "BatchNorm2d": {8: 1e-2, 4: 0.18, 2: 0.9},
    "ReLU": {8: 0.0, 4: 0.0, 2: 0.0},
    "Normalize": {8: 1e-2, 4: 0.07, 2: 0.35},
    "Scale": {8: 1e-2, 4: 0.19, 2: 1.0},
}
# Gaussian N(0, 1) inputs: heavier tails stretch the range, so the step is larger relative to
# the bulk of the values. Measured, seed 0 (max over seeds 0..15), largest over the layers:
# 8 bits 1.8e-2 (1.8e-2, BatchNorm2d weight), 4 bits 2.6e-1 (2.9e-1, Softmax). At 2 bits the
# error reaches ~1.1: no useful bound, not tested.
GAUSS_BOUNDS = {8: 2.5e-2, 4: 0.4}


# ---- forward and gradients -------------------------------------------------------------------
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("name", NAMES)
def test_forward_bit_identical_and_gradient_error(name, bits):
    plain, mesa, shapes = make_pair(name)
    enable_mesa(mesa, bits)
    xs = inputs(shapes, "uniform")
    y0, gy, g0 = run(plain, xs)
    y1, _, g1 = run(mesa, xs, gy)
    assert y1.dtype == y0.dtype and torch.equal(y1, y0), "forward is not the plain op bit for bit"
    assert type(y1.grad_fn).__module__ == "torch.autograd.function", (
        f"compression did not engage: grad_fn is {type(y1.grad_fn).__name__}")
    if name == "BatchNorm2d":  # running statistics updated exactly as nn does
        for buf in ("running_mean", "running_var", "num_batches_tracked"):
            assert torch.equal(getattr(mesa, buf), getattr(plain, buf)), buf
    assert set(g1) == set(g0)
    bound = UNIFORM_BOUNDS[name][bits]
    for k in g0:
        err = rel_err(g1[k], g0[k])
        assert g1[k].dtype == g0[k].dtype and g1[k].shape == g0[k].shape
        if k in QUANTIZED_GRADS[name]:
            assert err <= bound, f"{name} {bits}-bit grad {k}: rel error {err:.3e} > {bound}"
            assert err > 1e-7, f"{name} grad {k} is exact: the saved copy was not quantized"
        else:
            assert err <= 1e-6, f"{name} grad {k} does not use the saved activation: {err:.3e}"


@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("name", [n for n in NAMES if n != "ReLU"])
def test_gradient_error_gaussian_inputs(name, bits):
    plain, mesa, shapes = make_pair(name)
    enable_mesa(mesa, bits)
    xs = inputs(shapes, "gauss")
    y0, gy, g0 = run(plain, xs)
    y1, _, g1 = run(mesa, xs, gy)
    assert torch.equal(y1, y0)
    for k in QUANTIZED_GRADS[name]:
        err = rel_err(g1[k], g0[k])
        assert err <= GAUSS_BOUNDS[bits], f"{name} {bits}-bit grad {k}: {err:.3e}"


@pytest.mark.parametrize("bits", BITS)
def test_relu_gradient_exact(bits):
    plain, mesa = nn.ReLU(), enable_mesa(ms.ReLU(), bits)
    x = torch.randn(5, 37, 11)
    x[0, :5] = 0.0  # exact zeros: gradient 0 there, as torch's relu
    x[1, :3] = -0.0
    y0, gy, g0 = run(plain, [x])
    y1, _, g1 = run(mesa, [x], gy)
    assert torch.equal(y1, y0) and torch.equal(g1["x0"], g0["x0"])


@pytest.mark.parametrize("kwargs", [
    dict(stride=2, padding=1), dict(groups=2, padding=2, dilation=2, bias=False),
    dict(padding="same"), dict(padding=1, padding_mode="reflect"), dict(padding=(0, 1), stride=(1, 2)),
], ids=["stride2", "groups2-dilation2-nobias", "same", "reflect", "asym"])
def test_conv2d_variants(kwargs):
    plain, mesa, _ = make_pair("Conv2d", plain=lambda: nn.Conv2d(8, 12, 3, **kwargs),
                               mesa=lambda: ms.Conv2d(8, 12, 3, **kwargs))
    enable_mesa(mesa, 8)
    xs = inputs([(2, 8, 9, 11)])
    y0, gy, g0 = run(plain, xs)
    y1, _, g1 = run(mesa, xs, gy)
    assert torch.equal(y1, y0)
    assert rel_err(g1["weight"], g0["weight"]) <= 1e-2
    assert rel_err(g1["x0"], g0["x0"]) <= 1e-6


def test_conv2d_channels_last_input_stored_in_memory_order():
    """A channels-last input (PVT's spatial-reduction conv: a (B, N, C) token tensor viewed as
    (B, C, H, W)) is packed in its memory order with groups along C, no transposing copy: same
    running range as the contiguous input, the same values with round-to-nearest, restored as a
    channels-last tensor; forward exact and weight gradient within the 8-bit bound."""
    from mesa_ops.packed import CHANNELS_LAST
    x = torch.randn(2, 8, 9, 11) * 2 + 1
    xl = x.contiguous(memory_format=torch.channels_last)
    qs = [ms.Conv2d(8, 12, 3, quant_groups=2, enable=True).train() for _ in range(2)]
    for q in qs:
        q.stochastic = False
    a, b = qs[0].quantize(x), qs[1].quantize(xl)
    assert a.transposed == 0 and b.transposed == CHANNELS_LAST and b.inner == 4
    assert torch.equal(qs[0].clip_val, qs[1].clip_val) and torch.equal(qs[0].shift, qs[1].shift)
    rb = b.dequantize()
    assert rb.is_contiguous(memory_format=torch.channels_last) and torch.equal(rb, a.dequantize())
    plain, mesa, _ = make_pair("Conv2d", plain=lambda: nn.Conv2d(8, 12, 3, padding=1),
                               mesa=lambda: ms.Conv2d(8, 12, 3, padding=1))
    enable_mesa(mesa, 8)
    xs = [inputs([(2, 11, 9, 8)])[0].permute(0, 3, 1, 2)]  # (channels-last)
    y0, gy, g0 = run(plain, xs)
    y1, _, g1 = run(mesa, xs, gy)
    assert torch.equal(y1, y0)
    assert rel_err(g1["weight"], g0["weight"]) <= 1e-2
    assert rel_err(g1["x0"], g0["x0"]) <= 1e-6


@pytest.mark.parametrize("variant", ["no-affine", "no-bias", "2d-normalized-shape"])
def test_layer_norm_variants(variant):
    kw, shape, ns = {}, (6, 10, 32), 32
    if variant == "no-affine":
        kw = dict(elementwise_affine=False)
    elif variant == "no-bias":
        kw = dict(bias=False)
    else:
        ns = (10, 32)
    plain, mesa, _ = make_pair("LayerNorm", plain=lambda: nn.LayerNorm(ns, **kw),
                               mesa=lambda: ms.LayerNorm(ns, **kw))
    enable_mesa(mesa, 8)
    xs = inputs([shape])
    y0, gy, g0 = run(plain, xs)
    y1, _, g1 = run(mesa, xs, gy)
    assert torch.equal(y1, y0) and set(g1) == set(g0)
    for k in g0:
        assert rel_err(g1[k], g0[k]) <= 1e-2, k


def test_gelu_tanh_and_softmax_other_dim():
    for plain_f, mesa_f, shape in [
        (lambda: nn.GELU("tanh"), lambda: ms.GELU("tanh"), (4, 9, 33)),
        (lambda: nn.Softmax(dim=1), lambda: ms.Softmax(dim=1), (3, 5, 7, 6)),
    ]:
        plain, mesa = plain_f(), enable_mesa(mesa_f(), 8)
        xs = inputs([shape])
        y0, gy, g0 = run(plain, xs)
        y1, _, g1 = run(mesa, xs, gy)
        assert torch.equal(y1, y0)
        assert rel_err(g1["x0"], g0["x0"]) <= 1e-2


def test_batch_norm_cumulative_momentum_and_no_tracking():
    for kw in (dict(momentum=None), dict(track_running_stats=False)):
        plain, mesa, _ = make_pair("BatchNorm2d", plain=lambda: nn.BatchNorm2d(8, **kw),
                                   mesa=lambda: ms.BatchNorm2d(8, **kw))
        enable_mesa(mesa, 8)
        for step in range(3):
            xs = inputs([(4, 8, 5, 5)])
            y0, gy, g0 = run(plain, xs)
            y1, _, g1 = run(mesa, xs, gy)
            assert torch.equal(y1, y0), (kw, step)
            assert rel_err(g1["x0"], g0["x0"]) <= 1e-2
        for buf in ("running_mean", "running_var", "num_batches_tracked"):
            a, b = getattr(mesa, buf), getattr(plain, buf)
            assert (a is None and b is None) or torch.equal(a, b), (kw, buf)


def test_linear_output_modified_in_place_on_3d_input():
    """A Mesa Linear on a (B, N, C) input followed by an in-place op left exact (Swin-V2's
    cpb_mlp: Linear -> ReLU(inplace=True)): the output is not a view (it raised "Output 0 of
    _Linear is a view and is being modified inplace") and stays F.linear's bits."""
    lin = enable_mesa(ms.Linear(16, 24), 8)
    ref = nn.Linear(16, 24)
    ref.load_state_dict(lin.state_dict(), strict=False)
    for shape in [(5, 7, 16), (2, 3, 4, 16), (3, 16)]:
        x = torch.randn(shape)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        y0, y1 = torch.relu_(ref(xa)), torch.relu_(lin(xb))
        assert torch.equal(y1, y0), shape
        gy = torch.randn_like(y0)
        y0.backward(gy)
        y1.backward(gy)
        assert rel_err(xb.grad, xa.grad) <= 1e-2, shape


def test_matmul_transposed_and_broadcast_inputs():
    """q @ k^T with k^T a transposed view (stored without a copy), and broadcast batch dims."""
    mm = enable_mesa(ms.MatMul(), 8)
    q, k = inputs([(2, 4, 16, 8), (2, 4, 16, 8)])
    qa, ka = q.clone().requires_grad_(), k.clone().requires_grad_()
    qb, kb = q.clone().requires_grad_(), k.clone().requires_grad_()
    y0 = qa @ ka.transpose(-2, -1)
    with ms.SavedActivationMeter(mm) as meter:
        y1 = mm(qb, kb.transpose(-2, -1))
    assert torch.equal(y1, y0)
    assert meter.total_bytes == 2 * (1024 + scale_bytes(1))  # 8-bit copies, no copy of k^T
    gy = torch.randn_like(y0)
    y0.backward(gy)
    y1.backward(gy)
    assert rel_err(qb.grad, qa.grad) <= 1e-2 and rel_err(kb.grad, ka.grad) <= 1e-2

    a, b = inputs([(2, 1, 6, 5), (3, 5, 7)])  # -> (2, 3, 6, 7)
    y0, gy, g0 = run(PlainMatMul(), [a, b])
    y1, _, g1 = run(enable_mesa(ms.MatMul(), 8), [a, b], gy)
    assert torch.equal(y1, y0)
    for k_ in ("x0", "x1"):
        assert g1[k_].shape == g0[k_].shape and rel_err(g1[k_], g0[k_]) <= 1e-2


# ---- backward formulas: float64 gradcheck with an identity quantizer -------------------------
class IdentityQuant:
    """Stands in for a layer's quantizer: 'stores' the activation unchanged (compression off)."""
    bits = 8
    enable = True  # MatMul stores an input packed only when its quantizer is enabled

    def quantize(self, x, amp16=False, norm=None, traced=None):
        # (norm: a LayerNorm's (mean, rstd); it stores x-hat; traced: torch.compile traces)
        return x if norm is None else (x - norm[0]) * norm[1]

    def describe(self):
        return "IdentityQuant"


def _d(*shape):
    return torch.randn(*shape, dtype=torch.float64, requires_grad=True)


GRADCHECK_CASES = {
    "linear": lambda q: (lambda x, w, b: MF.linear_fn(x, w, b, q), (_d(3, 4, 5), _d(6, 5), _d(6))),
    "linear-nobias": lambda q: (lambda x, w: MF.linear_fn(x, w, None, q), (_d(4, 5), _d(3, 5))),
    "conv2d": lambda q: (lambda x, w, b: MF.conv2d_fn(x, w, b, (2, 1), (1, 0), (1, 1), 1, q),
                         (_d(2, 3, 6, 5), _d(4, 3, 3, 2), _d(4))),
    "conv2d-groups": lambda q: (lambda x, w: MF.conv2d_fn(x, w, None, (1, 1), (1, 1), (2, 2), 2, q),
                                (_d(2, 4, 6, 6), _d(6, 2, 3, 3))),
    "layer_norm": lambda q: (lambda x, w, b: MF.layer_norm_fn(x, (5,), w, b, 1e-5, q),
                             (_d(3, 4, 5), _d(5), _d(5))),
    "layer_norm-noaffine": lambda q: (lambda x: MF.layer_norm_fn(x, (4, 5), None, None, 1e-5, q),
                                      (_d(3, 4, 5),)),
    "batch_norm": lambda q: (lambda x, w, b: MF.batch_norm_fn(x, w, b, None, None, 0.1, 1e-5, q),
                             (_d(4, 3, 3, 2), _d(3), _d(3))),
    "batch_norm-running": lambda q: (
        lambda x, w, b: MF.batch_norm_fn(x, w, b, torch.zeros(3, dtype=torch.float64),
                                         torch.ones(3, dtype=torch.float64), 0.1, 1e-5, q),
        (_d(4, 3, 3, 2), _d(3), _d(3))),
    "gelu": lambda q: (lambda x: MF.gelu_fn(x, "none", q), (_d(3, 7),)),
    "gelu-tanh": lambda q: (lambda x: MF.gelu_fn(x, "tanh", q), (_d(3, 7),)),
    "softmax": lambda q: (lambda x: MF.softmax_fn(x, -1, q), (_d(2, 3, 4, 5),)),
    "softmax-dim1": lambda q: (lambda x: MF.softmax_fn(x, 1, q), (_d(2, 3, 4),)),
    "matmul": lambda q: (lambda a, b: MF.matmul_fn(a, b, q, q), (_d(2, 3, 4, 5), _d(2, 3, 5, 2))),
    "matmul-broadcast": lambda q: (lambda a, b: MF.matmul_fn(a, b, q, q), (_d(2, 1, 4, 5), _d(3, 5, 2))),
    "relu": lambda q: (MF.relu_fn, (_d(4, 9),)),
    "normalize": lambda q: (lambda x: MF.normalize_fn(x, -1, 1e-12, q), (_d(2, 3, 4, 5),)),
    "normalize-dim1": lambda q: (lambda x: MF.normalize_fn(x, 1, 1e-12, q), (_d(2, 3, 4),)),
    "scale": lambda q: (lambda x, s: MF.scale_fn(x, s, q), (_d(2, 3, 4, 5), _d(3, 1, 1))),
    "scale-4d": lambda q: (lambda x, s: MF.scale_fn(x, s, q), (_d(2, 3, 4, 4), _d(1, 3, 1, 1))),
}


@pytest.mark.parametrize("case", list(GRADCHECK_CASES))
def test_backward_formula_gradcheck_float64(case):
    fn, args = GRADCHECK_CASES[case](IdentityQuant())
    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-5, rtol=1e-4)


def test_normalize_rows_below_eps_and_scale_without_its_gradient():
    """Rows whose norm is at most eps are divided by eps (F.normalize's clamp): their gradient
    is gy / eps, as autograd's; a scale that takes no gradient stores no copy of x."""
    x = torch.randn(2, 3, 4, 5, dtype=torch.float64)
    x[0, 1, 2] = 1e-14
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    gy = torch.randn_like(x)
    torch.nn.functional.normalize(xa, dim=-1).backward(gy)
    MF.normalize_fn(xb, -1, 1e-12, IdentityQuant()).backward(gy)
    assert torch.allclose(xb.grad, xa.grad, rtol=1e-9, atol=0)
    scale = enable_mesa(ms.Scale(), 8)
    x = torch.randn(2, 3, 4, 4, requires_grad=True)
    with ms.SavedActivationMeter(scale) as meter:
        y = scale(x, torch.rand(3, 1, 1))  # (a constant: plain x * s, which saves only s)
    assert meter.total_bytes == 3 * 4 and type(y.grad_fn).__name__ == "MulBackward0"


# ---- off paths: disabled, eval, no grad ------------------------------------------------------
def _iterations(layer):
    return [float(m.iteration.sum()) for m in layer.modules() if isinstance(m, ms.QuantMixin)]


@pytest.mark.parametrize("mode", ["disabled", "eval", "no-input-grad"])
@pytest.mark.parametrize("name", NAMES)
def test_off_paths_are_the_plain_layer(name, mode):
    plain, mesa, shapes = make_pair(name)
    if mode != "disabled":
        enable_mesa(mesa, 4)
    if mode == "eval":
        plain.eval()
        mesa.eval()
    xs = inputs(shapes)
    rg = mode != "no-input-grad"
    if not rg:  # parameters also frozen: nothing needs a gradient
        for p_ in list(plain.parameters()) + list(mesa.parameters()):
            p_.requires_grad_(False)
    b0, y0 = meter_bytes(plain, xs, rg)
    b1, y1 = meter_bytes(mesa, xs, rg)
    assert y1.dtype == y0.dtype and torch.equal(y1, y0)
    assert b1 == b0, f"{name} {mode}: saved {b1} bytes, the plain layer {b0}"
    assert all(it == 0 for it in _iterations(mesa)), "running range updated off the Mesa path"
    with torch.no_grad():
        assert torch.equal(mesa(*xs), plain(*xs))
    assert all(it == 0 for it in _iterations(mesa))


# ---- what is saved ---------------------------------------------------------------------------
def _mask_scale_bytes():
    qt = ms.packed.pack_mask(torch.randn(10))
    nbytes = unique_bytes(qt.step, qt.shift)
    assert nbytes <= 16, nbytes
    return nbytes


def _expected_bytes(name, shapes, bits, groups=1):
    """Exact bytes a Mesa layer saves: packed codes + fp32 step and shift per group + extras."""
    n = math.prod(shapes[0])
    ss = scale_bytes(groups)
    if name == "ReLU":
        return code_bytes(n, 1) + _mask_scale_bytes()  # 1-bit mask
    if name == "MatMul":
        return code_bytes(n, bits) + ss + code_bytes(math.prod(shapes[1]), bits) + ss
    extra = 0
    if name == "LayerNorm":  # fp32 rstd per normalized row (it stores x-hat: no mean)
        extra = 4 * (n // shapes[0][-1])
    if name == "BatchNorm2d":  # fp32 batch mean and invstd per channel
        extra = 2 * 4 * shapes[0][1]
    if name == "Normalize":  # fp32 norm per normalized row
        extra = 4 * (n // shapes[0][-1])
    if name == "Scale":  # the scale itself, as it is
        extra = 4 * math.prod(shapes[1])
    return code_bytes(n, bits) + ss + extra


@pytest.mark.parametrize("name", NAMES)
def test_saved_bytes_are_only_what_backward_needs(name):
    plain, mesa, shapes = make_pair(name)
    xs = inputs(shapes)
    plain_bytes, _ = meter_bytes(plain, xs)
    for bits in BITS:
        enable_mesa(mesa, bits)
        got, _ = meter_bytes(mesa, xs)
        assert got == _expected_bytes(name, shapes, bits), f"{name} {bits}-bit: {got} bytes"
    # e.g. Linear keeps no copy of the weight, Softmax no copy of its input: at 8 bits a Mesa
    # layer holds at most ~1/4 of the fp32 bytes (ReLU 1/32 + 8 bytes).
    enable_mesa(mesa, 8)
    got, _ = meter_bytes(mesa, xs)
    assert got <= plain_bytes / 4 + 1100, (got, plain_bytes)


def test_saved_bytes_with_groups():
    for name, g in (("Linear", 4), ("Conv2d", 8), ("GELU", 16), ("MatMul", 4), ("Softmax", 4)):
        shapes = CASES[name][2]
        mesa = {"Linear": lambda: ms.Linear(64, 48, quant_groups=g),
                "Conv2d": lambda: ms.Conv2d(8, 12, 3, padding=1, quant_groups=g),
                "GELU": lambda: ms.GELU(quant_groups=g),
                "MatMul": lambda: ms.MatMul(quant_groups=g),
                "Softmax": lambda: ms.Softmax(-1, quant_groups=g)}[name]()
        enable_mesa(mesa, 4)
        got, _ = meter_bytes(mesa, inputs(shapes))
        assert got == _expected_bytes(name, shapes, 4, g), name


class _Attention(nn.Module):
    def __init__(self, bits_softmax=8, bits_matmul=8, quant_groups=1):
        super().__init__()
        self.softmax = ms.Softmax(dim=-1, quant_groups=quant_groups)
        self.mm = ms.MatMul(quant_groups=quant_groups)
        enable_mesa(self.softmax, bits_softmax)
        enable_mesa(self.mm, bits_matmul)
        self.touch = False

    def forward(self, x, v):
        attn = self.softmax(x)
        if self.touch:
            attn.mul_(1.0)  # an in-place change invalidates the shared copy
        return self.mm(attn, v)


def test_softmax_output_stored_once_for_matmul():
    B, H, N, D = 2, 4, 16, 8
    x, v = inputs([(B, H, N, N), (B, H, N, D)])
    na, nv = B * H * N * N, B * H * N * D
    ss = scale_bytes(1)
    once = (na + ss) + (nv + ss)  # one 8-bit copy of the attention map, one of v
    twice = 2 * (na + ss) + (nv + ss)
    att = _Attention()
    got, _ = meter_bytes(att, [x, v])
    assert got == once and got < twice and once < 0.26 * (4 * na + 4 * nv)
    # with quant_groups = H: each copy carries H scales and shifts
    got, _ = meter_bytes(_Attention(quant_groups=H), [x, v])
    assert got == na + nv + 2 * scale_bytes(H)
    # shared copy still gives accurate gradients for x and v
    xa, va = x.clone().requires_grad_(), v.clone().requires_grad_()
    xb, vb = x.clone().requires_grad_(), v.clone().requires_grad_()
    y0 = torch.softmax(xa, -1) @ va
    y1 = att(xb, vb)
    assert torch.equal(y1, y0)
    gy = torch.randn_like(y0)
    y0.backward(gy)
    y1.backward(gy)
    assert rel_err(xb.grad, xa.grad) <= 1e-2 and rel_err(vb.grad, va.grad) <= 1e-2
    # matmul's own quantizer for `a` was not used: the copy came from the softmax
    assert float(att.mm.quant1.iteration) == 0 and float(att.softmax.quant2.iteration) == 2


def test_softmax_copy_not_shared_when_invalid():
    x, v = inputs([(2, 4, 16, 16), (2, 4, 16, 8)])
    att = _Attention()
    att.touch = True
    ss = scale_bytes(1)
    got, _ = meter_bytes(att, [x, v])
    assert got == 2 * (2048 + ss) + (1024 + ss), "modified in place: MatMul must store its own copy"
    got, _ = meter_bytes(_Attention(bits_softmax=8, bits_matmul=4), [x, v])
    assert got == (2048 + ss) + (code_bytes(2048, 4) + ss) + (code_bytes(1024, 4) + ss), \
        "different bits: no sharing"


# ---- quantizer state -------------------------------------------------------------------------
def test_running_range_first_step_then_ema():
    layer = enable_mesa(ms.GELU(), 8)
    x1, x2, x3 = (torch.randn(4, 10, 32) * s + o for s, o in ((1, 0), (3, 1), (0.5, -2)))
    layer(x1.requires_grad_())
    r1, lo1 = x1.max() - x1.min(), x1.min()
    assert torch.equal(layer.clip_val, r1.reshape(1)) and torch.equal(layer.shift, lo1.reshape(1))
    assert float(layer.iteration) == 1
    c, s = layer.clip_val.clone(), layer.shift.clone()
    for x in (x2, x3):
        layer(x.requires_grad_())
        r, lo = x.max() - x.min(), x.min()
        c, s = c * 0.9 + r * 0.1, s * 0.9 + lo * 0.1
        torch.testing.assert_close(layer.clip_val, c, rtol=1e-6, atol=0)
        torch.testing.assert_close(layer.shift, s, rtol=1e-6, atol=1e-7)
        assert not torch.allclose(layer.clip_val, r.reshape(1))  # not the batch range
    assert float(layer.iteration) == 3


def test_ema_decay_setting_and_batch_range_mode():
    layer = enable_mesa(ms.Linear(32, 8), 8, ema_decay=0.5)
    x1, x2 = torch.rand(5, 32) * 2, torch.rand(5, 32) * 6 - 3
    layer(x1.requires_grad_())
    layer(x2.requires_grad_())
    torch.testing.assert_close(layer.clip_val, ((x1.max() - x1.min()) * 0.5 + (x2.max() - x2.min()) * 0.5)
                               .reshape(1), rtol=1e-6, atol=0)
    layer = enable_mesa(ms.Linear(32, 8), 8, range_mode="batch")
    for x in (x1, x2):
        layer(x.requires_grad_())
        assert torch.equal(layer.clip_val, (x.max() - x.min()).reshape(1))
        assert torch.equal(layer.shift, x.min().reshape(1))
    assert float(layer.iteration) == 2


def test_group_ranges():
    # (B, N, C): G contiguous groups along the last dim
    lin = enable_mesa(ms.Linear(64, 8, quant_groups=4), 8)
    x = torch.randn(3, 5, 64) * torch.arange(1, 65).float()
    lin(x.requires_grad_())
    v = x.reshape(-1, 4, 16)
    assert torch.equal(lin.clip_val, v.amax((0, 2)) - v.amin((0, 2)))
    assert torch.equal(lin.shift, v.amin((0, 2)))
    # (B, C, H, W): groups along C (G = C: per channel)
    conv = enable_mesa(ms.Conv2d(6, 2, 1, quant_groups=6), 8)
    x = torch.randn(2, 6, 4, 4) * torch.arange(1, 7).float().view(1, 6, 1, 1)
    conv(x.requires_grad_())
    assert torch.equal(conv.clip_val, x.amax((0, 2, 3)) - x.amin((0, 2, 3)))
    # group_size: G derived from the channel dim at the first step
    gelu = enable_mesa(ms.GELU(group_size=16), 8)
    gelu(torch.randn(2, 3, 64, requires_grad=True))
    assert gelu.clip_val.shape == (4,) and gelu.quant_groups == 4


def test_head_wise_groups_on_attention_tensors():
    B, H, N, D = 2, 4, 16, 8
    scale = torch.tensor([0.5, 1.0, 2.0, 4.0]).view(1, H, 1, 1)
    a, b = torch.randn(B, H, N, D) * scale, torch.randn(B, H, D, N) * scale
    mm = enable_mesa(ms.MatMul(quant_groups=H), 8)
    mm(a.requires_grad_(), b.requires_grad_())
    for q, t in ((mm.quant1, a), (mm.quant2, b)):
        assert q.clip_val.shape == (H,)
        assert torch.equal(q.clip_val, t.amax((0, 2, 3)) - t.amin((0, 2, 3)))
        assert torch.equal(q.shift, t.amin((0, 2, 3)))
    sm = enable_mesa(ms.Softmax(-1, quant_groups=H), 8)
    x = torch.randn(B, H, N, N) * scale * 3
    y = sm(x.requires_grad_())
    assert torch.equal(sm.quant2.clip_val, y.amax((0, 2, 3)) - y.amin((0, 2, 3)))
    assert not torch.allclose(sm.quant2.clip_val, sm.quant2.clip_val[0].expand(H))


def test_quantizer_state_in_state_dict():
    for name in NAMES:
        _, mesa, shapes = make_pair(name)
        enable_mesa(mesa, 8)
        prefixes = ["quant1.", "quant2."] if name in ("Softmax", "MatMul") else [""]
        sd0 = mesa.state_dict()
        for p in prefixes:
            for k in ("clip_val", "shift", "iteration", "draws"):
                assert p + k in sd0, (name, p + k)
        if name == "ReLU":
            continue  # the mask has no range
        meter_bytes(mesa, inputs(shapes))
        sd = mesa.state_dict()
        q = "quant2." if name in ("Softmax", "MatMul") else ""
        assert float(sd[q + "iteration"]) == 1 and not torch.equal(sd[q + "clip_val"], torch.ones(1))
        fresh = CASES[name][1]()
        fresh.load_state_dict(sd)
        for k, v in sd.items():
            assert torch.equal(fresh.state_dict()[k], v), (name, k)


# ---- errors ----------------------------------------------------------------------------------
class _Net(nn.Module):
    def __init__(self, **children):
        super().__init__()
        for k, m in children.items():
            setattr(self, k, m)


def test_quant_groups_not_dividing_channels_raises_naming_layer():
    net = _Net(fc1=ms.Linear(64, 8, quant_groups=5))
    ms.policy.set_mesa(net, True, 8)
    with pytest.raises(ValueError) as exc:
        net.fc1(torch.randn(8, 16, 64, requires_grad=True))
    msg = str(exc.value)
    assert "fc1" in msg and "Linear" in msg and "(8, 16, 64)" in msg and "quant_groups=5" in msg, msg

    net = _Net(attn_mm=ms.MatMul(quant_groups=3))
    ms.policy.set_mesa(net, True, 8)
    with pytest.raises(ValueError) as exc:
        net.attn_mm(torch.randn(2, 4, 6, 5, requires_grad=True), torch.randn(2, 4, 5, 6))
    msg = str(exc.value)
    assert "attn_mm" in msg and "(2, 4, 6, 5)" in msg and "quant_groups=3" in msg, msg


@pytest.mark.filterwarnings("ignore:.*holds NaN or Inf:RuntimeWarning")  # the skip mode's warning
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("name", [n for n in NAMES if n != "ReLU"])  # ReLU keeps a mask: no range
def test_non_finite_input_raises_naming_layer(name, bad):
    plain, mesa, shapes = make_pair(name)
    net = _Net(block7=mesa)
    ms.policy.set_mesa(net, True, 8)
    xs = inputs(shapes)
    xs[0].view(-1)[3] = bad
    leaves = [x.clone().requires_grad_() for x in xs]
    with pytest.raises(FloatingPointError, match="block7") as exc:
        mesa(*leaves)
    assert "NaN or Inf" in str(exc.value)
    assert all(it == 0 for it in _iterations(mesa)), "running range poisoned before the raise"
    # check_finite=False: no check, forward still the plain op
    ms.policy.set_mesa(net, True, 8, check_finite=False)
    y = mesa(*[x.clone().requires_grad_() for x in xs])
    y0 = plain(*[x.clone().requires_grad_() for x in xs])
    torch.testing.assert_close(y, y0, rtol=0, atol=0, equal_nan=True)


def test_bad_bits_raise():
    with pytest.raises(ValueError, match="bits"):
        ms.Linear(4, 4, bits=3)
    with pytest.raises(ValueError, match="level"):
        ms.GELU().level = 8


# ---- class identity and parameter names ------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_instances_of_nn_layers_with_same_parameter_names(name):
    plain, mesa, _ = make_pair(name)
    if name not in ("MatMul", "Normalize", "Scale"):  # (ops with no nn module)
        assert isinstance(mesa, type(plain))
    assert [n for n, _ in mesa.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert set(plain.state_dict()) <= set(mesa.state_dict())
    # an nn checkpoint loads into the Mesa layer (only the quantizer buffers are missing)
    fresh = CASES[name][1]()
    res = fresh.load_state_dict(plain.state_dict(), strict=False)
    assert not res.unexpected_keys
    assert all(k.split(".")[-1] in ("clip_val", "shift", "iteration", "draws") for k in res.missing_keys)


def test_policy_updates_log_instead_of_printing(capsys, caplog):
    """Policy updates go to the 'mesa_ops' logger for every layer type (in the first version,
    Softmax and MatMul, which have no ``verbose`` of their own, printed them to stdout)."""
    with caplog.at_level("INFO", logger="mesa_ops"):
        for name in NAMES:
            ms.policy.set_mesa(CASES[name][1](), True, 4)
    assert capsys.readouterr().out == ""
    logged = " ".join(r.getMessage() for r in caplog.records)
    for tag in ("fc", "softmax", "matmul", "relu"):
        assert f"update {tag}_bits to 4" in logged, tag


# ---- CUDA ------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("name", NAMES)
def test_cuda_forward_bit_identical_and_gradient_error(name):
    plain, mesa, shapes = make_pair(name)
    plain.cuda()
    mesa.cuda()
    enable_mesa(mesa, 8)
    xs = inputs(shapes, "uniform", device="cuda")
    y0, gy, g0 = run(plain, xs)
    y1, _, g1 = run(mesa, xs, gy)
    assert torch.equal(y1, y0)
    assert type(y1.grad_fn).__module__ == "torch.autograd.function"
    for k in g0:
        err = rel_err(g1[k], g0[k])
        bound = UNIFORM_BOUNDS[name][8] if k in QUANTIZED_GRADS[name] else 1e-5
        assert err <= bound, f"{name} grad {k}: {err:.3e}"
    got, _ = meter_bytes(mesa, xs)
    assert got <= _expected_bytes(name, shapes, 8) + 64  # scale rows may differ on the GPU


@pytest.mark.cuda
def test_cuda_draw_counter_moved_by_data_comes_back_to_the_cpu():
    """FSDP2's fully_shard moves buffers by ``.data`` (the same tensor, the same version): the
    draw counter, which the kernels read on the host, is moved back to the CPU before a step."""
    q = ms.Quantizer(enable=True).cuda().train()
    x = torch.randn(4, 8, device="cuda")
    q.quantize(x)
    d = q._buffers["draws"]
    d.data = d.data.cuda()
    q.quantize(x)
    assert q._buffers["draws"].device.type == "cpu" and int(q._draws) == 2
