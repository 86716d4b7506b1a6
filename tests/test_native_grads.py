"""The extension's native composites (cuda/layer_grads.cpp: ``linear_backward``,
``layer_norm_backward``, ``gelu_table``) against their pure-PyTorch specifications in
mesa_ops.functional / mesa_ops.packed, bit for bit, on every branch they take (affine folds,
thin outputs, few tokens, mixed dtypes, partial needs); the specifications against exact
autograd; and the layers' backwards calling the native versions (issue 48: one call each)."""
from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F

import mesa_ops as ms
from mesa_ops import backend, packed
from mesa_ops.functional import linear, norm
from tests._mesa_cases import enable_mesa


@pytest.fixture(scope="module")
def native(cpp_backend):
    ext = backend.native_ops()
    if ext is None:
        pytest.skip("MESA_BACKEND=torch: the layers run the specifications")
    return ext


def _same(a, b, what):
    assert (a is None) == (b is None), what
    if a is not None:
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        assert torch.equal(a, b), f"{what}: max diff {(a.double() - b.double()).abs().max():.3e}"


def _same_for_every_need(spec, native_fn, args_of):
    """``native_fn`` equals its pure-PyTorch ``spec`` bit for bit on every (need_x, need_w,
    need_b), with the arguments ``args_of(need)``: (gx, gw, gb) each."""
    for need in itertools.product((True, False), repeat=3):
        args = args_of(need)
        for name, g, w in zip(("gx", "gw", "gb"), native_fn(*args), spec(*args)):
            _same(g, w, f"{name} need={need}")


LINEAR_CASES = [  # (tokens, out, affine (a, c present), cdt, weight dtype)
    (40, 24, None, torch.float32, torch.float32),    # thin output: the (x^T g)^T orientation
    (40, 96, None, torch.float32, torch.float32),
    (6, 96, (True, True), torch.float32, torch.float32),    # fewer tokens than outputs: x restored
    (200, 96, (True, True), torch.float32, torch.float32),  # the fold: (g^T x-hat) * a + outer
    (200, 96, (True, False), torch.float32, torch.float32),
    (200, 96, (False, True), torch.float32, torch.float32),
    (200, 96, (True, True), torch.bfloat16, torch.float32),  # autocast: bf16 compute, fp32 params
    (6, 24, (True, True), torch.bfloat16, torch.float32),
    (40, 96, None, torch.bfloat16, torch.float32),
    (40, 96, None, torch.float16, torch.float16),
]


