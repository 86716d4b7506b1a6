"""The CUDA kernels on a real GPU (marked ``cuda``: skipped without one; run by
scripts/cuda_check.sh): bit for bit equal to the CPU kernels for the same input, range and seed,
the seed source equal in Python and C++, the runtime self-check passing, and a Mesa training step
without a host sync (``torch.cuda.set_sync_debug_mode('error')``). Without a GPU the same kernels
run on the CPU through the emulation (tests/test_cuda_emulation.py) and the Python branches on
fake CUDA tensors (tests/test_fake_cuda.py)."""
from __future__ import annotations

import pytest
import torch

import mesa_ops as ms
import models
from mesa_ops import backend, ops, reference
from tests.test_kernels import LAYOUTS, _input, _state

pytestmark = pytest.mark.cuda
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
STEP_LAYOUTS = ("n=13,odd", "inner=1,G=3", "G=C,inner=1", "tile+1", "G=3,groups-cross-tiles")


@pytest.mark.parametrize("layout", STEP_LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("mode", [reference.EMA, reference.BATCH, reference.UNION],
                         ids=reference.RANGE_MODES)
def test_cuda_quantize_step_equals_cpu(cuda_backend, cpp_backend, layout, dtype, mode):
    """The fused step over three batches (the first sets the range, then EMA / batch / union):
    codes, range rows and running state identical on CUDA and CPU, for every bit width."""
    n, g, inner = LAYOUTS[layout]
    for bits in (8, 4, 2):
        cpu, gpu = _state(g), tuple(t.cuda() for t in _state(g))
        dc, dg = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
        for scale in (1.0, 2.5, 0.5):
            x = _input(n, dtype) * scale
            a = cpp_backend.quantize_step(x, g, inner, *cpu, 0.9, 0.1, mode, bits, True, 12345, dc,
                                          True, False)
            b = cuda_backend.quantize_step(x.cuda(), g, inner, *gpu, 0.9, 0.1, mode, bits, True,
                                           12345, dg, True, False)
            assert torch.equal(b[0].cpu(), a[0]), f"codes, {bits} bits"
            assert torch.equal(b[4].cpu(), a[4]), f"range rows, {bits} bits"
            for sa, sb in zip(cpu, gpu):
                assert torch.equal(sb.cpu(), sa)
            n_out = x.numel()
            assert torch.equal(cuda_backend.dequantize(b[0], b[1], b[2], bits, g, inner, n_out, dtype).cpu(),
                               cpp_backend.dequantize(a[0], a[1], a[2], bits, g, inner, n_out, dtype))
            lv = cpp_backend.levels(a[1], a[2], bits, dtype)
            assert torch.equal(cuda_backend.levels(b[1], b[2], bits, dtype).cpu(), lv)
            out_c, out_g = torch.empty(n_out, dtype=dtype), torch.empty(n_out, dtype=dtype, device="cuda")
            cpp_backend.lut_apply_out(a[0], lv, bits, g, inner, out_c)
            cuda_backend.lut_apply_out(b[0], lv.cuda(), bits, g, inner, out_g)
            assert torch.equal(out_g.cpu(), out_c)
        assert int(dc) == int(dg) == 3


@pytest.mark.parametrize("g", (1, 3))
def test_cuda_quantize_step_many_pieces_and_graph_capture_equal_cpu(cuda_backend, cpp_backend, g):
    """Issue 36: quantize_step is one cooperative launch (quantize_step_kernel). A tensor of more
    (chunk, group) pieces than its grid holds at once (G = 1: 2048 chunks; G = 3: 3 x 682), so
    that blocks take several in turn; and the same step captured into a CUDA graph and replayed
    (where the two launches run: minmax_kernel + quantize_kernel). Codes, rows and state equal
    the CPU kernel's in both."""
    inner = 2048 * 2048 + 5 if g == 1 else 682 * 2048 + 3
    x = _input(2 * g * inner, torch.float32)
    x[len(x) // 2 + 11] = 30.0  # (the max in a middle piece)
    args = (0.9, 0.1, reference.UNION, 8, True, 77)
    cpu, gpu = _state(g), tuple(t.cuda() for t in _state(g))
    dc, dg = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    xg = x.cuda()
    for _ in range(2):
        a = cpp_backend.quantize_step(x, g, inner, *cpu, *args, dc, True, False)
        b = cuda_backend.quantize_step(xg, g, inner, *gpu, *args, dg, True, False)
        assert torch.equal(b[0].cpu(), a[0]) and torch.equal(b[4].cpu(), a[4])
        assert all(torch.equal(sb.cpu(), sa) for sa, sb in zip(cpu, gpu))
        x, xg = x * 1.5, xg * 1.5
    a = cpp_backend.quantize_step(x, g, inner, *cpu, *args, dc, True, False)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        b = cuda_backend.quantize_step(xg, g, inner, *gpu, *args, dg, True, False)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(b[0].cpu(), a[0]) and torch.equal(b[4].cpu(), a[4])
    assert all(torch.equal(sb.cpu(), sa) for sa, sb in zip(cpu, gpu))


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16), ids=lambda d: str(d).replace("torch.", ""))
def test_cuda_quantize_step_many_equals_cpu_calls(cuda_backend, cpp_backend, dtype):
    """Issue 36: an attention's q, k and v (read in place from one fused qkv, each with its own
    state, counter, bits and exact first row) quantized in one launch and restored in one equal
    the CPU kernel's calls one after the other, over two steps."""
    qkv = (torch.randn(4, 197, 3 * 192) * 3).to(dtype)
    calls = {}
    for dev in ("cpu", "cuda"):
        src = qkv.to(dev)
        calls[dev] = [(src[..., 192 * i:192 * (i + 1)], 3, 64, *(t.to(dev) for t in _state(3)), 0.9,
                       0.1, reference.UNION, bits, True, 1000 + i, torch.tensor([i]), True, False,
                       False, None, None, torch.empty(4, 1, 192, dtype=dtype, device=dev))
                      for i, bits in enumerate((8, 4, 8))]
    for _ in range(2):
        got = cuda_backend.quantize_step_many(calls["cuda"])
        want = [cpp_backend.quantize_step(*c) for c in calls["cpu"]]
        for b, a, cg, cc in zip(got, want, calls["cuda"], calls["cpu"]):
            assert torch.equal(b[0].cpu(), a[0]) and torch.equal(b[4].cpu(), a[4])
            assert torch.equal(cg[18].cpu(), cc[18])
            assert all(torch.equal(sg.cpu(), sc) for sg, sc in zip(cg[3:6], cc[3:6]))
    n = qkv.numel() // 3
    outs = cuda_backend.dequantize_out_many(
        [(b[0], b[1], b[2], c[9], 3, 64, torch.empty(n, dtype=dtype, device="cuda"), c[18])
         for b, c in zip(got, calls["cuda"])])
    for out, a, c in zip(outs, want, calls["cpu"]):
        ref = cpp_backend.dequantize_out(a[0], a[1], a[2], c[9], 3, 64, torch.empty(n, dtype=dtype), c[18])
        assert torch.equal(out.cpu(), ref)


