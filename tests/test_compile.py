"""torch.compile of Mesa models (issue 10 item 4): the kernels are ``torch.library`` custom ops
(``mesa::range_update``, ``mesa::quantize``, ``mesa::dequantize``) with fake implementations, so
a Mesa model compiles into one graph, and the bytes saved for backward, the gradients and the
quantizer state equal eager mode."""
from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo as dynamo
from torch import nn

import mesa_ops as ms
from mesa_ops.blocks import Block


class _Net(nn.Module):
    """Every Mesa layer kind: conv -> BN -> ReLU maps, then a Transformer block on the tokens."""

    def __init__(self):
        super().__init__()
        self.conv = ms.Conv2d(3, 24, 2, stride=2, quant_groups=3)
        self.bn = ms.BatchNorm2d(24, quant_groups=3)
        self.relu = ms.ReLU()
        self.block = Block(24, 3, 2.0)

    def forward(self, x):
        x = self.relu(self.bn(self.conv(x)))
        return self.block(x.flatten(2).transpose(1, 2))


def _model():
    torch.manual_seed(0)
    m = _Net().train()
    ms.policy.set_mesa(m, True, 8)
    return m


def _steps(model, fn, x, steps=2):
    """A first step compiles (the meter's saved-tensor hooks must not be active while dynamo
    traces: they would be traced too); the next ``steps`` are measured."""
    torch.manual_seed(9)
    fn(x).sum().backward()
    out = []
    for s in range(steps):
        torch.manual_seed(10 + s)
        model.zero_grad()
        with ms.SavedActivationMeter(model) as meter:
            y = fn(x)
        y.square().sum().backward()
        out.append((meter.total_bytes, [p.grad.clone() for p in model.parameters()],
                    [b.clone() for b in model.buffers()], y.detach()))
    return out


def _compare(eager, compiled, exact: bool):
    for (be, ge, se, ye), (bc, gc, sc, yc) in zip(eager, compiled):
        if exact:
            assert bc == be
        else:  # inductor may keep other small tensors (its own partitioning)
            assert abs(bc - be) <= 0.1 * be, (bc, be)
        for a, b in zip(ge + se + [ye], gc + sc + [yc]):
            if exact:
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def test_compiles_in_one_graph_with_eager_bytes_gradients_and_state():
    x = torch.randn(2, 3, 8, 8)
    eager_model = _model()
    compiled_model = copy.deepcopy(eager_model)
    eager = _steps(eager_model, eager_model, x)
    dynamo.reset()
    dynamo.utils.counters.clear()
    fn = torch.compile(compiled_model, backend="aot_eager", fullgraph=True)
    compiled = _steps(compiled_model, fn, x)
    assert not dynamo.utils.counters["graph_break"]
    assert dynamo.utils.counters["stats"]["unique_graphs"] == 1  # no recompilation on step 2
    _compare(eager, compiled, exact=True)
    blk = compiled_model.block
    assert float(blk.attn.proj.iteration) == 3 and float(blk.norm2.iteration) == 3
    # fc1 reused norm2's packed x-hat and fc2 the GELU's packed input, also when compiled
    assert float(blk.fc1.iteration) == 0 and float(blk.fc2.iteration) == 0


def test_custom_ops_registered_with_fake_implementations():
    x = torch.randn(4, 6)
    clip, shift, it = torch.ones(3), torch.zeros(3), torch.zeros(1)
    params = torch.ops.mesa.range_update(x, clip, shift, it, 3, 2, 0.9, False, 4, True, "raise", "t", False)
    draws = torch.zeros(1, dtype=torch.int64)
    packed = torch.ops.mesa.quantize(x, params[0], params[2], draws, "t", 4, 3, 2, True, True)
    assert packed.shape == (12,) and packed.dtype == torch.uint8 and int(draws) == 1
    back = torch.ops.mesa.dequantize(packed, params[1], params[2], 4, 3, 2, 24, torch.float32)
    assert (back.view(4, 6) - x).abs().max() <= float(params[1].max()) + 1e-6
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fx = mode.from_tensor(x)
        fp = torch.ops.mesa.range_update(fx, mode.from_tensor(clip), mode.from_tensor(shift),
                                         mode.from_tensor(it), 3, 2, 0.9, False, 8, True, "raise", "t", False)
        fq = torch.ops.mesa.quantize(fx, fp[0], fp[2], mode.from_tensor(draws), "t", 2, 3, 2, True, True)
        fd = torch.ops.mesa.dequantize(fq, fp[1], fp[2], 2, 3, 2, 24, torch.bfloat16)
    assert fp.shape == (4, 3) and fq.shape == (6,) and fd.shape == (24,) and fd.dtype == torch.bfloat16


@pytest.mark.slow
def test_inductor_matches_eager():
    """Inductor (CPU, gcc): one graph; bytes within 10% and gradients within 1e-4 of eager (it
    fuses and partitions the graph its own way)."""
    x = torch.randn(2, 3, 8, 8)
    eager_model = _model()
    compiled_model = copy.deepcopy(eager_model)
    eager = _steps(eager_model, eager_model, x)
    dynamo.reset()
    fn = torch.compile(compiled_model, fullgraph=True)
    _compare(eager, _steps(compiled_model, fn, x), exact=False)


def test_deit_keeps_shared_copies_under_compile():
    """Issue 22.6: a DeiT block (fused Mesa SDPA, Mlp with p=0 dropout) compiles in one graph and
    keeps its shared copies: attn.proj adopts the SDPA output's packed copy and mlp.fc2 the
    GELU's packed input, as in eager mode, so the saved bytes and gradients equal eager's (before:
    a graph break at the SDPA backend choice; proj and fc2 stored their own inputs, 54360 bytes
    vs 46632 here). The meter takes no module hooks (dynamo would trace them)."""
    import models

    torch.manual_seed(0)
    eager_model = models.create_model("deit_tiny_patch16_224", img_size=32, depth=1, ms_policy="mesa8",
                                      drop_path_rate=0.0).train()
    compiled_model = copy.deepcopy(eager_model)
    x = torch.randn(2, 3, 32, 32)

    def step(model, fn):
        torch.manual_seed(9)
        fn(x).sum().backward()
        torch.manual_seed(10)
        model.zero_grad()
        with ms.SavedActivationMeter(exclude=list(model.parameters()) + list(model.buffers())) as m:
            y = fn(x)
        y.square().sum().backward()
        return m.total_bytes, [p.grad.clone() for p in model.parameters()]

    be, ge = step(eager_model, eager_model)
    dynamo.reset()
    dynamo.utils.counters.clear()
    bc, gc = step(compiled_model, torch.compile(compiled_model, backend="aot_eager", fullgraph=True))
    assert not dynamo.utils.counters["graph_break"]
    assert bc == be
    assert all(torch.equal(a, b) for a, b in zip(ge, gc))
    blk = compiled_model.blocks[0]
    assert float(blk.attn.proj.iteration) == 0 and float(blk.mlp.fc2.iteration) == 0
    assert float(blk.attn.qkv.iteration) == 0 and float(blk.mlp.fc1.iteration) == 0  # (norms' x-hat)
