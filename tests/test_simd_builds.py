"""The CPU kernel's SIMD builds give the same bits.

The extension is built for the best SIMD level the CPU has (``mesa_ops.backend.cpu_simd``:
AVX-512 > AVX2 > none); on an AVX-512 machine the AVX2 loops would then only see 16-element
remainders. Here the AVX2 build (``MESA_CPU_SIMD=avx2``, its own extension name) is loaded next
to the default one and both quantize the same inputs: codes, scales, running state and min/max
must be identical (the loops are the same IEEE operations in the same order, quant_math.h).
Also: ``MESA_CPU_SIMD`` parsing and its errors.
"""
from __future__ import annotations

import pytest
import torch

from mesa_ops import backend


def test_cpu_simd_level_and_override(monkeypatch):
    monkeypatch.delenv("MESA_CPU_SIMD", raising=False)
    best = backend.cpu_simd()
    assert best in backend.SIMD_FLAGS
    assert best == ("avx512" if backend.cpu_has_avx512() else "avx2" if backend.cpu_has_avx2() else "none")
    monkeypatch.setenv("MESA_CPU_SIMD", " None ")
    assert backend.cpu_simd() == "none"
    monkeypatch.setenv("MESA_CPU_SIMD", "sse9")
    with pytest.raises(ValueError, match="MESA_CPU_SIMD='sse9': expected one of none, avx2, avx512"):
        backend.cpu_simd()
    if best != "avx512":
        monkeypatch.setenv("MESA_CPU_SIMD", "avx512")
        with pytest.raises(ValueError, match="supports up to"):
            backend.cpu_simd()


def _cases():
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    qkv = r(2, 37, 3 * 96)  # q of a fused qkv projection: rows of 96 with a stride of 288
    return [
        ("fp32, groups of 64", r(4, 50, 192), 3, 64, None),
        ("fp32, groups of 40 (16 + 16 + 8 rest)", r(3, 33, 120), 3, 40, None),
        ("fp32, odd size, one group", r(1001), 1, 1001, None),
        ("fp16", r(4, 50, 192).half(), 3, 64, None),
        ("bf16", r(4, 50, 192).bfloat16(), 3, 64, None),
        ("row-strided q", qkv[..., :96], 3, 32, None),
        ("LayerNorm rows", r(4, 50, 192) * 3 + 1, 3, 64, "norm"),
        ("non-finite", torch.cat([r(100, 64), torch.full((1, 64), float("nan"))]), 2, 32, None),
    ]


@pytest.mark.skipif(not backend.cpu_has_avx512(), reason="the CPU has no AVX-512: the default "
                    "build is the AVX2 one")
def test_avx2_and_avx512_builds_give_identical_codes(monkeypatch, cpp_backend):
    monkeypatch.delenv("MESA_CPU_SIMD", raising=False)
    assert backend.cpu_simd() == "avx512"
    monkeypatch.setenv("MESA_CPU_SIMD", "avx2")
    avx2 = backend.build_extension("cpu")  # mesa_ext_cpu_avx2 (~1 min the first time)
    assert "_avx2_" in avx2.__name__
    exts = {"avx512": backend._cpu_extension(), "avx2": avx2}
    assert "_avx512_" in exts["avx512"].__name__
    for name, x, groups, inner, norm in _cases():
        extra = ()
        if norm:
            var, mean = torch.var_mean(x, dim=-1, keepdim=True, correction=0)
            extra = (mean.reshape(-1).contiguous(), torch.rsqrt(var + 1e-6).reshape(-1).contiguous())
        outs = {}
        for level, ext in exts.items():
            for step in range(2):  # the first step takes the batch range, the second the EMA
                if step == 0:
                    state = (torch.ones(groups), torch.zeros(groups), torch.zeros(1))
                    draws = torch.zeros(1, dtype=torch.int64)
                res = ext.quantize_step_cpu(x, groups, inner, *state, 0.9, 0.1, False, 8, True,
                                            12345, draws, True, True, False, *extra)
                outs.setdefault(level, []).append(res)
            outs[level].append(state)
            outs[level].append(ext.group_minmax_cpu(x, groups, inner))
        a, b = outs["avx512"], outs["avx2"]
        for s in range(2):
            for i in (0, 1, 2, 4):  # packed codes, step, shift, the (4, G) rows
                assert torch.equal(a[s][i], b[s][i]) or (
                    a[s][i].isnan().equal(b[s][i].isnan())
                    and torch.equal(a[s][i].nan_to_num(), b[s][i].nan_to_num())), (name, s, i)
            assert a[s][3] == b[s][3], name  # all finite
        for ta, tb in zip(a[2], b[2]):  # the running state after two steps
            assert torch.equal(ta, tb), name
        assert a[3].isnan().equal(b[3].isnan()) and torch.equal(a[3].nan_to_num(), b[3].nan_to_num()), name
    assert not outs["avx512"][0][3]  # the last case is non-finite (marked, not raised)
