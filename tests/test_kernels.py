"""The quantizer kernels (cuda/quant_cpu.cpp, cuda/quant_cuda.cu) against their specification, the
pure-PyTorch reference in mesa_ops/reference.py, and the properties the method relies on.

* C++ kernel == reference, bit for bit, for the same seed: every bit width (8, 4, 2 and the 1-bit
  ReLU mask), stochastic and nearest rounding, fp32/fp16/bf16/fp64 inputs, odd sizes (numel not a
  multiple of 8 or 4, numel < 8, one element, sizes crossing the 4096-element CPU tile) and group
  layouts (G=1, G=C, inner=1, groups crossing tiles); group_minmax == reference (NaN/Inf flagged).
* same seed -> same codes, different seed -> different codes; packing density; one-step error;
  clamping (no wraparound); unbiased stochastic rounding.
* MESA_BACKEND selection and its errors.
* CUDA kernels == CPU kernels (needs a GPU; skipped otherwise), and the CUDA extension compiles
  with nvcc on a machine without a GPU (skipped only when nvcc is absent).
"""
from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import mesa_ops as ms
from mesa_ops import backend, reference

ALL_BITS = (8, 4, 2, 1)
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

# (numel, G, inner): the tensor is viewed as (numel // (G*inner), G, inner)
LAYOUTS = {
    "one-element": (1, 1, 1),
    "n<8": (7, 1, 7),
    "n=13,odd": (13, 1, 13),
    "inner=1,G=3": (9, 3, 1),
    "G=C,inner=1": (6 * 40, 40, 1),  # (B=6, C=40), one group per channel
    "tile+1": (4097, 1, 4097),  # crosses the 4096-element tile boundary
    "G=3,groups-cross-tiles": (2 * 3 * 1367, 3, 1367),  # 8202 elements, runs straddle tiles
    "BCHW,G=C": (2 * 6 * 5 * 7, 6, 35),  # (2, 6, 5, 7) maps, one group per channel
}


def _input(numel: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.randn(numel) * 3 + 0.5).to(dtype)


def _params(x: torch.Tensor, groups: int, inner: int, bits: int):
    """(inv, step, shift) of a running range that covers the middle 80% of each group's batch
    range, so ~10% of the values at each end lie outside it and exercise the clamping."""
    if bits == 1:  # the mask ignores scale/shift; dequantized as q * 1 + 0
        one, zero = torch.ones(groups), torch.zeros(groups)
        return one, one.clone(), zero
    mm = reference.group_minmax(x, groups, inner)
    rng = (mm[1] - mm[0]).clamp_min(1e-8)
    lo = (mm[0] + 0.1 * rng).contiguous()
    rng = (0.8 * rng).clamp_min(1e-8)
    levels = float((1 << bits) - 1)
    return (levels / rng).contiguous(), (rng / levels).contiguous(), lo


def _nbytes(numel: int, bits: int) -> int:
    return math.ceil(numel * bits / 8)


# ---- kernel == reference, bit for bit --------------------------------------------------------
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_cpp_quantize_dequantize_equal_reference(cpp_backend, ref_backend, dtype, layout):
    n, g, inner = LAYOUTS[layout]
    x = _input(n, dtype)
    seed = 0x1234_5678_9ABC  # > 2^32: both 32-bit words of the seed are used
    for bits in ALL_BITS:
        inv, step, shift = _params(x, g, inner, bits)
        for stochastic in (True, False):
            pc = cpp_backend.quantize(x, inv, shift, bits, g, inner, seed, stochastic)
            pr = ref_backend.quantize(x, inv, shift, bits, g, inner, seed, stochastic)
            assert pc.dtype == torch.uint8 and pc.numel() == _nbytes(n, bits)
            assert torch.equal(pc, pr), (
                f"{bits}-bit stochastic={stochastic}: {(pc != pr).sum()} of {pc.numel()} bytes differ")
            dc = cpp_backend.dequantize(pc, step, shift, bits, g, inner, n, dtype)
            dr = ref_backend.dequantize(pc, step, shift, bits, g, inner, n, dtype)
            assert dc.dtype == dtype and dc.shape == (n,)
            assert torch.equal(dc, dr), f"{bits}-bit dequantize differs"


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_cpp_group_minmax_equals_reference(cpp_backend, ref_backend, dtype, layout):
    n, g, inner = LAYOUTS[layout]
    x = _input(n, dtype)
    mc = cpp_backend.group_minmax(x, g, inner)
    mr = ref_backend.group_minmax(x, g, inner)
    assert mc.shape == (2, g) and mc.dtype == torch.float32
    assert torch.equal(mc, mr)
    # and it is the true per-group min/max of the (outer, G, inner) view
    v = x.float().view(-1, g, inner)
    assert torch.equal(mc[0], v.amin(dim=(0, 2))) and torch.equal(mc[1], v.amax(dim=(0, 2)))


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16),
                         ids=lambda d: str(d).replace("torch.", ""))
