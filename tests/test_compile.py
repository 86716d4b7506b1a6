"""torch.compile of Mesa models (issues 10 and 48): the kernels are torch ops with fake
implementations -- ``mesa::quantize_step`` and ``mesa::unpack`` with C++ kernels (cuda/torch_ops.h),
``mesa::range_update`` / ``mesa::quantize`` (Python custom ops, for a range all-reduced across
ranks) -- so a Mesa model compiles into one graph, and the bytes saved for backward, the
gradients and the quantizer state equal eager mode."""
from __future__ import annotations

import copy
import sys

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
        if exact:  # (the ReLU mask's step and shift, a float each, are constants (ones / zeros) that
            # the compiled backward may make again instead of saving them)
            assert 0 <= be - bc <= 8, (bc, be)
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
    # the compiled steps run Mesa's kernels as C++ kernels of native ops: no Python frame of theirs
    python_kernels = {"_quantize_step_fallback", "_unpack_fallback", "_pack_fallback", "_lut_apply_fallback",
                      "_range_update_impl", "_quantize_impl", "_dequantize_impl", "lut_apply", "unpack_codes"}
    seen = []

    def prof(frame, event, arg):
        if event == "call" and frame.f_code.co_name in python_kernels:
            seen.append(frame.f_code.co_name)

    sys.setprofile(prof)
    try:
        fn(x).square().sum().backward()
    finally:
        sys.setprofile(None)
    assert not seen, seen
    assert not dynamo.utils.counters["graph_break"]
    assert dynamo.utils.counters["stats"]["unique_graphs"] == 1  # no recompilation on step 2
    _compare(eager, compiled, exact=True)
    blk = compiled_model.block
    assert float(blk.attn.proj.iteration) == 4 and float(blk.norm2.iteration) == 4
    # fc1 reused norm2's packed x-hat and fc2 the GELU's packed input, also when compiled
    assert float(blk.fc1.iteration) == 0 and float(blk.fc2.iteration) == 0


def test_custom_ops_registered_with_fake_implementations():
    x = torch.randn(4, 6)
    clip, shift, it = torch.ones(3), torch.zeros(3), torch.zeros(1)
    params = torch.ops.mesa.range_update(x, clip, shift, it, 3, 2, 0.9, False, 4, True, "raise", "t", False)
    draws = torch.zeros(1, dtype=torch.int64)
    packed = torch.ops.mesa.quantize(x, params[0], params[2], draws, "t", 4, 3, 2, True, True)
    assert packed.shape == (12,) and packed.dtype == torch.uint8 and int(draws) == 1
    back = torch.ops.mesa.unpack(packed, params[1], params[2], 4, 3, 2, 24, torch.float32)
    assert (back.view(4, 6) - x).abs().max() <= float(params[1].max()) + 1e-6
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fx = mode.from_tensor(x)
        fp = torch.ops.mesa.range_update(fx, mode.from_tensor(clip), mode.from_tensor(shift),
                                         mode.from_tensor(it), 3, 2, 0.9, False, 8, True, "raise", "t", False)
        fq = torch.ops.mesa.quantize(fx, fp[0], fp[2], mode.from_tensor(draws), "t", 2, 3, 2, True, True)
        fd = torch.ops.mesa.unpack(fq, fp[1], fp[2], 2, 3, 2, 24, torch.bfloat16)
        fs, fr = torch.ops.mesa.quantize_step(fx, 3, 2, mode.from_tensor(clip), mode.from_tensor(shift),
                                              mode.from_tensor(it), 0.9, 0.1, 0, 4, True, 0,
                                              mode.from_tensor(draws), True, "raise", "t", "t")
    assert fp.shape == (4, 3) and fq.shape == (6,) and fd.shape == (24,) and fd.dtype == torch.bfloat16
    assert fs.shape == (12,) and fs.dtype == torch.uint8 and fr.shape == (4, 3) and fr.dtype == torch.float32


def _step_args(x, bits=4, mode="raise", name="blk.fc1"):
    return (x, 3, x.shape[-1] // 3 if x.dim() == 1 else 2, torch.ones(3), torch.zeros(3), torch.zeros(1), 0.9,
            0.1, 0, bits, True, 5, torch.zeros(1, dtype=torch.int64), True, mode, name, "salt")


