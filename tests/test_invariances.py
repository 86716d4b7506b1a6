"""Issue 49, item 3: backward keeps exact's invariances. A restored x-hat is centred per channel
(batch norm) / per row (LayerNorm) as exact's is, a restored softmax row sums to one, so a
parameter the exact model is invariant to gets exact's gradient (zero up to rounding) instead of
the packing error's projection; the fused ms.SDPA's dK sums to zero over the keys, as exact's
does. Constructed cases, 8 and 4 bits. Measured before: a shift before
a batch norm 5.8e-3 (8 bits) / 0.21 (4 bits), before a LayerNorm 5.2e-2 / 0.35, a key bias 0.23 /
5.6 (explicit), 0.21 (fused SDPA, 8 bits); now 4e-7 - 6e-6, as exact's 1e-6 - 1e-5."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import mesa_ops as ms


def _on(module, bits):
    ms.policy.set_mesa(module, True, bits)
    return module.train()


class ShiftScaleBN(nn.Module):
    """x (B, C, H, W) + shift (a bias before the norm) times scale (per channel), batch norm."""

    def __init__(self, c=8):
        super().__init__()
        self.shift = nn.Parameter(torch.randn(1, c, 1, 1))
        self.scale = nn.Parameter(torch.rand(1, c, 1, 1) + 0.5)
        self.bn = ms.BatchNorm2d(c)

    def forward(self, x):
        return self.bn((x + self.shift) * self.scale)


class ShiftLN(nn.Module):
    """x (B, N, C) + a per-row constant (a shift LayerNorm is invariant to), LayerNorm."""

    def __init__(self, c=32):
        super().__init__()
        self.shift = nn.Parameter(torch.randn(()))
        self.ln = ms.LayerNorm(c)

    def forward(self, x):
        return self.ln(x + self.shift)


class KeyBias(nn.Module):
    """softmax(q (k + b_k)^T) v through ms.MatMul / ms.Softmax: the key bias adds q . b_k to a
    whole row of logits, to which softmax is invariant."""

    def __init__(self, d=16):
        super().__init__()
        self.bk = nn.Parameter(torch.randn(d))
        self.mm1, self.sm, self.mm2 = ms.MatMul(quant_groups=2), ms.Softmax(-1, quant_groups=2), ms.MatMul(quant_groups=2)

    def forward(self, q, k, v):
        return self.mm2(self.sm(self.mm1(q, (k + self.bk).transpose(-2, -1))), v)


class KeyBiasSDPA(nn.Module):
    """The same through the fused ms.SDPA (q, k, v packed; at 8 bits its backward uses the
    forward's logsumexp with the stored tensors): dK is projected back onto exact's identity
    (it sums to zero over the keys)."""

    def __init__(self, d=16):
        super().__init__()
        self.bk = nn.Parameter(torch.randn(d))
        self.sdpa = ms.SDPA(quant_groups=2)

    def forward(self, q, k, v):
        return self.sdpa(q, k + self.bk, v)


def _grads(model, inputs, g_seed=1):
    model.zero_grad()
    y = model(*inputs)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(g_seed)))
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("bits", (8, 4))
def test_invariant_parameters_get_exact_zero_gradient(bits):
    torch.manual_seed(0)
    cases = [(ShiftScaleBN(), (torch.randn(4, 8, 6, 6) * 3,), ("shift",)),
             (ShiftLN(), (torch.randn(4, 10, 32) * 2 + 1,), ("shift",)),
             (KeyBias(), tuple(torch.randn(2, 2, 12, 16) for _ in range(3)), ("bk",)),
             (KeyBiasSDPA(), tuple(torch.randn(2, 2, 12, 16) for _ in range(3)), ("bk",))]
    for model, inputs, names in cases:
        exact = _grads(model.train(), inputs)
        mesa = _grads(_on(model, bits), inputs)
        for n in names:
            # exact: zero up to rounding (and eps, for the scale before a batch norm)
            scale = float(exact[n].norm()) + 1e-6 * float(sum(g.norm() for g in exact.values()))
            assert float(mesa[n].norm()) <= 10 * scale, (type(model).__name__, n, mesa[n], exact[n])
        ms.policy.set_mesa(model, False)


def test_scale_before_batch_norm_gets_only_the_packing_noise():
    """A per-channel scale before a batch norm: its gradient sum(g_z * x) is zero in exact
    arithmetic, but that needs g_z orthogonal to the true input, which Mesa does not store: what
    is left is the packing error's projection (measured 0.28 against the batch norm weight's 34
    at 8 bits, as before centring; renormalising x-hat's scale as well did not change it)."""
    torch.manual_seed(0)
    model, x = ShiftScaleBN(), torch.randn(4, 8, 6, 6) * 3
    exact = _grads(model.train(), (x,))
    mesa = _grads(_on(model, 8), (x,))
    assert float(exact["scale"].norm()) < 1e-4
    assert float(mesa["scale"].norm()) < 0.02 * float(exact["bn.weight"].norm())


def test_centred_gradients_stay_close_to_exact():
    """Centring moves x-hat by the packing error only: every other gradient stays
    within the 8-bit bound (a Linear after the norms, the weights of the norms)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 16))
    ms.policy.convert_by_num_groups(net, 1)
    x = torch.randn(8, 20, 32)
    exact = _grads(net.train(), (x,))
    mesa = _grads(_on(net, 8), (x,))
    for n, g in exact.items():
        assert float((mesa[n] - g).norm() / g.norm()) < 0.02, n


def test_segformer_decode_head_biases_before_batch_norm():
    """A real model: transformers' Segformer decode head projects each stage with a biased
    Linear, concatenates, then a bias-free conv and a batch norm, which is invariant to those
    biases. Before: their gradients 2.8e-2 - 2.9e-2 under Mesa against 2.2e-5 - 2.4e-5 exact;
    now within 10x of exact's (measured 1.5e-5)."""
    T = pytest.importorskip("transformers")
    import copy

    torch.manual_seed(0)
    cfg = T.SegformerConfig(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[4, 2], hidden_sizes=[16, 32],
                            num_attention_heads=[1, 2], decoder_hidden_size=32, num_labels=5,
                            patch_sizes=[7, 3], strides=[4, 2], mlp_ratios=[2, 2])
    ref = T.SegformerForSemanticSegmentation(cfg).train()
    mesa = ms.compress(copy.deepcopy(ref), "mesa8", warn=False).train()
    x = torch.randn(4, 3, 64, 64)
    grads = []
    for model in (ref, mesa):
        torch.manual_seed(1)  # (the same dropout masks)
        out = model(x).logits
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(2))).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    names = [n for n in grads[0] if "linear_projections" in n and n.endswith("bias")]
    assert len(names) == 2
    for n in names:
        assert float(grads[0][n].norm()) < 1e-4 and float(grads[1][n].norm()) < 10 * float(grads[0][n].norm()), n


