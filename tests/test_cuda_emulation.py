"""The CUDA kernels of cuda/quant_cuda.cu, run on the CPU, against the CPU kernels bit for bit.

``quant_cuda.cu`` also compiles for the host (``cuda/quant_cuda_emu.cpp`` with
``cuda/cuda_emulation.h``: a launch runs the grid block by block and each block's threads as
fibers, ``__syncthreads`` a real barrier among them), so these tests run the very kernels a GPU
runs -- their indexing, reductions, last-block finalize, packing, range rule and seeds -- on the
CPU kernels' own cases: fp32/fp16/bf16/fp64, bits 8/4/2 (and the 1-bit mask), odd sizes, group
layouts, row-strided q/k/v, LayerNorm rows, non-finite and overflowing groups, every range mode,
and the kernels' 64-bit-index variants. The emulated build takes ~2 minutes the first time.
"""
from __future__ import annotations

import pytest
import torch

from mesa_ops import backend, ops, quant, reference
from mesa_ops import packed as packed_mod

ALL_BITS = (8, 4, 2, 1)
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# (numel, G, inner), as tests/test_kernels.py: the tensor is viewed as (numel // (G*inner), G, inner)
LAYOUTS = {
    "one-element": (1, 1, 1),
    "n<8": (7, 1, 7),
    "n=13,odd": (13, 1, 13),
    "inner=1,G=3": (9, 3, 1),
    "G=C,inner=1": (6 * 40, 40, 1),
    "tile+1": (4097, 1, 4097),
    "G=3,groups-cross-tiles": (2 * 3 * 1367, 3, 1367),
    "BCHW,G=C": (2 * 6 * 5 * 7, 6, 35),
}
MODES = (reference.EMA, reference.BATCH, reference.UNION)


@pytest.fixture(scope="module")
def emu():
    m = backend.build_extension("emu")
    assert m.emulated
    return m


@pytest.fixture(scope="module")
def cpu(cpp_backend):
    return backend._cpu_extension()


@pytest.fixture(params=[False, True], ids=["index32", "index64"])
def index64(request, emu):
    emu.set_index64(request.param)
    yield request.param
    emu.set_index64(False)


# quantize_step's launches: one cooperative launch of at most 3 blocks (the emulation's
# default: chunks taken in turn, grid syncs across blocks), of 1 block, or none (minmax_kernel +
# quantize_kernel, where a device or a CUDA-graph capture takes no cooperative launch)
COOP = {"one-launch": 3, "one-block": 1, "two-launches": 0}


@pytest.fixture(params=list(COOP))
def coop(request, emu):
    emu.set_coop_blocks(COOP[request.param])
    yield COOP[request.param]
    emu.set_coop_blocks(3)


def _input(numel, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(numel, generator=g) * 3 + 0.5).to(dtype)


def _params(x, groups, inner, bits):
    """(inv, step, shift) covering the middle 80% of each group's range (values clamp at both ends)."""
    if bits == 1:
        one, zero = torch.ones(groups), torch.zeros(groups)
        return one, one.clone(), zero
    mm = reference.group_minmax(x, groups, inner)
    rng = (mm[1] - mm[0]).clamp_min(1e-8)
    lo = (mm[0] + 0.1 * rng).contiguous()
    rng = (0.8 * rng).clamp_min(1e-8)
    levels = float((1 << bits) - 1)
    return (levels / rng).contiguous(), (rng / levels).contiguous(), lo


def _codes_equal_cpu(emu, cpu, x, xc, inv, shift, bits, g, inner, seed):
    """The emulated kernel's codes of ``x`` equal the CPU kernel's of ``xc`` (``x`` itself or its
    contiguous copy), stochastic and to nearest; returns the CPU's last (to nearest) codes."""
    for stochastic in (True, False):
        p = cpu.quantize_cpu(xc, inv, shift, bits, g, inner, seed, stochastic)
        pe = emu.quantize_cuda(x, inv, shift, bits, g, inner, seed, stochastic)
        assert torch.equal(pe, p), f"{bits}-bit stochastic={stochastic}"
    return p


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_quantize_dequantize_minmax_equal_cpu(emu, cpu, index64, dtype, layout):
    n, g, inner = LAYOUTS[layout]
    x = _input(n, dtype)
    assert torch.equal(emu.group_minmax_cuda(x, g, inner), cpu.group_minmax_cpu(x, g, inner))
    for bits in ALL_BITS:
        inv, step, shift = _params(x, g, inner, bits)
        p = _codes_equal_cpu(emu, cpu, x, x, inv, shift, bits, g, inner, 0x1234_5678_9ABC)
        for out_dtype in (dtype, torch.float32):
            d = cpu.dequantize_cpu(p, step, shift, bits, g, inner, n, out_dtype)
            assert torch.equal(emu.dequantize_cuda(p, step, shift, bits, g, inner, n, out_dtype), d)
            out = torch.empty(n, dtype=out_dtype)
            assert emu.dequantize_out_cuda(p, step, shift, bits, g, inner, out) is not None
            assert torch.equal(out, d)


