"""Saved-activation accounting (mesa_ops.memory.SavedActivationMeter) and the memory Mesa saves on
a DeiT-style block (dim 192, 3 heads, 197 tokens, mlp ratio 4, batch 8)."""
import pytest
import torch
import torch.nn as nn

import mesa_ops as ms

B, N, C, H = 8, 197, 192, 3


class DeiTBlock(nn.Module):
    """A pre-norm ViT block with explicit attention built from Mesa layers."""

    def __init__(self, dim=C, heads=H, mlp_ratio=4, groups=H):
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.norm1 = ms.LayerNorm(dim, quant_groups=groups)
        self.qkv = ms.Linear(dim, 3 * dim, quant_groups=groups)
        self.qk = ms.MatMul(quant_groups=heads)
        self.softmax = ms.Softmax(dim=-1, quant_groups=heads)
        self.av = ms.MatMul(quant_groups=heads)
        self.proj = ms.Linear(dim, dim, quant_groups=groups)
        self.norm2 = ms.LayerNorm(dim, quant_groups=groups)
        self.fc1 = ms.Linear(dim, mlp_ratio * dim, quant_groups=groups)
        self.act = ms.GELU(quant_groups=groups)
        self.fc2 = ms.Linear(mlp_ratio * dim, dim, quant_groups=groups)

    def forward(self, x):
        b, n, c = x.shape
        qkv = self.qkv(self.norm1(x)).reshape(b, n, 3, self.heads, c // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (B, H, N, D)
        attn = self.softmax(self.qk(q * self.scale, k.transpose(-2, -1)))
        y = self.av(attn, v).transpose(1, 2).reshape(b, n, c)
        x = x + self.proj(y)
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))


def _measure(model, x, autocast=False):
    with ms.SavedActivationMeter(model) as meter:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(x)
    out.float().sum().backward()  # the graph is usable (and freed)
    return meter


@pytest.fixture(scope="module")
def block_and_input():
    torch.manual_seed(0)
    return DeiTBlock().train(), torch.randn(B, N, C, requires_grad=True)


def _ratios(model, x, autocast):
    ms.policy.set_mesa(model, enable=False)
    exact = _measure(model, x, autocast)
    out = {"exact": exact}
    for bits in (8, 4, 2):
        ms.policy.set_mesa(model, enable=True, bits=bits)
        out[bits] = _measure(model, x, autocast)
    ms.policy.set_mesa(model, enable=False)
    return out


def test_deit_block_fp32_ratios(block_and_input):
    model, x = block_and_input
    m = _ratios(model, x, autocast=False)
    e = m["exact"].total_bytes
    r = {b: m[b].total_bytes / e for b in (8, 4, 2)}
    print(f"\nDeiT block fp32: exact {e} B; ratios 8-bit {r[8]:.4f} 4-bit {r[4]:.4f} "
          f"2-bit {r[2]:.4f}")
    assert r[8] <= 0.27
    assert r[4] <= 0.15
    assert r[2] < r[4] < r[8]


def test_deit_block_bf16_autocast_ratio(block_and_input):
    model, x = block_and_input
    m = _ratios(model, x, autocast=True)
    e = m["exact"].total_bytes
    r = {b: m[b].total_bytes / e for b in (8, 4, 2)}
    print(f"\nDeiT block bf16 autocast: exact {e} B; ratios 8-bit {r[8]:.4f} 4-bit {r[4]:.4f} "
          f"2-bit {r[2]:.4f}")
    assert r[8] <= 0.5
    assert r[4] < r[8]
    # autocast saves bf16 activations: less than the fp32 exact block
    ms.policy.set_mesa(model, enable=False)
    assert e < _measure(model, x, autocast=False).total_bytes


def test_by_type_breakdown(block_and_input):
    model, x = block_and_input
    m = _ratios(model, x, autocast=False)
    names = {type(mod).__name__ for mod in model.modules() if mod is not model}
    for key in ("exact", 8, 4):
        bt = m[key].by_type
        assert set(bt) <= names, bt
        assert {"Linear", "LayerNorm", "GELU", "Softmax", "MatMul"} <= set(bt)
        assert sum(bt.values()) == m[key].total_bytes
        assert all(v > 0 for v in bt.values())
    ex = m["exact"].by_type
    bnc = B * N * C
    # exact fp32: the 4 Linears save their inputs (C, C, C, 4C channels), GELU its input,
    # Softmax its output
    assert ex["Linear"] == 7 * bnc * 4
    assert ex["GELU"] == 4 * bnc * 4
    assert ex["Softmax"] == B * H * N * N * 4
    for bits in (8, 4):
        q = m[bits].by_type
        small = 4096  # slack for the per-group fp32 step and shift
        # the Linears fed by a LayerNorm (qkv, fc1) reuse its packed x-hat and fc2 the GELU's
        # packed input: only proj (C channels) stores its input
        assert bnc * bits // 8 <= q["Linear"] <= bnc * bits // 8 + small
        assert 4 * bnc * bits // 8 <= q["GELU"] <= 4 * bnc * bits // 8 + small
        assert B * H * N * N * bits // 8 <= q["Softmax"] <= B * H * N * N * bits // 8 + small
        # MatMul stores q, k and v packed; attn (the softmax output) is not stored twice
        assert q["MatMul"] <= 3 * bnc * bits // 8 + small
        # LayerNorm: packed x-hat plus fp32 rstd per token
        assert 2 * bnc * bits // 8 <= q["LayerNorm"] <= 2 * (bnc * bits // 8 + B * N * 4) + small