def test_restored_rows_of_zeros_give_zero_gradient_not_nan():
    """A softmax row whose restored values are all 0 (2 bits, a masked-out query) is left as it
    is by the renormalisation: finite gradients."""
    torch.manual_seed(0)
    sm = ms.Softmax(-1, quant_groups=1)
    ms.policy.set_mesa(sm, True, 2)
    x = torch.randn(4, 64, 197)
    x[:, :, 100:] = float("-inf")
    x.requires_grad_()
    y = sm.train()(x)
    y.backward(torch.randn_like(y))
    assert torch.isfinite(x.grad).all()


def test_masked_keys_keep_exact_zero_gradient():
    """The fused SDPA's dK is centred over the keys some query attends: a key every query masks
    out keeps exact's zero gradient (nn.MultiheadAttention, cross attention, padded keys)."""
    import copy

    torch.manual_seed(0)
    ref = nn.MultiheadAttention(32, 4, batch_first=True).train()
    mesa = ms.compress(copy.deepcopy(ref), "mesa8", warn=False).train()
    q = torch.randn(2, 9, 32)
    pad = torch.zeros(2, 12, dtype=torch.bool)
    pad[:, 6:] = True
    grads = []
    for model in (ref, mesa):
        kv = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(1)).requires_grad_()
        y, _ = model(q, kv, kv, key_padding_mask=pad, need_weights=False)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(2)))
        grads.append(kv.grad)
    assert float(grads[0][:, 6:].abs().max()) == 0.0 and float(grads[1][:, 6:].abs().max()) == 0.0
    assert float((grads[1] - grads[0]).norm() / grads[0].norm()) < 0.03