@pytest.mark.parametrize("bits", (8, 4, 2))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16, torch.float64))
def test_levels_and_table_restore_equal_cpu(emu, cpu, index64, dtype, bits):
    g, inner, outer = 3, 7, 11
    n = outer * g * inner
    x = _input(n, torch.float32, seed=bits)
    inv, step, shift = _params(x, g, inner, bits)
    packed = cpu.quantize_cpu(x, inv, shift, bits, g, inner, 5, True)
    levels = cpu.levels_cpu(step, shift, bits, dtype)
    assert torch.equal(emu.levels_cuda(step, shift, bits, dtype), levels)
    table = torch.nn.functional.gelu(levels.float()).to(dtype)
    mul = _input(n, dtype, seed=9)
    for m in (None, mul):
        want = cpu.lut_apply_out_cpu(packed, table, bits, g, inner, torch.empty(n, dtype=dtype), m)
        got = emu.lut_apply_out_cuda(packed, table, bits, g, inner, torch.empty(n, dtype=dtype), m)
        assert torch.equal(got, want)


def _strided_cases():
    qkv = torch.randn(3, 37, 3 * 48) * 2
    return {"q-of-qkv": (qkv[..., :48], 1, 48), "k-of-qkv,G=4": (qkv[..., 48:96], 4, 12),
            "transposed": (torch.randn(40, 24).t(), 1, 40),
            "not-collapsible": (torch.randn(4, 9, 50)[:, :5, :30], 3, 10)}


@pytest.mark.parametrize("case", list(_strided_cases()))
def test_strided_inputs_read_as_their_contiguous_copies(emu, cpu, index64, case):
    x, g, inner = _strided_cases()[case]
    xc = x.contiguous()
    assert torch.equal(emu.group_minmax_cuda(x, g, inner), cpu.group_minmax_cpu(xc, g, inner))
    for bits in (8, 4, 2):
        inv, _, sh = _params(xc, g, inner, bits)
        _codes_equal_cpu(emu, cpu, x, xc, inv, sh, bits, g, inner, 77)


def _state(g, it=0.0):
    return [torch.full((g,), 2.0), torch.full((g,), -1.0), torch.full((1,), float(it))]


@pytest.mark.parametrize("mode", MODES, ids=reference.RANGE_MODES)
@pytest.mark.parametrize("layout", ["inner=1,G=3", "G=3,groups-cross-tiles", "G=C,inner=1"])
def test_range_update_equals_cpu_over_steps(emu, cpu, index64, layout, mode):
    """Several steps of the running-range update (first step, EMA, a batch beyond the range, a
    recomputation that must not move the state): identical rows and state."""
    n, g, inner = LAYOUTS[layout]
    sc, se = _state(g), _state(g)
    for step, (scale, update) in enumerate(((1.0, True), (2.5, True), (0.5, True), (3.0, False))):
        x = _input(n, torch.float32, seed=step) * scale
        a = cpu.range_update_cpu(x, g, inner, *sc, 0.9, 1.0 - 0.9, mode, 8, update)
        b = emu.range_update_cuda(x, g, inner, *se, 0.9, 1.0 - 0.9, mode, 8, update)
        assert torch.equal(b, a), step
        for s1, s2 in zip(sc, se):
            assert torch.equal(s2, s1), step


# (numel, G, inner) with many chunks per group: the last block reduces each group's chunks
# with the whole block (G * 4 < 256 threads, more than 4 chunks): 41 chunks per group; 300
# chunks, more than the block's threads; and one non-finite value in one chunk
MANY_CHUNKS = {"G=2,41-chunks": (2 * (2048 * 40 + 5), 2, 2048 * 40 + 5),
               "G=1,300-chunks": (2048 * 300, 1, 2048 * 300),
               "G=3,inner=1,9-chunks": (3 * 2048 * 9, 3, 1)}


