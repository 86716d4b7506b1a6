"""Mesa layers under autocast (bfloat16 and float16), compression on at 8 bits.

* forward output bit-identical to the plain nn layer under the same autocast, same dtype (Mesa's
  Functions run with autocast off and cast by hand to the dtype autocast would have used);
* gradients: same dtypes as plain autograd under autocast; relative error vs plain autograd
  under the same autocast <= 2e-2 for the gradients that use the saved activation (measured on
  CPU, max over layers: bf16 9.6e-3 (LayerNorm weight, bf16 input), fp16 5.7e-3), exact
  (<= 1e-6, measured 0) for the others; and vs float64 autograd without autocast within
  3e-2 (bf16) / 1.5e-2 (fp16) (measured max 1.3e-2, LayerNorm weight with bf16 input /
  5.7e-3, MatMul a);
* quantizer state stays float32; Softmax -> MatMul still stores the attention map once;
* the same on CUDA (marked cuda, skipped without a GPU).
"""
from __future__ import annotations

import copy

import pytest
import torch

import mesa_ops as ms

from tests._mesa_cases import NAMES, inputs, make_pair, rel_err, run
from tests.test_layers import QUANTIZED_GRADS, _Attention

AMP_DTYPES = (torch.bfloat16, torch.float16)
VS_AUTOCAST = 2e-2
VS_FP64 = {torch.bfloat16: 3e-2, torch.float16: 1.5e-2}


def _ids(d):
    return str(d).replace("torch.", "")


def _check_layer(name, amp_dtype, in_dtype, device):
    plain, mesa, shapes = make_pair(name)
    plain.to(device)
    mesa.to(device)
    ms.policy.set_mesa(mesa, True, 8)
    exact = copy.deepcopy(plain).double()
    xs = inputs(shapes, "uniform", in_dtype, device)
    with torch.autocast(device, dtype=amp_dtype):
        y0, gy, g0 = run(plain, xs)
        y1, _, g1 = run(mesa, xs, gy)
    assert y1.dtype == y0.dtype, f"{name}: {y1.dtype} vs {y0.dtype}"
    assert torch.equal(y1, y0), f"{name}: forward under autocast differs from nn"
    assert type(y1.grad_fn).__module__ == "torch.autograd.function", "compression not engaged"
    _, _, g64 = run(exact, [x.double() for x in xs], gy.double())
    for k in g0:
        assert g1[k].dtype == g0[k].dtype and g1[k].shape == g0[k].shape, k
        err = rel_err(g1[k], g0[k])
        if k in QUANTIZED_GRADS[name]:
            assert err <= VS_AUTOCAST, f"{name} grad {k}: {err:.3e} vs autocast autograd"
        else:
            assert err <= 1e-6, f"{name} grad {k} should not depend on the saved copy: {err:.3e}"
        err64 = rel_err(g1[k], g64[k])
        assert err64 <= VS_FP64[amp_dtype], f"{name} grad {k}: {err64:.3e} vs float64 autograd"
    for m in mesa.modules():
        if isinstance(m, ms.QuantMixin):
            assert m.clip_val.dtype == torch.float32 and m.shift.dtype == torch.float32


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("input_dtype", ("float32", "amp"))
@pytest.mark.parametrize("amp_dtype", AMP_DTYPES, ids=_ids)
def test_autocast_cpu(name, amp_dtype, input_dtype):
    in_dtype = torch.float32 if input_dtype == "float32" else amp_dtype
    _check_layer(name, amp_dtype, in_dtype, "cpu")


def _check_attention(amp_dtype, device):
    x, v = inputs([(2, 4, 16, 16), (2, 4, 16, 8)], device=device)
    att = _Attention().to(device)
    xa, va = x.clone().requires_grad_(), v.clone().requires_grad_()
    xb, vb = x.clone().requires_grad_(), v.clone().requires_grad_()
    with torch.autocast(device, dtype=amp_dtype):
        y0 = torch.softmax(xa, -1) @ va
        with ms.SavedActivationMeter(att) as meter:
            y1 = att(xb, vb)
    assert y1.dtype == y0.dtype and torch.equal(y1, y0)
    # one 8-bit copy of the (B, H, N, N) map and one of v, plus per-group scales (<= 16 B each)
    assert 2048 + 1024 < meter.total_bytes <= 2048 + 1024 + 32
    assert float(att.mm.quant1.iteration) == 0  # MatMul reused the Softmax's copy
    gy = torch.randn(y0.shape, device=device).to(y0.dtype)
    y0.backward(gy)
    y1.backward(gy)
    assert rel_err(xb.grad, xa.grad) <= VS_AUTOCAST and rel_err(vb.grad, va.grad) <= VS_AUTOCAST


@pytest.mark.parametrize("amp_dtype", AMP_DTYPES, ids=_ids)
def test_autocast_attention_cpu(amp_dtype):
    _check_attention(amp_dtype, "cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("input_dtype", ("float32", "amp"))
@pytest.mark.parametrize("amp_dtype", AMP_DTYPES, ids=_ids)
def test_autocast_cuda(name, amp_dtype, input_dtype):
    in_dtype = torch.float32 if input_dtype == "float32" else amp_dtype
    _check_layer(name, amp_dtype, in_dtype, "cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("amp_dtype", AMP_DTYPES, ids=_ids)
def test_autocast_attention_cuda(amp_dtype):
    _check_attention(amp_dtype, "cuda")