def test_group_minmax_flags_nan_and_inf(cpp_backend, ref_backend, dtype):
    g, inner = 4, 1500  # 2 * 4 * 1500 = 12000 elements, spread over several threads' chunks
    x = torch.randn(2, g, inner).to(dtype)
    x[1, 0, 7] = float("-inf")
    x[0, 1, 1499] = float("nan")
    x[1, 2, 0] = float("inf")  # group 3 stays finite
    for be in (cpp_backend, ref_backend):
        mm = be.group_minmax(x.reshape(-1), g, inner)
        assert torch.isnan(mm[:, :3]).all(), f"{be.name}: non-finite groups not flagged: {mm}"
        assert torch.isfinite(mm[:, 3]).all()
        assert mm[0, 3] == x[:, 3].float().min() and mm[1, 3] == x[:, 3].float().max()


def _state(groups):
    return torch.ones(groups), torch.zeros(groups), torch.zeros(1)


@pytest.mark.parametrize("layout", ["inner=1,G=3", "G=C,inner=1", "G=3,groups-cross-tiles"])
def test_cpp_range_update_equals_reference(cpp_backend, ref_backend, layout):
    """The fused running-range update (first step: the batch's range; then EMA; batch mode;
    update=False; a non-finite batch leaves the state alone) and its (4, G) output rows
    inv, step, shift, finite, bit for bit against the reference."""
    n, g, inner = LAYOUTS[layout]
    states = {be.name: _state(g) for be in (cpp_backend, ref_backend)}
    batches = [(_input(n, torch.float32) * s, mode, upd) for s, mode, upd in
               ((1.0, False, True), (2.5, False, True), (0.3, False, False), (0.7, True, True),
                (1.5, False, True))]
    bad = _input(n, torch.float32)
    bad[n // 2] = float("nan")
    batches.append((bad, False, True))
    for step, (x, batch_mode, update) in enumerate(batches):
        outs = {}
        for be in (cpp_backend, ref_backend):
            clip, shift, it = states[be.name]
            outs[be.name] = be.range_update(x, g, inner, clip, shift, it, 0.9, 1.0 - 0.9,
                                            batch_mode, 4, update)
        a, b = outs["cpu"], outs["torch"]
        assert a.shape == (4, g) and a.dtype == torch.float32
        assert torch.equal(a, b), f"step {step}: outputs differ\n{a}\n{b}"
        for sa, sb in zip(states["cpu"], states["torch"]):
            assert torch.equal(sa, sb), f"step {step}: state differs"
    clip, shift, it = states["cpu"]
    assert float(it) == 4  # the update=False and the NaN step did not count
    assert torch.isfinite(clip).all() and torch.isfinite(shift).all()
    assert (outs["cpu"][3] == 0).sum() == 1  # exactly the group holding the NaN is flagged
    torch.testing.assert_close(outs["cpu"][0] * outs["cpu"][1], torch.ones(g), rtol=1e-6, atol=0)


# ---- seeds -----------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", (8, 4, 2))
def test_same_seed_same_codes_different_seed_different_codes(cpp_backend, ref_backend, bits):
    n, g, inner = 5000, 1, 5000
    x = _input(n, torch.float32)
    inv, _, shift = _params(x, g, inner, bits)
    for be in (cpp_backend, ref_backend):
        a = be.quantize(x, inv, shift, bits, g, inner, 42, True)
        b = be.quantize(x, inv, shift, bits, g, inner, 42, True)
        c = be.quantize(x, inv, shift, bits, g, inner, 43, True)
        d = be.quantize(x, inv, shift, bits, g, inner, 42 + (1 << 32), True)  # high word only
        assert torch.equal(a, b)
        codes = [reference.unpack_codes(p, bits, n) for p in (a, c, d)]
        # a different seed changes a sizeable fraction of the codes (each code moves by at most 1)
        for other in codes[1:]:
            diff = (codes[0] - other).abs()
            assert diff.max() <= 1 and (diff > 0).float().mean() > 0.1, be.name
        # round-to-nearest does not depend on the seed at all
        assert torch.equal(be.quantize(x, inv, shift, bits, g, inner, 1, False),
                           be.quantize(x, inv, shift, bits, g, inner, 2, False))


def test_seed_follows_torch_generator_without_drawing_from_it():
    """A seed hashes torch's generator state (torch.manual_seed fixes it), the layer's salt and
    draw count; reading the state draws nothing, so torch's stream is untouched."""
    from mesa_ops import ops

    torch.manual_seed(7)
    state = torch.get_rng_state()
    s1 = ops.make_seed(5, 0)
    assert torch.equal(torch.get_rng_state(), state)  # nothing drawn
    torch.manual_seed(7)
    assert ops.make_seed(5, 0) == s1
    assert len({s1, ops.make_seed(5, 1), ops.make_seed(6, 0)}) == 3
    torch.rand(1)  # torch's stream moved on: another seed
    assert ops.make_seed(5, 0) != s1
    torch.manual_seed(8)
    assert ops.make_seed(5, 0) != s1


def test_cpp_generator_fingerprint_is_zlib_crc32_of_the_state(cpp_backend):
    """The kernel's hash of torch's generator state == ops.torch_fingerprint (zlib.crc32 of the
    first 64 get_state() bytes, which the kernel reads from the engine), before and after draws
    of every size: within one Mersenne-Twister block (the position changes) and across blocks
    (the state words change); a new seed changes it too."""
    import zlib

    from mesa_ops import backend, ops

    fp = backend._cpu_extension().generator_fingerprint_cpu
    torch.manual_seed(3)
    seen = set()
    for draw in (0, 1, 1, 7, 700, 1000, 5000, 1):
        torch.rand(draw) if draw % 2 else torch.randn(draw)
        head = torch.get_rng_state()[:ops.FINGERPRINT_BYTES].numpy().tobytes()
        assert fp() == ops.torch_fingerprint() == zlib.crc32(head)
        seen.add(fp())
    assert len(seen) == 8  # eight states: the seeded one, then one after each draw
    torch.manual_seed(4)
    assert fp() not in seen


def test_uniform_noise_is_uniform():
    u = reference.uniform_noise(123, 1 << 16)
    assert u.dtype == torch.float32 and u.min() >= 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.005  # std of the mean is 0.29/256 = 1.1e-3
    hist = torch.histc(u, bins=16, min=0, max=1) / u.numel()
    assert (hist - 1 / 16).abs().max() < 0.01  # each bin ~ 4096 +- 61 samples


# ---- packing, error, clamping, bias ----------------------------------------------------------
@pytest.mark.parametrize("n", (1, 3, 7, 8, 9, 4095, 4096, 4097, 8193))
def test_packed_sizes(cpp_backend, n):
    x = _input(n, torch.float32)
    for bits, per_byte in ((8, 1), (4, 2), (2, 4), (1, 8)):
        inv, _, shift = _params(x, 1, n, bits)
        p = cpp_backend.quantize(x, inv, shift, bits, 1, n, 0, True)
        assert p.numel() == (n + per_byte - 1) // per_byte, f"{bits}-bit, n={n}"


def test_packing_layout_low_bits_first(cpp_backend, ref_backend):
    """Codes are packed low bits first: 4-bit byte k = c[2k] | c[2k+1] << 4, and so on."""
    one, zero = torch.ones(1), torch.zeros(1)
    for bits in (8, 4, 2):
        levels = (1 << bits) - 1
        codes = torch.arange(11) % (levels + 1)
        x = codes.float()  # inv = 1, shift = 0, nearest: code == x exactly
        per = 8 // bits
        expect = torch.zeros(math.ceil(11 / per), dtype=torch.int64)
        for e, c in enumerate(codes.tolist()):
            expect[e // per] |= c << ((e % per) * bits)
        for be in (cpp_backend, ref_backend):
            p = be.quantize(x, one, zero, bits, 1, 11, 0, False)
            assert p.tolist() == expect.tolist(), f"{be.name} {bits}-bit"
    mask_src = torch.tensor([1.0, -1.0, 0.0, 2.0, 0.5, -3.0, 0.0, 1e-30, 4.0])
    for be in (cpp_backend, ref_backend):  # the 1-bit mask is x > 0
        p = be.quantize(mask_src, one, zero, 1, 1, 9, 0, False)
        assert p.tolist() == [0b10011001, 0b1]


@pytest.mark.parametrize("bits", (8, 4, 2))
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16),
                         ids=lambda d: str(d).replace("torch.", ""))
