"""Layers that store one packed copy between them (docs/core.md): a Linear fed by a Mesa
LayerNorm restores its input from the norm's packed x-hat, a Linear fed by a Mesa GELU from the
GELU's packed input through a table."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import mesa_ops as ms
from tests._mesa_cases import code_bytes, enable_mesa, meter_bytes, rel_err, run, scale_bytes


def _norm_linear(bits_norm=8, bits_fc=8, affine=True):
    torch.manual_seed(0)
    norm, fc = ms.LayerNorm(32, elementwise_affine=affine, quant_groups=4), ms.Linear(32, 24)
    if affine:
        with torch.no_grad():  # a non-trivial affine, so restoring x-hat * weight + bias matters
            norm.weight.uniform_(0.5, 2.0)
            norm.bias.uniform_(-1.0, 1.0)
    enable_mesa(norm, bits_norm)
    enable_mesa(fc, bits_fc)
    return nn.Sequential(norm, fc).train()


@pytest.mark.parametrize("affine", (True, False))
@pytest.mark.parametrize("batch, tokens", ((4, 50), (1, 6)))
def test_linear_after_layernorm_reuses_its_copy(affine, batch, tokens, monkeypatch):
    """A Linear fed by a Mesa LayerNorm stores nothing: it restores its input as the norm's
    packed x-hat * weight + bias. Forward bit for bit, gradients within the 8-bit bound, bytes
    those of the LayerNorm alone; with other bits the Linear stores its own copy. 200 tokens:
    the weight gradient folds the affine map in; 6 (fewer than the 24 outputs): x is restored."""
    from mesa_ops.functional import linear

    x = torch.rand(batch, tokens, 32) * 4 - 2
    mesa = _norm_linear(affine=affine)
    plain = copy.deepcopy(mesa)
    ms.policy.set_mesa(plain, False)
    restored, real = [], linear._affine
    monkeypatch.setattr(linear, "_affine", lambda *a: restored.append(a) or real(*a))
    # (the pure-PyTorch gradient math, whose branches are spied on here; the extension's
    # linear_backward takes the same ones: tests/test_native_grads.py)
    monkeypatch.setattr(linear, "native_for", lambda *a: None)
    y0, gy, g0 = run(plain, [x])
    y1, _, g1 = run(mesa, [x], gy)
    assert len(restored) == (batch * tokens < 24)  # x restored only with fewer tokens than outputs
    assert torch.equal(y1, y0)
    for k in g0:
        err = rel_err(g1[k], g0[k])
        if k.endswith("bias"):  # sums of the output gradient: exact
            assert err <= 1e-6, f"{k}: rel error {err:.3e}"
        else:  # the input and both weights use the one packed copy
            assert 1e-7 < err <= 1e-2, f"{k}: rel error {err:.3e}"
    norm, fc = mesa[0], mesa[1]
    assert float(norm.iteration) == 1 and float(fc.iteration) == 0
    rows = batch * tokens
    norm_bytes = code_bytes(rows * 32, 8) + scale_bytes(4) + 4 * rows  # x-hat, its scales, rstd
    assert meter_bytes(mesa, [x])[0] == norm_bytes
    other = _norm_linear(8, 4, affine)  # 4-bit Linear: its own 4-bit copy
    assert meter_bytes(other, [x])[0] == norm_bytes + code_bytes(rows * 32, 4) + scale_bytes(1)
    assert float(other[1].iteration) == 1


def test_linear_after_gelu_reuses_its_input_copy():
    """fc2 fed by a Mesa GELU stores nothing: it restores GELU(x) through a table of GELU at the
    levels of the GELU's packed input; the GELU's own backward reads GELU'(x) off a table too.
    Forward bit for bit, gradients within the 8-bit bound; with other bits fc2 stores its own
    copy."""
    torch.manual_seed(0)
    x = torch.rand(4, 50, 32) * 4 - 2
    for approximate in ("none", "tanh"):
        mesa = nn.Sequential(ms.Linear(32, 64), ms.GELU(approximate, quant_groups=4),
                             ms.Linear(64, 16)).train()
        plain = copy.deepcopy(mesa)
        enable_mesa(mesa, 8)
        mesa[0].enable = False  # so that x0's gradient depends on the GELU's copy only
        y0, gy, g0 = run(plain, [x])
        y1, _, g1 = run(mesa, [x], gy)
        assert torch.equal(y1, y0)
        # fc2's input is GELU(x-hat): its error is GELU'(x) times x's rounding error. Measured
        # for 2.weight, seeds 0..7: 1.12e-2..1.27e-2 (with fc2 storing its own stochastic 8-bit
        # copy instead: 0.96e-2..1.21e-2)
        for k, bound in (("x0", 1e-2), ("0.weight", 1e-2), ("2.weight", 1.5e-2)):
            err = rel_err(g1[k], g0[k])
            assert 1e-7 < err <= bound, f"{approximate} {k}: rel error {err:.3e}"
        assert float(mesa[1].iteration) == 1 and float(mesa[2].iteration) == 0
        gelu_bytes = code_bytes(4 * 50 * 64, 8) + scale_bytes(4)
        assert meter_bytes(mesa[1:], [torch.randn(4, 50, 64)])[0] == gelu_bytes
        mesa[2].bits = 4
        assert meter_bytes(mesa[1:], [torch.randn(4, 50, 64)])[0] == (gelu_bytes + code_bytes(4 * 50 * 64, 4)
                                                              + scale_bytes(1))


def test_linear_after_bf16_layernorm_far_from_zero():
    """A bf16 model (no autocast) on CPU: native_layer_norm returns bf16 statistics, whose
    rounding would shift a whole row of x-hat; the LayerNorm computes its statistics in fp32
    instead, so the Linear that reuses its copy is as accurate as with a copy of its own
    (measured: 0.013 either way; 0.117 with the bf16 statistics)."""
    torch.manual_seed(0)
    x = (torch.randn(512, 64) + 100).to(torch.bfloat16)
    mesa = nn.Sequential(ms.LayerNorm(64), ms.Linear(64, 64)).to(torch.bfloat16).train()
    plain = copy.deepcopy(mesa)
    enable_mesa(mesa, 8)
    y0, gy, g0 = run(plain, [x])
    y1, _, g1 = run(mesa, [x], gy)
    assert torch.equal(y1, y0) and float(mesa[1].iteration) == 0
    err = rel_err(g1["1.weight"], g0["1.weight"])
    assert err <= 0.03, err


class _NormTwoLinears(nn.Module):
    """One LayerNorm feeding two Linears (PVT's q and kv projections where sr_ratio = 1)."""

    def __init__(self):
        super().__init__()
        self.norm, self.q, self.kv = ms.LayerNorm(48, quant_groups=3), ms.Linear(48, 48), ms.Linear(48, 96)

    def forward(self, x):
        y = self.norm(x)
        return self.q(y).sum(-1) + self.kv(y).sum(-1)


@pytest.mark.parametrize("case", ("deit-block", "norm-two-linears", "frozen-fc1"))
def test_shared_copy_dequantized_once_for_both_backwards(case, monkeypatch):
    """The x-hat a LayerNorm shares with the Linear(s) it feeds, and the output SDPA shares with
    the projection, are dequantized once: the Linear's backward hands its restored tensor on to
    the producer's. Gradients are bit for bit those of restoring it in each backward; the count
    of dequantizations drops by one per shared copy (by none where the Linear restores nothing:
    a frozen weight)."""
    from models.deit import Block

    from mesa_ops import backend, packed, saved
    import mesa_ops.functional.attention as fa
    import mesa_ops.functional.norm as fn

    be = backend._extension_backend("cpp")
    calls = []
    deq, restore = be.dequantize_out, be.restore  # (into a given buffer; into a new tensor)
    monkeypatch.setattr(be, "dequantize_out", lambda *a: calls.append(1) or deq(*a))
    monkeypatch.setattr(be, "restore", lambda *a: calls.append(1) or restore(*a))
    monkeypatch.delenv("MESA_BACKEND", raising=False)

    def grads(share: bool):
        # (the producers hand their copies on with the item their own backward restores too:
        # without it, each backward restores its own)
        hand_on = saved.hand_on if share else (
            lambda ctx, y, q, out_packed, record=None, quant=None, share_item=None:
            saved.hand_on(ctx, y, q, out_packed, record, quant))
        monkeypatch.setattr(fn, "hand_on", hand_on)
        monkeypatch.setattr(fa, "hand_on", hand_on)
        torch.manual_seed(0)
        if case == "norm-two-linears":
            model, x = _NormTwoLinears(), torch.randn(2, 9, 48)
        else:
            model, x = Block(48, 3, qkv_bias=True), torch.randn(2, 9, 48)
            if case == "frozen-fc1":
                model.mlp.fc1.weight.requires_grad_(False)
        enable_mesa(model, 8)
        calls.clear()
        torch.manual_seed(1)
        _, _, g = run(model.train(), [x])
        return g, len(calls)

    g_share, n_share = grads(True)
    g_each, n_each = grads(False)
    assert g_share.keys() == g_each.keys()
    for k in g_each:
        if g_each[k] is not None:
            assert torch.equal(g_share[k], g_each[k]), k
    # shared copies: DeiT block x-hat of norm1 (qkv), SDPA output (proj), x-hat of norm2 (fc1);
    # two Linears on one norm: q and kv read the one restore; frozen fc1 restores nothing
    fewer = {"deit-block": 3, "norm-two-linears": 2, "frozen-fc1": 2}[case]
    assert n_each - n_share == fewer, (n_each, n_share)


def test_levels_made_once_per_backward_for_the_same_arguments(monkeypatch):
    """packed.levels in a backward keeps its result on ``step``: a second call with the same
    step, shift, bits and dtype (a GELU's backward after the next Linear's) returns it without
    a kernel call; another dtype, another shift or a shift modified in place since gives new
    levels; outside a backward nothing is kept."""
    from mesa_ops import packed

    step, shift = torch.tensor([0.1, 0.2]), torch.tensor([-1.0, 0.5])
    first = packed.levels(step, shift, 8, torch.float32)
    assert packed.levels(step, shift, 8, torch.float32) is not first  # (not in a backward)
    monkeypatch.setattr(packed, "_graph_task_id", lambda: 7)  # (as in a backward)
    lv = packed.levels(step, shift, 8, torch.float32)
    assert torch.equal(lv, first) and packed.levels(step, shift, 8, torch.float32) is lv
    assert packed.levels(step, shift, 8, torch.float64) is not lv
    assert packed.levels(step, shift.clone(), 8, torch.float32) is not lv
    lv = packed.levels(step, shift, 8, torch.float32)
    shift.add_(1.0)
    again = packed.levels(step, shift, 8, torch.float32)
    assert again is not lv and torch.allclose(again, lv + 1.0)