def test_native_ops_are_cpp_kernels_equal_to_their_python_fallback(monkeypatch):
    """The first call on a CPU tensor registers the extension's kernels of mesa::quantize_step
    and mesa::unpack for the CPU key (cuda/torch_ops.h: compiled graphs call them without
    Python); what they compute -- codes, rows, running state, draw counter -- equals the Python
    fallback bit for bit (the same seed: torch's generator state, the salt, the base, the counter)."""
    from mesa_ops import ops

    x = torch.randn(4, 6)
    native = _step_args(x)
    packed, rows = torch.ops.mesa.quantize_step(*native)
    assert torch._C._dispatch_has_kernel_for_dispatch_key("mesa::quantize_step", "CPU")
    assert torch._C._dispatch_has_kernel_for_dispatch_key("mesa::unpack", "CPU")
    assert "cpu" in ops._NATIVE  # (registered: the fallback computes itself)
    python = _step_args(x)
    p2, r2 = ops._quantize_step_fallback(*python)
    assert torch.equal(packed, p2) and torch.equal(rows, r2)
    for a, b in zip(native[3:6] + native[12:13], python[3:6] + python[12:13]):
        assert torch.equal(a, b)
    assert int(native[12]) == 1  # (advanced: update)
    back = torch.ops.mesa.unpack(packed, rows[1], rows[2], 4, 3, 2, 24, torch.float32)
    assert torch.equal(back, ops._unpack_fallback(packed, rows[1], rows[2], 4, 3, 2, 24, torch.float32))
    table, mul = torch.randn(3, 16), torch.randn(24)
    from mesa_ops import reference

    for m in (None, mul):
        got = torch.ops.mesa.lut_apply(packed, table, 4, 3, 2, 24, m)
        assert torch.equal(got, ops._lut_apply_fallback(packed, table, 4, 3, 2, 24, m))
        assert torch.equal(got, reference.lut_apply(packed, table, 4, 3, 2, 24, m))
    assert (back.view(4, 6) - x).abs().max() <= float(rows[1].max())
    # another base or salt: other codes (stochastic rounding)
    other = list(_step_args(x))
    other[11] = 6
    assert not torch.equal(torch.ops.mesa.quantize_step(*other)[0], packed)


def test_native_ops_pass_torch_library_opcheck():
    """Schemas (mutations declared), fake implementations, autograd registration and AOT dispatch
    as torch.library.opcheck checks them; no output shares storage with another or an input."""
    x = torch.randn(4, 6)
    packed, rows = torch.ops.mesa.quantize_step(*_step_args(x))
    assert packed.untyped_storage().data_ptr() != rows.untyped_storage().data_ptr()
    calls = [(torch.ops.mesa.quantize_step.default, _step_args(x)),
             (torch.ops.mesa.unpack.default, (packed, rows[1], rows[2], 4, 3, 2, 24, torch.float32)),
             (torch.ops.mesa.pack.default, ((x > 0).float().reshape(-1), torch.ones(1), torch.zeros(1), 1, 1, 24)),
             (torch.ops.mesa.lut_apply.default, (packed, torch.randn(3, 16), 4, 3, 2, 24, None)),
             (torch.ops.mesa.lut_apply.default, (packed, torch.randn(3, 16), 4, 3, 2, 24, torch.randn(24)))]
    for op, args in calls:
        got = torch.library.opcheck(op, args)
        assert set(got.values()) == {"SUCCESS"}, (op, got)


def test_native_op_reports_a_nonfinite_activation_by_name():
    x = torch.randn(4, 6)
    x[1, 2] = float("nan")
    with pytest.raises(FloatingPointError, match="blk.fc1: the activation of shape \\(4, 6\\)"):
        torch.ops.mesa.quantize_step(*_step_args(x))
    args = _step_args(x, mode="skip", name="blk.fc9")
    with pytest.warns(RuntimeWarning, match="blk.fc9"):
        packed, rows = torch.ops.mesa.quantize_step(*args)
    assert rows[3].tolist() == [1.0, 0.0, 1.0] and torch.isnan(rows[2][1]) and float(args[5]) == 0.0