def test_dequantized_within_one_step(cpp_backend, bits, dtype):
    g, inner = 4, 2000
    x = _input(g * inner, dtype)
    mm = reference.group_minmax(x, g, inner)  # the full batch range: nothing clamps
    levels = float((1 << bits) - 1)
    rng = mm[1] - mm[0]
    inv, step, shift = (levels / rng).contiguous(), (rng / levels).contiguous(), mm[0].contiguous()
    gi = reference.group_index(x.numel(), g, inner, "cpu")
    xf = x.float()
    # dequantized in fp32 so the bound is not blurred by the output rounding of fp16/bf16
    tol = 1e-5 * xf.abs().max()
    for stochastic, bound in ((True, 1.0), (False, 0.5)):
        p = cpp_backend.quantize(x, inv, shift, bits, g, inner, 5, stochastic)
        xh = cpp_backend.dequantize(p, step, shift, bits, g, inner, x.numel(), torch.float32)
        err = (xh - xf).abs()
        assert (err <= bound * step[gi] + tol).all(), (
            f"stochastic={stochastic}: max error {(err / step[gi]).max():.3f} steps > {bound}")
        # and every dequantized value is one of the grid points inside [min, max]
        assert (xh >= mm[0][gi] - tol).all() and (xh <= mm[1][gi] + tol).all()