@pytest.mark.parametrize("layout", list(MANY_CHUNKS))
def test_finalize_across_many_chunks_equals_cpu(emu, cpu, index64, layout):
    n, g, inner = MANY_CHUNKS[layout]
    x = _input(n, torch.float32, seed=3)
    x[n // 2 + 17] = 30.0  # the max lies in a middle chunk
    assert torch.equal(emu.group_minmax_cuda(x, g, inner), cpu.group_minmax_cpu(x, g, inner))
    sc, se = _state(g), _state(g)
    for step, scale in enumerate((1.0, 2.5)):
        a = cpu.range_update_cpu(x * scale, g, inner, *sc, 0.9, 0.1, reference.EMA, 8, True)
        b = emu.range_update_cuda(x * scale, g, inner, *se, 0.9, 0.1, reference.EMA, 8, True)
        assert torch.equal(b, a), step
        assert all(torch.equal(s2, s1) for s1, s2 in zip(sc, se)), step
    bad = x.clone()
    bad[n // 3] = float("inf")
    a = cpu.range_update_cpu(bad, g, inner, *_state(g), 0.9, 0.1, reference.EMA, 8, True)
    b = emu.range_update_cuda(bad, g, inner, *_state(g), 0.9, 0.1, reference.EMA, 8, True)
    assert torch.equal(b.isnan(), a.isnan()) and torch.equal(b.nan_to_num(), a.nan_to_num())


def test_nonfinite_and_overflowing_groups_are_flagged(emu, cpu):
    x = torch.randn(2, 4, 100)
    x[0, 1, 3] = float("nan")
    x[1, 2, 5] = float("inf")
    x[0, 3, 0], x[1, 3, 7] = 3e38, -3e38  # a finite group whose range overflows float32
    x = x.reshape(-1)
    for mm in (emu.group_minmax_cuda(x, 4, 100), cpu.group_minmax_cpu(x, 4, 100)):
        assert torch.isnan(mm[:, 1:]).all() and torch.isfinite(mm[:, 0]).all()
    sc, se = _state(4, it=3), _state(4, it=3)
    a = cpu.range_update_cpu(x, 4, 100, *sc, 0.9, 0.1, reference.UNION, 8, True)
    b = emu.range_update_cuda(x, 4, 100, *se, 0.9, 0.1, reference.UNION, 8, True)
    assert torch.equal(a, b) and a[3].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert all(torch.equal(s1, s2) for s1, s2 in zip(sc, se)) and float(se[2]) == 3.0  # unchanged


@pytest.mark.parametrize("mode", MODES, ids=reference.RANGE_MODES)
@pytest.mark.parametrize("layout", ["q-of-qkv", "contiguous", "fp16"])
def test_quantize_step_equals_cpu(emu, cpu, index64, coop, layout, mode):
    """The fused step (range update + codes, seeded from the draw counter): same codes, rows,
    state and counter as the CPU kernel, with an explicit prefix and with prefix_of_mix (the
    emulated device's generator is the CPU's); a NaN group is marked; nothing is flagged on
    the host (None)."""
    qkv = torch.randn(2, 29, 3 * 32)
    x = {"q-of-qkv": qkv[..., :32], "contiguous": torch.randn(2, 29, 32),
         "fp16": torch.randn(2, 29, 32).half()}[layout]
    g, inner = 4, 8
    sc, se = _state(g), _state(g)
    dc, de = torch.tensor([5]), torch.tensor([5])
    for step in range(3):
        for of_mix, prefix in ((False, ops.signed64(ops.seed_prefix(7))),
                               (True, ops.signed64(ops.salt_mix(7)))):
            for bits in (8, 4, 2):
                a = cpu.quantize_step_cpu(x, g, inner, *sc, 0.9, 0.1, mode, bits, True, prefix, dc,
                                          True, True, of_mix)
                b = emu.quantize_step_cuda(x, g, inner, *se, 0.9, 0.1, mode, bits, True, prefix, de,
                                           True, True, of_mix)
                assert b[3] is None and a[3] is True
                for i in (0, 1, 2, 4):
                    assert torch.equal(b[i], a[i]), (step, of_mix, bits, i)
                assert all(torch.equal(s1, s2) for s1, s2 in zip(sc, se)) and torch.equal(dc, de)
        x = x * 1.7
    bad = x.contiguous().clone()
    bad[0, 0, 9] = float("nan")  # group 1
    a = cpu.quantize_step_cpu(bad, g, inner, *sc, 0.9, 0.1, mode, 8, True, 1, dc, True, True)
    b = emu.quantize_step_cuda(bad, g, inner, *se, 0.9, 0.1, mode, 8, True, 1, de, True, True)
    assert b[4][3].tolist() == [1.0, 0.0, 1.0, 1.0] and torch.isnan(b[2][1])
    assert torch.equal(a[0], b[0]) and torch.equal(a[4][:, [0, 2, 3]], b[4][:, [0, 2, 3]])
    # a recomputation (update=False) moves neither the state nor the counter
    before = [t.clone() for t in se] + [de.clone()]
    emu.quantize_step_cuda(x, g, inner, *se, 0.9, 0.1, mode, 8, False, 1, de, True, True)
    assert all(torch.equal(p, q) for p, q in zip(before, se + [de]))


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("layout", ("strided", "contiguous"))
def test_quantize_step_normalizes_rows_as_cpu(emu, cpu, index64, coop, dtype, layout):
    base = torch.randn(3, 23, 2 * 36, dtype=dtype) * 3 + 5
    x = base[..., :36] if layout == "strided" else base[..., :36].contiguous()
    var, mean = torch.var_mean(x.float(), dim=-1, correction=0, keepdim=True)
    rstd = torch.rsqrt(var + 1e-5)
    norm = (mean.reshape(-1), rstd.reshape(-1))
    for g, inner in ((1, 36), (3, 12)):
        for bits in (8, 4, 2):
            sc, se = _state(g), _state(g)
            a = cpu.quantize_step_cpu(x, g, inner, *sc, 0.9, 0.1, reference.UNION, bits, True, 99,
                                      torch.tensor([3]), True, False, False, *norm)
            b = emu.quantize_step_cuda(x, g, inner, *se, 0.9, 0.1, reference.UNION, bits, True, 99,
                                       torch.tensor([3]), True, False, False, *norm)
            assert torch.equal(a[0], b[0]) and torch.equal(a[4], b[4]), (g, bits)
            assert all(torch.equal(s1, s2) for s1, s2 in zip(sc, se))
    with pytest.raises(RuntimeError, match="whole number of groups"):
        emu.quantize_step_cuda(x, 3, 12, torch.ones(3), torch.zeros(3), torch.zeros(1), 0.9, 0.1,
                               0, 8, True, 1, torch.zeros(1, dtype=torch.int64), True, False, False,
                               torch.zeros(3 * 23 * 2), torch.ones(3 * 23 * 2))


def test_emulated_ops_check_their_arguments(emu):
    """The emulated ops check their arguments as the CPU ones do."""
    x = torch.randn(16)
    with pytest.raises(RuntimeError, match="bits must be"):
        emu.quantize_cuda(x, torch.ones(1), torch.zeros(1), 3, 1, 16, 0, True)
    with pytest.raises(RuntimeError, match="range_mode must be"):
        emu.range_update_cuda(x, 1, 16, torch.ones(1), torch.zeros(1), torch.zeros(1), 0.9, 0.1,
                              5, 8, True)


@pytest.mark.parametrize("bits", (8, 2))
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16), ids=["float32", "float16"])
def test_runtime_self_check_passes_on_the_emulated_kernels(emu, coop, dtype, bits):
    """backend.self_check and self_check_many, which a GPU run passes before its first quantize,
    run on the emulated CUDA kernels: the long case takes the last block's whole-block reduction
    of many chunks; the three cases in one launch (and in one restore) equal them one at a time."""
    be = backend._Extension(emu, "cuda")
    assert be.has_many
    assert backend.self_check(be, torch.device("cpu"), dtype, bits) is None
    before = emu.launches()
    assert backend.self_check_many(be, torch.device("cpu"), dtype, bits) is None
    # the three calls one at a time, then in one launch (without a cooperative launch: two
    # launches per call, as one at a time); the restores likewise (3 + 1)
    assert emu.launches() - before == (3 + 1 if coop else 6 + 6) + 4