def test_parameters_excluded_lone_linear():
    torch.manual_seed(0)
    lin = nn.Linear(512, 512)  # a 1 MiB weight, which autograd saves for grad_input
    x = torch.randn(4, 512, requires_grad=True)
    with ms.SavedActivationMeter(lin) as meter:
        y = lin(x)
    assert meter.total_bytes == x.numel() * 4  # only x, not the weight
    assert meter.by_type == {"Linear": x.numel() * 4}
    y.sum().backward()
    # an excluded tensor is not counted either
    with ms.SavedActivationMeter(lin, exclude=[x]) as meter:
        lin(x)
    assert meter.total_bytes == 0
    # without the model, the parameters count: the weight is saved
    with ms.SavedActivationMeter() as meter:
        lin(x)
    assert meter.total_bytes >= lin.weight.numel() * 4 + x.numel() * 4


def test_mesa_linear_saves_packed_bytes():
    torch.manual_seed(0)
    lin = ms.Linear(512, 512, quant_groups=4, enable=True)
    x = torch.randn(4, 512, requires_grad=True)
    for bits in (8, 4, 2):
        lin.bits = bits
        with ms.SavedActivationMeter(lin) as meter:
            y = lin(x)
        # packed codes + per-group fp32 step and shift (a few floats per group); neither x
        # (8 KiB) nor the weight (1 MiB)
        packed = x.numel() * bits // 8
        assert packed + 2 * 4 * 4 <= meter.total_bytes <= packed + 16 * 4 * 4
        y.sum().backward()


def test_meter_removes_hooks_and_shared_storage_counted_once():
    lin = nn.Linear(8, 8)
    x = torch.randn(3, 8, requires_grad=True)
    with ms.SavedActivationMeter(lin) as meter:
        a = lin(x)
        b = lin(x)  # x saved twice: one storage
    assert meter.total_bytes == x.numel() * 4
    assert not lin._forward_hooks and not lin._forward_pre_hooks
    (a + b).sum().backward()


def test_saved_activation_bytes_helper():
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    x = torch.randn(5, 16)
    meter = ms.saved_activation_bytes(model, x)
    # both Linears save their inputs (for the weight gradient), GELU its input
    assert meter.by_type == {"Linear": 5 * 16 * 4 + 5 * 32 * 4, "GELU": 5 * 32 * 4}
    assert meter.total_bytes == 5 * 16 * 4 + 2 * 5 * 32 * 4


def test_meter_counts_autocast_weight_casts_apart():
    """Issue 35 item 5: under autocast each weight's low-precision copy (autocast's cache, saved by
    the linear transposed) is not an activation: counted in weight_cast_bytes, not total_bytes."""
    lin = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)).train()
    x = torch.randn(4, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), ms.SavedActivationMeter(lin) as meter:
        lin(x).float().sum()
    assert meter.total_bytes == (4 * 64 + 4 * 256) * 2  # the two linears' bf16 inputs
    assert meter.weight_cast_bytes == 2 * 64 * 256 * 2  # the two bf16 weights
    assert meter.by_type == {"Linear": meter.total_bytes}
    with ms.SavedActivationMeter(lin) as fp32:  # no autocast: no casts
        lin(x).sum()
    assert fp32.weight_cast_bytes == 0 and fp32.total_bytes == (4 * 64 + 4 * 256) * 4


def test_small_saved_tensors_equal_to_a_parameter_stay_activations():
    """A parameter's copy in another layout counts as a weight copy (inductor saves one), but a
    saved tensor that merely equals a parameter (the ReLU mask's step and shift, (1,) ones and
    zeros, beside (1,) parameters initialised to one and zero) is an activation."""
    class Net(nn.Module):
        def __init__(self, extra: bool):
            super().__init__()
            self.relu = ms.ReLU(mesa=True)
            if extra:
                self.zero = nn.Parameter(torch.zeros(1))
                self.one = nn.Parameter(torch.ones(1))

        def forward(self, x):
            return self.relu(x)

    x = torch.randn(4, 32, requires_grad=True)
    totals = []
    for extra in (False, True):
        net = Net(extra)
        with ms.SavedActivationMeter(net) as meter:
            net(x)
        totals.append((meter.total_bytes, meter.weight_cast_bytes))
    assert totals[0] == totals[1] and totals[0][1] == 0 and totals[0][0] >= 8