@pytest.mark.parametrize("bits", (8, 4, 2))
def test_out_of_range_values_clamp_without_wraparound(cpp_backend, ref_backend, bits):
    """Values beyond the running range get code 0 / 2^b-1 (the original Mesa lacked the upper
    clamp: (x - shift) * inv = 300 would have wrapped to code 44 at 8 bits)."""
    levels = (1 << bits) - 1
    inv, shift = torch.tensor([float(levels)]), torch.tensor([0.0])  # running range [0, 1]
    step = torch.tensor([1.0 / levels])
    x = torch.tensor([-1e6, -5.0, -0.6, 0.0, 1.0, 1.2, 300.0 / levels, 7.0, 1e6, 1e30])
    expect = [0, 0, 0, 0, levels, levels, levels, levels, levels, levels]
    for be in (cpp_backend, ref_backend):
        for stochastic in (True, False):
            p = be.quantize(x, inv, shift, bits, 1, x.numel(), 99, stochastic)
            codes = reference.unpack_codes(p, bits, x.numel())
            assert codes.tolist() == expect, f"{be.name} stochastic={stochastic}: {codes.tolist()}"
            xh = be.dequantize(p, step, shift, bits, 1, x.numel(), x.numel(), torch.float32)
            assert xh.min() >= 0.0 and xh.max() <= 1.0 + 1e-6


@pytest.mark.parametrize("bits", (8, 4, 2))
def test_stochastic_rounding_is_unbiased(cpp_backend, bits):
    """Mean over 4 x 2^16 stochastic dequantizations of a constant c that sits 0.3 steps above a
    grid point equals c within 5e-4 * range (the standard deviation of the mean is
    0.46 step / 512, i.e. <= 6e-4 steps; the bound is > 5 of those at every bit width).
    Round-to-nearest, by contrast, is off by the full 0.3 step, which this bound rejects."""
    levels = float((1 << bits) - 1)
    n = 1 << 16
    shift, rng = torch.tensor([-0.25]), torch.tensor([1.0])
    inv, step = levels / rng, rng / levels
    c = float(shift + (round(levels / 3) + 0.3) * step)
    x = torch.full((n,), c)
    means = []
    for seed in (1, 2, 3, 4):
        p = cpp_backend.quantize(x, inv, shift, bits, 1, n, seed, True)
        means.append(cpp_backend.dequantize(p, step, shift, bits, 1, n, n, torch.float64).mean())
    mean = float(torch.stack(means).mean())
    assert abs(mean - c) < 5e-4, f"{bits}-bit stochastic mean {mean} vs {c}"
    p = cpp_backend.quantize(x, inv, shift, bits, 1, n, 1, False)
    nearest = float(cpp_backend.dequantize(p, step, shift, bits, 1, n, n, torch.float64).mean())
    assert abs(nearest - c) == pytest.approx(0.3 * float(step), rel=1e-4)


def test_kernel_argument_checks(cpp_backend):
    x = torch.randn(16)
    one, zero = torch.ones(1), torch.zeros(1)
    with pytest.raises(RuntimeError, match="bits"):
        cpp_backend.quantize(x, one, zero, 3, 1, 16, 0, True)
    with pytest.raises(RuntimeError, match="multiple"):
        cpp_backend.quantize(x, torch.ones(3), torch.zeros(3), 8, 3, 5, 0, True)
    with pytest.raises(RuntimeError, match="bytes"):
        cpp_backend.dequantize(torch.zeros(3, dtype=torch.uint8), one, zero, 4, 1, 16, 16,
                               torch.float32)


@pytest.mark.parametrize("bits", (8, 4))
def test_cpp_reads_strided_inputs_in_place(cpp_backend, ref_backend, bits):
    """q of a fused (B, N, 3C) qkv projection (rows of C with stride 3C) and a transposed
    tensor give the codes and min/max of their contiguous copies (the first without a copy)."""
    qkv = torch.randn(3, 37, 3 * 48) * 2
    for x, g, inner in ((qkv[..., :48], 1, 48), (qkv[..., 48:96], 4, 12),
                        (torch.randn(40, 24).t(), 1, 40)):
        xc = x.contiguous()
        mm = ref_backend.group_minmax(xc, g, inner)
        assert torch.equal(cpp_backend.group_minmax(x, g, inner), mm)
        inv = (((1 << bits) - 1) / (mm[1] - mm[0])).contiguous()
        sh = mm[0].contiguous()
        for stochastic in (True, False):
            assert torch.equal(cpp_backend.quantize(x, inv, sh, bits, g, inner, 77, stochastic),
                               ref_backend.quantize(xc, inv, sh, bits, g, inner, 77, stochastic))