def test_cuda_fingerprint_python_equals_cpp():
    ext = backend.build_extension("cuda")
    for seed in (0, 1234):
        torch.cuda.manual_seed(seed)
        torch.rand(1000, device="cuda")  # (advances the philox offset)
        dev = torch.device("cuda", torch.cuda.current_device())
        assert ops.torch_fingerprint(dev) == ext.generator_fingerprint_cuda(dev.index) & 0xFFFFFFFF


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("bits", (8, 4, 2))
def test_cuda_self_check_passes(cuda_backend, dtype, bits):
    assert backend.self_check(cuda_backend, torch.device("cuda"), dtype, bits) is None
    assert backend.self_check_many(cuda_backend, torch.device("cuda"), dtype, bits) is None


@pytest.mark.parametrize("name,policy", [("deit_tiny_patch16_224", "mesa_8bit"),
                                         ("swin_tiny_patch4_window7_224", "swin_8bit"),
                                         ("pvt_tiny", "pvt_8bit")])
@pytest.mark.parametrize("amp", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_cuda_train_step_without_host_sync(name, policy, amp):
    model = models.create_model(name, ms_policy=f"configs/mesa/{policy}.txt").cuda().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(8, 3, 224, 224, device="cuda")
    y = torch.randint(0, 1000, (8,), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=amp):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # (first use: builds, self-checks; the latter compares on the host)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ms.check_nonfinite()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_cuda_nonfinite_activation_raises_naming_the_layer():
    layer = ms.Linear(16, 8).cuda().train()
    layer.enable = True
    layer.layer_name = "blocks.0.fc"
    x = torch.randn(4, 16, device="cuda")
    x[1, 3] = float("nan")
    layer(x).sum().backward()  # (deferred: no host sync in the step)
    with pytest.raises(FloatingPointError, match="blocks.0.fc"):
        ms.check_nonfinite()