def test_compiled_steps_follow_a_new_mesa_generator_base():
    """Mesa's base is read while dynamo traces (an argument of mesa::quantize_step): a new base
    (ms.set_rng_state) retraces, and the compiled step's noise stays the eager step's."""
    x = torch.randn(2, 3, 8, 8)
    eager_model = _model()
    compiled_model = copy.deepcopy(eager_model)
    dynamo.reset()
    fn = torch.compile(compiled_model, backend="aot_eager", fullgraph=True)
    base = ms.get_rng_state()
    try:
        runs = []
        for model, f in ((eager_model, eager_model), (compiled_model, fn)):
            ms.set_rng_state(base)
            first = _steps(model, f, x, steps=1)
            ms.set_rng_state(torch.tensor([1234], dtype=torch.int64))
            runs.append((first, _steps(model, f, x, steps=1)))
        _compare(runs[0][0], runs[1][0], exact=True)
        _compare(runs[0][1], runs[1][1], exact=True)
    finally:
        ms.set_rng_state(base)


def test_deferred_nonfinite_flags_leave_the_compiled_graph_alone():
    """Non-finite flags waiting to be read (a CUDA step defers one per stored activation) do not
    change what dynamo traced: one graph, no graph break, over steps that each defer flags."""
    from mesa_ops import nonfinite

    x = torch.randn(2, 3, 8, 8)
    model = _model()
    dynamo.reset()
    dynamo.utils.counters.clear()
    fn = torch.compile(model, backend="aot_eager", fullgraph=True)
    try:
        for _ in range(3):
            nonfinite.defer(torch.ones(3), "raise", "blk.fc1", (3,))
            fn(x).square().sum().backward()
        assert not dynamo.utils.counters["graph_break"]
        assert dynamo.utils.counters["stats"]["unique_graphs"] == 1
    finally:
        ms.check_nonfinite()
    assert not nonfinite.LOG.pending and not nonfinite.LOG.in_flight


def test_mesa_backend_torch_withdraws_the_native_kernels(monkeypatch):
    """MESA_BACKEND=torch, read while dynamo traces: the extension's kernels of the native ops
    are withdrawn and the compiled step runs the reference through the ops' Python fallback (the
    same gradients as eager under the reference); without it they are registered again."""
    x = torch.randn(2, 3, 8, 8)
    torch.ops.mesa.quantize_step(*_step_args(torch.randn(4, 6)))
    assert torch._C._dispatch_has_kernel_for_dispatch_key("mesa::quantize_step", "CPU")
    monkeypatch.setenv("MESA_BACKEND", "torch")
    eager_model = _model()
    compiled_model = copy.deepcopy(eager_model)
    eager = _steps(eager_model, eager_model, x)
    dynamo.reset()
    compiled = _steps(compiled_model, torch.compile(compiled_model, backend="aot_eager", fullgraph=True), x)
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("mesa::quantize_step", "CPU")
    _compare(eager, compiled, exact=True)
    monkeypatch.delenv("MESA_BACKEND")
    torch.ops.mesa.quantize_step(*_step_args(torch.randn(4, 6)))
    assert torch._C._dispatch_has_kernel_for_dispatch_key("mesa::quantize_step", "CPU")


@pytest.mark.cuda
def test_native_ops_run_their_cuda_kernels_in_a_compiled_step(cuda_backend):
    """On a GPU (scripts/cuda_check.sh's tests stage): the first compiled call registers the CUDA
    build's kernels of the native ops (after its self-check) and the compiled step (aot_eager)
    matches eager: bytes, gradients, running state."""
    x = torch.randn(2, 3, 8, 8, device="cuda")
    eager_model = _model().cuda()
    compiled_model = copy.deepcopy(eager_model)
    eager = _steps(eager_model, eager_model, x)
    dynamo.reset()
    fn = torch.compile(compiled_model, backend="aot_eager", fullgraph=True)
    compiled = _steps(compiled_model, fn, x)
    assert torch._C._dispatch_has_kernel_for_dispatch_key("mesa::quantize_step", "CUDA")
    assert torch._C._dispatch_has_kernel_for_dispatch_key("mesa::unpack", "CUDA")
    _compare(eager, compiled, exact=False)


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