@pytest.mark.parametrize("layout", ("q-of-qkv", "contiguous"))
def test_cpp_quantize_step_equals_range_update_then_quantize(cpp_backend, ref_backend, layout):
    """The one-call CPU path (range update + quantize) == reference range_update, then reference
    quantize with its rows and the seed ops.make_seed gives for the draw counter: same state,
    rows, codes, counter advanced once per update; a non-finite group is flagged and, with
    mark_nonfinite, gets a NaN shift."""
    from mesa_ops import ops

    qkv = torch.randn(2, 29, 3 * 32)
    x = qkv[..., :32] if layout == "q-of-qkv" else torch.randn(2, 29, 32)
    g, inner = 4, 8
    draws = torch.tensor([5], dtype=torch.int64)
    salt = 1234
    for step in range(3):
        st1 = [torch.ones(g), torch.zeros(g), torch.full((1,), float(step))]
        st2 = [t.clone() for t in st1]
        seed = ops.make_seed(salt, 5 + step)
        prefix = ops.signed64(ops.seed_prefix(salt))
        packed, stp, sh, finite, rows = cpp_backend.quantize_step(
            x, g, inner, *st1, 0.9, 0.1, False, 8, True, prefix, draws, True, True)
        assert int(draws[0]) == 6 + step
        ref = ref_backend.range_update(x.contiguous(), g, inner, *st2, 0.9, 0.1, False, 8, True)
        assert finite and torch.equal(rows, ref)
        assert torch.equal(stp, ref[1]) and torch.equal(sh, ref[2])
        assert all(torch.equal(a, b) for a, b in zip(st1, st2))
        assert torch.equal(packed, ref_backend.quantize(x.contiguous(), ref[0], ref[2], 8, g,
                                                        inner, seed, True))
    # a recomputation (update=False) neither moves the state nor the counter
    cpp_backend.quantize_step(x, g, inner, *st1, 0.9, 0.1, False, 8, False, prefix, draws, True,
                              True)
    assert int(draws[0]) == 8 and all(torch.equal(a, b) for a, b in zip(st1, st2))
    # prefix_of_mix: the kernel hashes torch's generator state with ops.salt_mix itself, as
    # ops.seed_prefix does (also after torch's stream moved on), and draws nothing from it
    for _ in range(2):
        state = torch.get_rng_state()
        outs = []
        for key, of_mix in ((ops.signed64(ops.seed_prefix(salt)), False),
                            (ops.signed64(ops.salt_mix(salt)), True)):
            d = torch.tensor([5], dtype=torch.int64)
            outs.append(cpp_backend.quantize_step(x, g, inner, torch.ones(g), torch.zeros(g),
                                                  torch.zeros(1), 0.9, 0.1, False, 8, True, key,
                                                  d, True, True, of_mix)[0])
        assert torch.equal(outs[0], outs[1]) and torch.equal(torch.get_rng_state(), state)
        torch.rand(7)
    bad = x.contiguous().clone()
    bad[0, 0, 9] = float("nan")  # group 1
    _, _, sh, finite, rows = cpp_backend.quantize_step(
        bad, g, inner, torch.ones(g), torch.zeros(g), torch.ones(1), 0.9, 0.1, False, 8, True, 1,
        draws, True, True)
    assert not finite and rows[3].tolist() == [1.0, 0.0, 1.0, 1.0]
    assert torch.isnan(rows[2, 1]) and torch.isfinite(rows[2, [0, 2, 3]]).all()
    assert torch.isnan(sh[1]) and torch.equal(sh[[0, 2, 3]], rows[2, [0, 2, 3]])


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("layout", ("strided", "contiguous"))
def test_cpp_quantize_step_normalizes_rows_as_the_reference(cpp_backend, ref_backend, dtype, layout):
    """A LayerNorm's x-hat: quantize_step with row_mean/row_rstd (the kernel normalizes while it
    reads x) gives the state, rows and codes of quantize_step on (x.float() - mean) * rstd computed
    by torch first, bit for bit (odd row length, 1 and 3 groups, 8/4/2 bits); bad statistics are
    refused by name."""
    base = torch.randn(3, 23, 2 * 36, dtype=dtype) * 3 + 5
    x = base[..., :36] if layout == "strided" else base[..., :36].contiguous()
    var, mean = torch.var_mean(x.float(), dim=-1, correction=0, keepdim=True)
    rstd = torch.rsqrt(var + 1e-5)
    xhat = torch.sub(x.float(), mean).mul_(rstd)
    for g, inner in ((1, 36), (3, 12)):
        for bits in (8, 4, 2):
            outs = []
            for arg, norm in ((x, (mean.reshape(-1), rstd.reshape(-1))), (xhat, ())):
                st = [torch.ones(g), torch.zeros(g), torch.zeros(1)]
                draws = torch.tensor([3], dtype=torch.int64)
                r = cpp_backend.quantize_step(arg, g, inner, *st, 0.9, 0.1, False, bits, True, 99,
                                              draws, True, False, False, *norm)
                outs.append((r, st))
            (r1, st1), (r2, st2) = outs
            assert all(torch.equal(a, b) for a, b in zip(st1, st2)), (g, bits)
            assert torch.equal(r1[4], r2[4]) and torch.equal(r1[0], r2[0]), (g, bits)
    with pytest.raises(RuntimeError, match="whole number of groups"):
        cpp_backend.quantize_step(x, 3, 12, torch.ones(3), torch.zeros(3), torch.zeros(1), 0.9,
                                  0.1, False, 8, True, 1, torch.zeros(1, dtype=torch.int64), True,
                                  False, False, torch.zeros(3 * 23 * 2), torch.ones(3 * 23 * 2))
    with pytest.raises(RuntimeError, match="one value per row"):
        cpp_backend.quantize_step(x, 1, 36, torch.ones(1), torch.zeros(1), torch.zeros(1), 0.9,
                                  0.1, False, 8, True, 1, torch.zeros(1, dtype=torch.int64), True,
                                  False, False, torch.zeros(5), torch.ones(5))