def test_launches_per_op_and_the_persistent_counter(emu, cpu, coop):
    """Kernel launches per op (issue 36): quantize_step 1 (a cooperative launch: the range pass,
    the finalize and the codes), or 2 without one (min/max with its finalize, codes; the
    last-block counter persists and is reset by the last block: no fill launch), range_update
    and group_minmax 1, dequantize 1; back-to-back calls of many chunks each (300 chunks, taken
    in turn by the cooperative grid; the counter reused) still equal the CPU kernels."""
    n, g, inner = MANY_CHUNKS["G=1,300-chunks"]
    x = _input(n, torch.float32, seed=5)
    sc, se = _state(g), _state(g)
    dc, de = torch.tensor([0]), torch.tensor([0])
    for step in range(3):
        before = emu.launches()
        b = emu.quantize_step_cuda(x, g, inner, *se, 0.9, 0.1, reference.EMA, 8, True, 3, de, True, True)
        assert emu.launches() - before == (1 if coop else 2)
        a = cpu.quantize_step_cpu(x, g, inner, *sc, 0.9, 0.1, reference.EMA, 8, True, 3, dc, True, True)
        assert torch.equal(b[0], a[0]) and torch.equal(b[4], a[4]), step
        x = x * 0.5
    for call, args in (("range_update_cuda", (x, g, inner, *_state(g), 0.9, 0.1, reference.EMA, 8, True)),
                       ("group_minmax_cuda", (x, g, inner))):
        before = emu.launches()
        getattr(emu, call)(*args)
        assert emu.launches() - before == 1, call
    before = emu.launches()
    emu.dequantize_cuda(b[0], b[1], b[2], 8, g, inner, n, torch.float32)
    assert emu.launches() - before == 1


