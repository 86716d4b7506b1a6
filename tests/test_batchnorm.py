"""Issue 35 item 1: a Mesa batch norm stores x-hat (each channel normalized by its batch
statistics), so channels of very different scales keep their gradients: before, one range over
all channels stored the narrow ones as a few levels and backward divided that error by their std
(Conv2d(3, 8) -> BatchNorm2d(8) -> ReLU, output channels scaled by logspace(-2, 1): relative
gradient error 2.1 on the BN weight, 0.87 on the conv weight)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import mesa_ops as ms


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _conv_bn_relu(lo: float, hi: float) -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
    with torch.no_grad():
        scale = torch.logspace(lo, hi, 8)
        net[0].weight.mul_(scale.view(-1, 1, 1, 1))
        net[0].bias.mul_(scale)
    return net


@pytest.mark.parametrize("lo,hi", [(-2, 1), (-3, 3)], ids=["1e-2..1e1", "1e-3..1e3"])
def test_conv_bn_relu_gradients_within_2_percent(lo, hi):
    net = _conv_bn_relu(lo, hi)
    ref = copy.deepcopy(net)
    mesa = ms.compress(copy.deepcopy(net), "mesa8")
    assert isinstance(mesa[1], ms.BatchNorm2d) and mesa[1].enable
    x = torch.randn(4, 3, 16, 16)
    g = torch.randn(4, 8, 16, 16)
    (ref(x) * g).sum().backward()
    for seed in range(3):
        mesa.zero_grad()
        torch.manual_seed(seed)
        y = mesa(x)
        assert torch.equal(y, ref(x))  # the forward is exact
        (y * g).sum().backward()
        # (the conv's bias has no gradient through a batch norm but rounding: not compared)
        for i, name in ((1, "weight"), (1, "bias"), (0, "weight")):
            err = _rel(getattr(mesa[i], name).grad, getattr(ref[i], name).grad)
            assert err < 0.02, (seed, i, name, err)


@pytest.mark.parametrize("groups", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batchnorm_stores_xhat_at_one_scale(groups, dtype):
    """What is stored restores to x-hat = (x - mean_c) * invstd_c (float32) within one 8-bit step
    of x-hat's range, whatever each channel's scale (1e-3 to 1e3)."""
    torch.manual_seed(1)
    bn = ms.BatchNorm2d(8, quant_groups=groups).train()
    ms.policy.set_mesa(bn, True, 8)
    x = (torch.randn(2, 8, 5, 5) * torch.logspace(-3, 3, 8).view(1, -1, 1, 1)).to(dtype)
    xf = x.float()
    mean = xf.mean((0, 2, 3), keepdim=True)
    invstd = torch.rsqrt(xf.var((0, 2, 3), unbiased=False, keepdim=True) + bn.eps)
    xhat = (xf - mean) * invstd
    restored = bn.quantize(x, False, norm=(mean, invstd)).dequantize()
    assert restored.dtype == torch.float32 and restored.shape == x.shape
    step = float((xhat.max() - xhat.min()) / 255)
    assert float((restored - xhat).abs().max()) <= step * 1.001


def test_layernorm_rows_still_fuse_and_batchnorm_channels_do_not():
    """The one-call kernel normalizes rows (a LayerNorm's (..., 1) statistics), never a batch
    norm's (1, C, 1, 1) channels broadcast over the batch (it would take C contiguous chunks of
    x for channels); with batch 1 those chunks are the channels."""
    q = ms.LayerNorm(16)
    x = torch.randn(2, 8, 4, 4)
    assert q.group_dim == "last"
    assert q._fuses_norm(x.reshape(16, 16), torch.zeros(16, 1), 16)
    assert q._fuses_norm(x, torch.zeros(2, 8, 1, 1), 16)
    assert not q._fuses_norm(x, torch.zeros(1, 8, 1, 1), 16)
    assert q._fuses_norm(x[:1], torch.zeros(1, 8, 1, 1), 16)