# ---- backend selection ----------------------------------------------------------------------
def test_mesa_backend_env_var(monkeypatch, no_forced_backend, cpp_backend):
    t = torch.zeros(3)
    assert backend.get_backend(t).name == "cpu"  # default for a CPU tensor: the C++ kernel
    monkeypatch.setenv("MESA_BACKEND", "torch")
    assert backend.get_backend(t).name == "torch"
    monkeypatch.setenv("MESA_BACKEND", " CPP ")  # case and spaces are ignored
    assert backend.get_backend(t).name == "cpu"
    assert backend.get_backend(t, "torch").name == "torch"  # an explicit name wins
    monkeypatch.setenv("MESA_BACKEND", "triton")
    with pytest.raises(ValueError, match="MESA_BACKEND"):
        backend.get_backend(t)
    monkeypatch.setenv("MESA_BACKEND", "cuda")
    with pytest.raises(backend.BackendUnavailable):
        backend.get_backend(t)


def test_layer_gradients_identical_on_torch_and_cpp_backends(monkeypatch, cpp_backend):
    """End to end through a layer: the reference and the C++ kernel give the same bits."""
    grads = {}
    for name in ("torch", "cpp"):
        monkeypatch.setenv("MESA_BACKEND", name)
        torch.manual_seed(3)
        layer = ms.Linear(40, 24, quant_groups=4, bits=4, enable=True)
        layer.layer_name = "fc"  # (an unnamed layer's stream is salted by its construction number)
        x = torch.randn(3, 7, 40, requires_grad=True)
        layer(x).square().sum().backward()
        grads[name] = (layer.weight.grad.clone(), layer.clip_val.clone())
    assert torch.equal(grads["torch"][0], grads["cpp"][0])
    assert torch.equal(grads["torch"][1], grads["cpp"][1])


# ---- CUDA ------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_cuda_kernels_equal_cpu(cuda_backend, cpp_backend, dtype, layout):
    n, g, inner = LAYOUTS[layout]
    x = _input(n, dtype)
    xc = x.cuda()
    assert torch.equal(cuda_backend.group_minmax(xc, g, inner).cpu(),
                       cpp_backend.group_minmax(x, g, inner))
    for bits in ALL_BITS:
        inv, step, shift = _params(x, g, inner, bits)
        dev = [t.cuda() for t in (inv, step, shift)]
        for stochastic in (True, False):
            p = cpp_backend.quantize(x, inv, shift, bits, g, inner, 77, stochastic)
            pc = cuda_backend.quantize(xc, dev[0], dev[2], bits, g, inner, 77, stochastic)
            assert torch.equal(pc.cpu(), p), f"{bits}-bit stochastic={stochastic}"
            d = cpp_backend.dequantize(p, step, shift, bits, g, inner, n, dtype)
            dc = cuda_backend.dequantize(pc, dev[1], dev[2], bits, g, inner, n, dtype)
            assert torch.equal(dc.cpu(), d), f"{bits}-bit dequantize"


@pytest.mark.cuda
@pytest.mark.parametrize("layout", ["inner=1,G=3", "G=3,groups-cross-tiles"])
def test_cuda_range_update_equals_cpu(cuda_backend, cpp_backend, layout):
    n, g, inner = LAYOUTS[layout]
    cpu_state = _state(g)
    gpu_state = tuple(t.cuda() for t in _state(g))
    for scale, batch_mode in ((1.0, False), (2.0, False), (0.5, True)):
        x = _input(n, torch.float32) * scale
        a = cpp_backend.range_update(x, g, inner, *cpu_state, 0.9, 1.0 - 0.9, batch_mode, 8, True)
        b = cuda_backend.range_update(x.cuda(), g, inner, *gpu_state, 0.9, 1.0 - 0.9, batch_mode, 8,
                                      True)
        assert torch.equal(b.cpu(), a)
        for sa, sb in zip(cpu_state, gpu_state):
            assert torch.equal(sb.cpu(), sa)