# (x, G, inner, P): the exact prefix rows (QTensor.head, the first P rows along dim -2) of
# token tensors (B, N, C) with groups along C, a (B, H, N, D) tensor with head-wise groups (a
# group spans many rows), a q sliced out of a fused qkv (read in place) and one group of many
# chunks (the minmax kernel's whole-block reduction)
def _prefix_cases():
    g = torch.Generator().manual_seed(11)
    qkv = torch.randn(2, 37, 3 * 48, generator=g) * 2
    return {"tokens,G=3,P=1": (torch.randn(2, 50, 36, generator=g) * 3 + 1, 3, 12, 1),
            "heads,G=H,P=2": (torch.randn(2, 4, 29, 8, generator=g), 4, 29 * 8, 2),
            "q-of-qkv,G=4,P=1": (qkv[..., :48], 4, 12, 1),
            "many-chunks,G=1,P=2": (torch.randn(3, 320, 320, generator=g), 1, 320 * 320, 2)}


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16, torch.float64),
                         ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("case", list(_prefix_cases()))
def test_prefix_rows_written_by_the_kernels_equal_cpu(emu, cpu, index64, case, dtype):
    """Issue 36: quantize_step copies the exact prefix rows out of x into ``head`` (with row
    statistics: of the normalized x-hat, float32), dequantize_out and lut_apply_out write a head
    over the restored rows: the emulated CUDA kernels equal the CPU kernels, both equal the
    Python path (x.narrow / _normalized, packed.with_head), and the codes, rows and restored
    values elsewhere equal those of a call without a head."""
    x, g, inner, p = _prefix_cases()[case]
    x = x.to(dtype)
    xc = x.contiguous()
    n = x.numel()
    norms = [None]
    if dtype != torch.float64 and g * inner % x.shape[-1] == 0 and inner <= x.shape[-1]:
        var, mean = torch.var_mean(xc.float(), dim=-1, correction=0, keepdim=True)
        norms.append((mean, torch.rsqrt(var + 1e-5)))
    for norm in norms:
        hdt = dtype if norm is None else torch.float32
        want = xc.narrow(-2, 0, p) if norm is None else \
            quant._normalized(xc.narrow(-2, 0, p), tuple(s.narrow(-2, 0, p) for s in norm))
        stats = (None, None) if norm is None else (norm[0].reshape(-1), norm[1].reshape(-1))
        outs = []
        for ext, run in ((cpu, cpu.quantize_step_cpu), (emu, emu.quantize_step_cuda)):
            head = torch.full(want.shape, float("nan"), dtype=hdt)
            r = run(x, g, inner, *_state(g), 0.9, 0.1, reference.UNION, 8, True, 21,
                    torch.tensor([4]), True, False, False, *stats, head)
            plain = run(x, g, inner, *_state(g), 0.9, 0.1, reference.UNION, 8, True, 21,
                        torch.tensor([4]), True, False, False, *stats)
            assert torch.equal(head, want), (ext is emu, norm is None)
            assert torch.equal(r[0], plain[0]) and torch.equal(r[4], plain[4])
            outs.append(r)
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][4], outs[1][4])
    # restores: the head over the first rows, the codes elsewhere
    packed, step, shift = outs[0][0], outs[0][1], outs[0][2]
    head = (xc.narrow(-2, 0, p) * 0.5).contiguous()  # (values no code restores to)
    deq = cpu.dequantize_cpu(packed, step, shift, 8, g, inner, n, dtype).view(x.shape)
    expect = packed_mod.with_head(deq.clone(), head).reshape(-1)
    table = torch.nn.functional.gelu(cpu.levels_cpu(step, shift, 8, torch.float32)).to(dtype)
    mul = _input(n, dtype, seed=2)
    for ext, deq_out, lut in ((cpu, cpu.dequantize_out_cpu, cpu.lut_apply_out_cpu),
                              (emu, emu.dequantize_out_cuda, emu.lut_apply_out_cuda)):
        out = torch.full((n,), float("nan"), dtype=dtype)
        deq_out(packed, step, shift, 8, g, inner, out, head)
        assert torch.equal(out, expect), ext is emu
        for m in (None, mul):
            plain = cpu.lut_apply_out_cpu(packed, table, 8, g, inner, torch.empty(n, dtype=dtype), m)
            got = lut(packed, table, 8, g, inner, torch.full((n,), float("nan"), dtype=dtype), m, head)
            assert torch.equal(got, packed_mod.with_head(plain.view(x.shape), head).reshape(-1))