@pytest.mark.parametrize("tokens, out, affine, cdt, wdt", LINEAR_CASES)
def test_linear_backward_is_its_specification(native, tokens, out, affine, cdt, wdt):
    torch.manual_seed(1)
    n_in = 32
    x = torch.randn(2, tokens // 2, n_in, dtype=torch.float32 if affine else cdt)
    weight = torch.randn(out, n_in, dtype=wdt).to(cdt)  # as the forward used it (cast once)
    gy = torch.randn(2, tokens // 2, out, dtype=cdt)
    a = torch.randn(n_in) if affine and affine[0] else None
    c = torch.randn(n_in) if affine and affine[1] else None
    _same_for_every_need(linear.linear_grads, native.linear_backward,
                         lambda need: (gy, x, weight, affine is not None, a, c, *need, cdt, cdt, wdt, wdt))


def test_linear_grads_match_autograd():
    """The specification is the gradient of x W^T + b (restored x = x-hat * a + c)."""
    torch.manual_seed(2)
    for tokens, fold in ((6, True), (200, True), (200, False)):
        xh = torch.randn(tokens, 32)
        a, c = torch.randn(32), torch.randn(32)
        x = (xh * a + c).requires_grad_() if fold else xh.clone().requires_grad_()
        w = torch.randn(96, 32, requires_grad=True)
        b = torch.randn(96, requires_grad=True)
        gy = torch.randn(tokens, 96)
        F.linear(x, w, b).backward(gy)
        gx, gw, gb = linear.linear_grads(gy, xh if fold else x.detach(), w.detach(), fold, a if fold else None,
                                         c if fold else None, True, True, True, torch.float32,
                                         torch.float32, torch.float32, torch.float32)
        for got, want in ((gx, x.grad), (gw, w.grad), (gb, b.grad)):
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-4), (got - want).abs().max()


NORM_CASES = [  # (shape, cdt, own column sums)
    ((2, 7, 48), torch.float32, True),
    ((2, 7, 48), torch.float32, False),
    ((2, 7, 48), torch.bfloat16, False),
    ((5, 48), torch.float64, True),
]


@pytest.mark.parametrize("shape, cdt, own", NORM_CASES)
def test_layer_norm_backward_is_its_specification(native, shape, cdt, own):
    torch.manual_seed(3)
    x = torch.randn(shape)
    xh32, _, rstd = torch.native_layer_norm(x, shape[-1:], None, None, 1e-6)
    xh = xh32.to(torch.float64) if cdt is torch.float64 else xh32
    rstd = rstd.to(xh.dtype)
    stats = torch.native_layer_norm(x.to(cdt), shape[-1:], None, None, 1e-6)[1].dtype  # (bf16 on the CPU)
    zero, one = torch.zeros_like(rstd, dtype=stats), torch.ones_like(rstd, dtype=stats)
    w, b = torch.randn(shape[-1]).to(cdt), torch.randn(shape[-1]).to(cdt)
    gy = torch.randn(shape, dtype=cdt)
    _same_for_every_need(norm.layer_norm_grads, native.layer_norm_backward,
                         lambda need: (gy, xh, rstd, zero, one, w, b, list(shape[-1:]), *need, own, cdt, cdt, cdt,
                                       cdt))


def test_layer_norm_grads_match_autograd():
    torch.manual_seed(4)
    x = torch.randn(3, 5, 48, requires_grad=True)
    w = torch.randn(48, requires_grad=True)
    b = torch.randn(48, requires_grad=True)
    gy = torch.randn(3, 5, 48)
    F.layer_norm(x, (48,), w, b, 1e-6).backward(gy)
    xh, _, rstd = torch.native_layer_norm(x.detach(), (48,), None, None, 1e-6)
    zero, one = torch.zeros_like(rstd), torch.ones_like(rstd)
    for own in (True, False):
        gx, gw, gb = norm.layer_norm_grads(gy, xh, rstd, zero, one, w.detach(), b.detach(), [48], True, True,
                                           True, own, torch.float32, torch.float32, torch.float32, torch.float32)
        for got, want in ((gx, x.grad), (gw, w.grad), (gb, b.grad)):
            assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (got - want).abs().max()


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16, torch.float64))
@pytest.mark.parametrize("approximate", ("none", "tanh"))
def test_gelu_table_is_its_specification(native, dtype, approximate):
    torch.manual_seed(5)
    x = (torch.randn(4, 256) * 3).to(dtype)
    grad = torch.randn(4, 256).to(dtype)
    for g in (None, grad):
        _same(native.gelu_table(x, g, approximate, dtype), packed.gelu_table(x, approximate, g, None),
              f"grad={'yes' if g is not None else 'no'}")
    exact = F.gelu(x.double(), approximate=approximate)
    assert torch.equal(packed.gelu_table(x, approximate), exact.to(dtype))  # rounded once


def test_layers_call_the_native_composites(native, monkeypatch):
    """A Mesa Linear / LayerNorm / GELU backward makes one native call each (not the
    specification's ops; the GELU one for its derivative's table, and fc2's restore of GELU(x)
    one for GELU's), with the specification's results bit for bit."""
    calls = []

    class Spy:
        def __getattr__(self, name):
            fn = getattr(native, name)

            def spied(*a, **k):
                calls.append(name)
                return fn(*a, **k)
            return spied

    model = torch.nn.Sequential(ms.LayerNorm(32), ms.Linear(32, 64), ms.GELU(), ms.Linear(64, 8)).train()
    for m in model:
        enable_mesa(m, 8)
    x = torch.randn(2, 10, 32)

    def grads(native_for):
        monkeypatch.setattr(linear, "native_for", native_for)
        monkeypatch.setattr(norm, "native_for", native_for)
        from mesa_ops.functional import activation
        monkeypatch.setattr(activation, "native_for", native_for)
        monkeypatch.setattr(packed, "native_for", native_for)  # (fc2's restore through GELU's table)
        torch.manual_seed(0)
        m = copy.deepcopy(model)
        m(x).square().sum().backward()
        return {k: p.grad for k, p in m.named_parameters()}

    spy = Spy()
    got = grads(lambda *a: spy)
    assert calls.count("linear_backward") == 2 and calls.count("layer_norm_backward") == 1
    assert calls.count("gelu_table") == 2 and len(calls) == 5, calls
    want = grads(lambda *a: None)
    for k in want:
        assert torch.equal(got[k], want[k]), k