@pytest.mark.cuda
def test_cuda_group_minmax_flags_nan(cuda_backend):
    x = torch.randn(2, 4, 100, device="cuda")
    x[0, 1, 3] = float("nan")
    x[1, 2, 5] = float("inf")
    mm = cuda_backend.group_minmax(x.reshape(-1), 4, 100)
    assert torch.isnan(mm[:, 1:3]).all() and torch.isfinite(mm[:, [0, 3]]).all()


def _nvcc() -> str | None:
    for p in ("/usr/local/cuda/bin/nvcc", shutil.which("nvcc")):
        if p and os.path.exists(p):
            return p
    return None


CUDA_OPS = ("quantize_cuda", "dequantize_cuda", "dequantize_out_cuda", "lut_apply_out_cuda",
            "levels_cuda", "group_minmax_cuda", "range_update_cuda", "quantize_step_cuda",
            "generator_fingerprint_cuda", "quantize_cpu", "register_ops")


def _toolkit_mismatch() -> str | None:
    nvcc = _nvcc()
    return None if nvcc is None else backend.toolkit_mismatch(os.path.dirname(os.path.dirname(nvcc)))


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found (neither /usr/local/cuda/bin/nvcc "
                    "nor on PATH): cannot compile the CUDA extension")
def test_cuda_extension_compiles_without_gpu(tmp_path):
    """nvcc builds cuda/quant_cuda.cu for sm_90 here (no GPU needed) with CUDA_HOME left unset,
    as a user's environment has it (here the nvcc on PATH is a wrapper script in /usr/local/bin,
    from which torch alone guesses CUDA_HOME=/usr/local and fails to link -lcudart); the module
    imports and exposes every CUDA op. Takes ~1-3 min (a fresh build directory: no cache).
    Skipped where the toolkit's CUDA major is not the one torch was built with (torch 2.8's
    CUDA 12.8 wheel beside nvcc 13): that case is test_toolkit_mismatch_is_named's."""
    if _toolkit_mismatch():
        pytest.skip(_toolkit_mismatch())
    env = dict(os.environ, TORCH_CUDA_ARCH_LIST="9.0", MAX_JOBS=os.environ.get("MAX_JOBS", "2"))
    for k in ("MESA_BACKEND", "CUDA_HOME", "CUDA_PATH"):
        env.pop(k, None)
    code = textwrap.dedent(f"""
        import mesa_ops.backend as B
        m = B.build_extension("cuda", build_directory={str(tmp_path / 'build')!r})
        print("WITH_CUDA", m.with_cuda, "EMULATED", m.emulated)
        for f in {CUDA_OPS!r}:
            print("HAS", f, hasattr(m, f))
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                          text=True, timeout=900)
    log = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"CUDA extension build failed:\n{log}"
    assert "WITH_CUDA True EMULATED False" in proc.stdout, log
    for f in CUDA_OPS:
        assert f"HAS {f} True" in proc.stdout, log
    assert "No CUDA runtime is found" not in proc.stderr, log  # torch's import-time warning
    assert proc.stderr.count("building Mesa's CUDA kernels once") == 1, log


def test_cuda_home_skips_a_wrapper_without_the_runtime(tmp_path):
    """CUDA_HOME resolution: a set $CUDA_HOME wins; else the first candidate with bin/nvcc and
    libcudart; an nvcc wrapper whose parent folder has no runtime (torch's guess: /usr/local)
    is passed over for the toolkit the wrapper's symlink or the default folder leads to."""
    kit = tmp_path / "cuda-13.0"
    (kit / "bin").mkdir(parents=True)
    (kit / "bin" / "nvcc").write_text("")
    (kit / "lib64").mkdir()
    (kit / "lib64" / "libcudart.so.13").write_text("")
    wrapper_home = tmp_path / "usr_local"
    (wrapper_home / "bin").mkdir(parents=True)
    (wrapper_home / "bin" / "nvcc").write_text("#!/bin/sh\nexec nvcc-real \"$@\"\n")
    which = lambda _: str(wrapper_home / "bin" / "nvcc")  # noqa: E731
    assert backend.cuda_home({}, which, defaults=(str(kit),)) == str(kit)
    assert backend.cuda_home({}, which, defaults=(str(tmp_path / "none"),)) is None
    link = tmp_path / "bin"
    link.mkdir()
    (link / "nvcc").symlink_to(kit / "bin" / "nvcc")
    assert backend.cuda_home({}, lambda _: str(link / "nvcc"), defaults=()) == str(kit)
    assert backend.cuda_home({"CUDA_HOME": "/opt/x"}, which) == "/opt/x"


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("bits", (8, 4, 2))
def test_cpp_table_lookup_equals_reference(cpp_backend, bits, dtype):
    """table[group][code] (times mul) of packed codes: the C++ kernel == reference.lut_apply bit
    for bit (odd sizes, groups that split rows), and a table of the levels themselves is the
    plain dequantization."""
    torch.manual_seed(bits)
    g, inner, outer = 3, 7, 11
    n = outer * g * inner
    x = torch.randn(n)
    st = [torch.ones(g), torch.zeros(g), torch.zeros(1)]
    rows = reference.range_update(x, g, inner, *st, 0.9, 0.1, False, bits, True)
    packed = reference.quantize(x, rows[0], rows[2], bits, g, inner, 5, True)
    levels = reference.levels(rows[1], rows[2], bits, dtype)
    assert levels.shape == (g, 1 << bits) and levels.dtype == dtype
    assert torch.equal(cpp_backend.levels(rows[1], rows[2], bits, dtype), levels)
    deq = reference.dequantize(packed, rows[1], rows[2], bits, g, inner, n, dtype)
    out = cpp_backend.lut_apply_out(packed, levels, bits, g, inner, torch.empty(n, dtype=dtype))
    assert torch.equal(out, deq)
    table = torch.nn.functional.gelu(levels.float()).to(dtype)
    mul = torch.randn(n).to(dtype)
    for m in (None, mul):
        got = cpp_backend.lut_apply_out(packed, table, bits, g, inner, torch.empty(n, dtype=dtype), m)
        assert torch.equal(got, reference.lut_apply(packed, table, bits, g, inner, n, m))
    with pytest.raises(RuntimeError, match="table must be"):
        cpp_backend.lut_apply_out(packed, table[:, :2].contiguous(), bits, g, inner,
                                  torch.empty(n, dtype=dtype))


def test_failed_cuda_build_warns_once_then_reference(monkeypatch):
    """Issue 21 defect 3: a failed CUDA build is tried once per process; every later call gets
    the torch reference (which runs on CUDA tensors) after one warning; MESA_BACKEND=cuda raises."""
    calls = []

    def failing(kind, **kwargs):
        calls.append(kind)
        raise RuntimeError("nvcc: simulated failure")

    monkeypatch.setattr(backend, "build_extension", failing)
    backend.clear_caches()
    try:
        with pytest.warns(RuntimeWarning, match="building the CUDA kernels failed"):
            first = backend._extension_backend("cuda")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            again = [backend._cuda_backend(False) for _ in range(3)]
        assert first is backend._REFERENCE and all(b is backend._REFERENCE for b in again)
        assert calls == ["cuda"]
        with pytest.raises(backend.BackendUnavailable, match="simulated failure"):
            backend._cuda_backend(True)
    finally:
        backend.clear_caches()


def test_toolkit_mismatch_is_named(tmp_path):
    """nvcc of another CUDA major than torch's: the build is refused up front with what to do
    (not nvcc's "CUDA compiler and CUDA toolkit headers are incompatible" deep in a ninja log)."""
    why = backend.toolkit_mismatch("/opt/cuda", "12.8", version=lambda home: (13, 0))
    assert why.startswith("nvcc 13.0 (in /opt/cuda) cannot build against torch") and "CUDA 12.x" in why
    assert backend.toolkit_mismatch("/opt/cuda", "13.0", version=lambda home: (13, 0)) is None
    assert backend.toolkit_mismatch("/opt/cuda", "13.0", version=lambda home: None) is None
    assert "built without CUDA" in backend.toolkit_mismatch("/opt/cuda", "", version=lambda home: (13, 0))
    kit = tmp_path / "kit" / "bin"
    kit.mkdir(parents=True)
    (kit / "nvcc").write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.4, V12.4.131'\n")
    (kit / "nvcc").chmod(0o755)
    assert backend.nvcc_version(str(tmp_path / "kit")) == (12, 4)


def test_wheel_headers_never_shadow_the_toolkits(tmp_path):
    """The nvidia-* wheels' headers the toolkit lacks are linked in; those it has (its runtime,
    cccl: they must match nvcc) are not."""
    kit, wheel = tmp_path / "kit", tmp_path / "wheel"
    (kit / "include" / "cccl").mkdir(parents=True)
    (kit / "include" / "cuda_runtime.h").write_text("// 13.0")
    (wheel / "cccl").mkdir(parents=True)
    for name in ("cuda_runtime.h", "cublas_v2.h", "cusparse.h"):
        (wheel / name).write_text("// 13.2")
    (dirs,) = backend.missing_headers_dir(str(kit), str(tmp_path / "build"), [str(wheel)])
    assert sorted(os.listdir(dirs)) == ["cublas_v2.h", "cusparse.h"]
    assert os.readlink(os.path.join(dirs, "cublas_v2.h")) == str(wheel / "cublas_v2.h")
    assert backend.missing_headers_dir(str(kit), str(tmp_path / "b2"), [str(kit / "include")]) == []