def test_prefix_rows_checks_and_launches(emu, cpu):
    """A head of the wrong shape, dtype or layout is refused by both builds; with a head each op
    still launches as many kernels as without (quantize_step 1, dequantize_out 1, lut 1)."""
    x = torch.randn(2, 9, 16)
    args = (x, 2, 8, *_state(2), 0.9, 0.1, reference.UNION, 8, True, 3, torch.tensor([0]), True,
            False, False, None, None)
    for run in (cpu.quantize_step_cpu, emu.quantize_step_cuda):
        for bad in (torch.empty(2, 1, 8), torch.empty(2, 1, 16, dtype=torch.float16),
                    torch.empty(2, 1, 32)[..., ::2], torch.empty(3, 1, 16)):
            with pytest.raises(RuntimeError, match="head"):
                run(*args, bad)
    head = torch.empty(2, 1, 16)
    before = emu.launches()
    packed, step, shift, _, _ = emu.quantize_step_cuda(*args, head)
    assert emu.launches() - before == 1 and torch.equal(head, x[:, :1])
    before = emu.launches()
    out = emu.dequantize_out_cuda(packed, step, shift, 8, 2, 8, torch.empty(x.numel()), head)
    table = emu.levels_cuda(step, shift, 8, torch.float32)
    emu.lut_apply_out_cuda(packed, table, 8, 2, 8, torch.empty(x.numel()), None, head)
    assert emu.launches() - before == 3 and torch.equal(out.view(x.shape)[:, :1], head)
    for deq_out in (cpu.dequantize_out_cpu, emu.dequantize_out_cuda):
        with pytest.raises(RuntimeError, match="head"):  # 5 rows of 16 are not 288 elements' rows
            deq_out(packed, step, shift, 8, 2, 8, torch.empty(x.numel()), torch.empty(5, 1, 16))


# Issue 36 item 2: the kernels' runs of consecutive elements (wide loads/stores where aligned,
# scalar tails, the group stepped along a run). (outer, G, inner): sizes not a multiple of the
# runs (8 or 16 elements), inner = 1, inner not a multiple of a run. The emulation fails any
# launch that makes a misaligned wide access (cuda_emulation.h), as a GPU would fault.
VEC_LAYOUTS = {"n=1": (1, 1, 1), "n=3": (1, 1, 3), "n=5": (1, 1, 5), "n=7": (1, 1, 7),
               "n=4k+3": (1, 1, 4 * 11 + 3), "n=16k+3": (1, 1, 16 * 9 + 3),
               "inner=1,G=5": (7, 5, 1), "inner=3,G=5": (9, 5, 3), "inner=13,G=2": (11, 2, 13)}


def _view(full, offset, n):
    """n elements of `full` from element `offset` (a base pointer 16-byte aligned only at 0/4)."""
    return full[offset:offset + n]


@pytest.mark.parametrize("offset", (0, 1, 3, 4))
@pytest.mark.parametrize("layout", list(VEC_LAYOUTS))
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.float64),
                         ids=lambda d: str(d).replace("torch.", ""))
def test_runs_at_unaligned_offsets_and_odd_sizes_equal_cpu(emu, cpu, index64, dtype, layout, offset):
    """x, packed, out and mul as views starting `offset` elements into larger tensors: codes,
    min/max and restored values equal the CPU kernels' (which get contiguous copies), and no
    element around a view's out is written."""
    outer, g, inner = VEC_LAYOUTS[layout]
    n = outer * g * inner
    x = _view(_input(n + 8, dtype, seed=n), offset, n)
    xc = x.clone()
    assert torch.equal(emu.group_minmax_cuda(x, g, inner), cpu.group_minmax_cpu(xc, g, inner))
    for bits in ALL_BITS:
        inv, step, shift = _params(xc, g, inner, bits)
        p = _codes_equal_cpu(emu, cpu, x, xc, inv, shift, bits, g, inner, 0x5EED_0036)
        pv = _view(torch.zeros(p.numel() + 8, dtype=torch.uint8), offset, p.numel())
        pv.copy_(p)
        d = cpu.dequantize_cpu(p, step, shift, bits, g, inner, n, dtype)
        for packed in (p, pv):
            full = torch.full((n + 8,), float("nan"), dtype=dtype)
            out = _view(full, offset, n)
            emu.dequantize_out_cuda(packed, step, shift, bits, g, inner, out)
            assert torch.equal(out, d), bits
            assert full[:offset].isnan().all() and full[offset + n:].isnan().all()
        if bits == 1:
            continue
        table = torch.nn.functional.gelu(cpu.levels_cpu(step, shift, bits, torch.float32)).to(dtype)
        mul = _view(_input(n + 8, dtype, seed=1), offset, n)
        for m in (None, mul):
            want = cpu.lut_apply_out_cpu(p, table, bits, g, inner, torch.empty(n, dtype=dtype),
                                         None if m is None else m.clone())
            full = torch.full((n + 8,), float("nan"), dtype=dtype)
            out = _view(full, offset, n)
            emu.lut_apply_out_cuda(pv, table, bits, g, inner, out, m)
            assert torch.equal(out, want), bits
            assert full[:offset].isnan().all() and full[offset + n:].isnan().all()


@pytest.mark.parametrize("offset", (0, 1))
def test_runs_across_many_chunks_per_group_equal_cpu(emu, cpu, index64, coop, offset):
    """Groups of 8195 elements (5 chunks each, inner not a multiple of a run), x at an aligned
    and a misaligned start: min/max, the range update, codes and restored values."""
    g, inner = 3, 4 * 2048 + 3
    n = 2 * g * inner
    x = _view(_input(n + 4, torch.float32, seed=36), offset, n)
    xc = x.clone()
    x[n // 2 + 5] = 40.0
    xc[n // 2 + 5] = 40.0
    assert torch.equal(emu.group_minmax_cuda(x, g, inner), cpu.group_minmax_cpu(xc, g, inner))
    sc, se = _state(g), _state(g)
    a = cpu.quantize_step_cpu(xc, g, inner, *sc, 0.9, 0.1, reference.UNION, 4, True, 3,
                              torch.tensor([0]), True, True)
    b = emu.quantize_step_cuda(x, g, inner, *se, 0.9, 0.1, reference.UNION, 4, True, 3,
                               torch.tensor([0]), True, True)
    assert torch.equal(b[0], a[0]) and torch.equal(b[4], a[4])
    out = _view(torch.empty(n + 4), offset, n)
    emu.dequantize_out_cuda(b[0], b[1], b[2], 4, g, inner, out)
    assert torch.equal(out, cpu.dequantize_cpu(a[0], a[1], a[2], 4, g, inner, n, torch.float32))


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16, torch.float64),
                         ids=lambda d: str(d).replace("torch.", ""))
def test_aligned_runs_take_the_wide_accesses(emu, cpu, dtype):
    """On aligned tensors each kernel makes wide accesses (the vector paths are live), and a
    misaligned x / out takes none in quantize / dequantize (the scalar fallback)."""
    g, inner = 4, 256
    n = 4 * g * inner
    x = _input(n + 1, dtype)
    xa, xm = x[:n], x[1:]
    inv, step, shift = _params(xa.clone(), g, inner, 8)

    def wide(fn, *args):
        before = emu.vector_accesses()
        r = fn(*args)
        return emu.vector_accesses() - before, r

    size = x.element_size()
    assert wide(emu.group_minmax_cuda, xa, g, inner)[0] == n * size // 16
    k, p = wide(emu.quantize_cuda, xa, inv, shift, 8, g, inner, 1, True)
    assert k == n // 16 * (size + 1)  # per 16 elements: 16 * size bytes loaded, 16 stored
    assert wide(emu.quantize_cuda, xm, inv, shift, 8, g, inner, 1, True)[0] == n // 16  # stores
    out = torch.empty(n + 1, dtype=dtype)
    # per 8 elements: their 8 code bytes, 8 * size bytes stored; misaligned: the codes only
    assert wide(emu.dequantize_out_cuda, p, step, shift, 8, g, inner, out[:n])[0] == n // 8 * (1 + size // 2)
    assert wide(emu.dequantize_out_cuda, p, step, shift, 8, g, inner, out[1:])[0] == n // 8
    table = emu.levels_cuda(step, shift, 8, dtype)
    assert wide(emu.lut_apply_out_cuda, p, table, 8, g, inner, out[:n], xa)[0] == n // 8 * (1 + size)


def _qkv_calls(dtype, g=4, heads_p=1, seed=0):
    """quantize_step calls of q, k and v read in place from one fused (2, 29, 3 * 32) qkv (G
    head groups each, the first row kept exactly), each with a state and draw counter of its
    own, and their CPU twins (contiguous copies, own states)."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(2, 29, 3 * 32, generator=gen) * 3).to(dtype)
    emu_calls, cpu_calls = [], []
    for i, bits in enumerate((8, 4, 8)):
        x = qkv[..., 32 * i:32 * (i + 1)]
        for calls, xx in ((emu_calls, x), (cpu_calls, x.contiguous())):
            head = torch.empty(2, heads_p, 32, dtype=dtype)
            calls.append((xx, g, 32 // g, *_state(g), 0.9, 0.1, reference.UNION, bits, True,
                          ops.signed64(ops.seed_prefix(7 + i)), torch.tensor([3 + i]), True, True,
                          False, None, None, head))
    return emu_calls, cpu_calls


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16), ids=lambda d: str(d).replace("torch.", ""))
def test_quantize_step_many_is_one_launch_equal_to_the_calls_in_turn(emu, cpu, index64, coop, dtype):
    """Issue 36: quantize_step_many_cuda runs the q, k, v of an attention (each its own state,
    counter, bits and prefix rows) in one launch (one cooperative launch of quantize_step_kernel;
    without cooperative launches two per call), and every result, state and counter equals the
    CPU kernel's calls one after the other, over two steps; dequantize_out_many_cuda restores
    the three in one launch, equal to dequantize_out_cpu of each."""
    emu_calls, cpu_calls = _qkv_calls(dtype)
    for step in range(2):
        before = emu.launches()
        got = emu.quantize_step_many_cuda(emu_calls)
        assert emu.launches() - before == (1 if coop else 6)
        want = [cpu.quantize_step_cpu(*c) for c in cpu_calls]
        for i, (b, a, ce, cc) in enumerate(zip(got, want, emu_calls, cpu_calls)):
            assert torch.equal(b[0], a[0]) and torch.equal(b[4], a[4]), (step, i)
            assert torch.equal(ce[18], cc[18]) and torch.equal(ce[18], cc[0][:, :1]), (step, i)
            for s1, s2 in zip(ce[3:6] + (ce[12],), cc[3:6] + (cc[12],)):
                assert torch.equal(s1, s2), (step, i)
    n = emu_calls[0][0].numel()
    restore = [(b[0], b[1], b[2], c[9], c[1], c[2], torch.full((n,), float("nan"), dtype=dtype), c[18])
               for b, c in zip(got, emu_calls)]
    before = emu.launches()
    outs = emu.dequantize_out_many_cuda(restore)
    assert emu.launches() - before == 1
    for out, args in zip(outs, restore):
        want = cpu.dequantize_out_cpu(*args[:6], torch.empty(n, dtype=dtype), args[7])
        assert torch.equal(out, want)


def test_many_ops_fall_back_to_one_call_at_a_time(emu, cpu):
    """Calls that cannot share a launch still give each call's result: a state shared by two
    calls (the second finalize must see the first's update), mixed dtypes, more than 3 calls."""
    emu_calls, cpu_calls = _qkv_calls(torch.float32)
    shared = list(emu_calls[1][3:6])
    cshared = list(cpu_calls[1][3:6])
    emu_calls[2] = emu_calls[2][:3] + tuple(shared) + emu_calls[2][6:]
    cpu_calls[2] = cpu_calls[2][:3] + tuple(cshared) + cpu_calls[2][6:]
    half, chalf = _qkv_calls(torch.float16, seed=1)
    for ecalls, ccalls, launches in ((emu_calls, cpu_calls, 3), (emu_calls[:2] + half[:1], cpu_calls[:2] + chalf[:1], 3),
                                     (emu_calls + half[:1], cpu_calls + chalf[:1], 4)):
        before = emu.launches()
        got = emu.quantize_step_many_cuda(ecalls)
        assert emu.launches() - before == launches
        for b, c in zip(got, ccalls):
            a = cpu.quantize_step_cpu(*c)
            assert torch.equal(b[0], a[0]) and torch.equal(b[4], a[4])
    restore = [(b[0], b[1], b[2], c[9], c[1], c[2], torch.empty(c[0].numel(), dtype=c[0].dtype), None)
               for b, c in zip(got, emu_calls + half[:1])]
    before = emu.launches()
    emu.dequantize_out_many_cuda(restore)
    assert emu.launches() - before == 4
    with pytest.raises(RuntimeError, match="19 arguments"):
        emu.quantize_step_many_cuda([emu_calls[0][:5]])


def test_gpu_self_check_stage_on_the_emulated_kernels(emu, monkeypatch):
    """scripts/cuda_check.sh's selfcheck stage (benchmarks.gpu.self_check_all: every dtype x
    bits, one at a time against the reference and three in one launch against one at a time)
    on the emulated CUDA kernels: no case differs, and both checks print a line per case."""
    from benchmarks import gpu

    be = backend._Extension(emu, "cuda")
    monkeypatch.setattr(backend, "get_backend", lambda t, name=None: be)
    lines = []
    assert gpu.self_check_all("cpu", printer=lines.append) == 0
    assert len(lines) == 24 and sum("3 in one launch: identical" in s for s in lines) == 12
