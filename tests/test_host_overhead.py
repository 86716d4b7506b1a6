"""Host overhead bounds (issue 48): a Mesa 8-bit training step makes at most 1.5x the Python
calls and 1.5x the aten ops of exact's, so that the host time the native paths took out cannot
creep back unseen. Counted by benchmarks.host_time.count_step (DeiT-Ti, batch 1, 32 px, forward
+ loss + backward, after warm-up steps: plans, caches and the extension built)."""
from __future__ import annotations

import pytest

from benchmarks import host_time

BOUND = 1.5  # Mesa / exact, Python calls and aten ops alike


@pytest.fixture(scope="module", params=("fp32", "bf16"))
def counts(request, cpp_backend):
    return request.param, host_time.count_step("deit_tiny_patch16_224", request.param)


def test_python_calls_within_bound(counts):
    precision, c = counts
    e, m = c["exact"]["python calls"], c["mesa8"]["python calls"]
    assert m <= BOUND * e, (f"{precision}: Mesa makes {m} Python calls per step, exact {e} "
                            f"({m / e:.2f}x > {BOUND}x): " + _top(c, "calls by function"))


def test_aten_ops_within_bound(counts):
    precision, c = counts
    e, m = c["exact"]["aten ops"], c["mesa8"]["aten ops"]
    assert m <= BOUND * e, (f"{precision}: Mesa runs {m} aten ops per step, exact {e} "
                            f"({m / e:.2f}x > {BOUND}x): " + _top(c, "ops by name"))


def test_the_counts_see_mesa_at_work(counts):
    """The counted step is a Mesa step: one quantize per stored activation (86 in DeiT-Ti: each
    block's two LayerNorms, q, k, v, the attention output and the GELU's input, whose copies its
    four Linears take; the final norm's and the head's, whose input is the class token's row), one
    restore per stored copy but the GELU inputs' (read through tables: 12 restores of GELU(x) for
    fc2), the copies two backwards share restored once (74); exact calls none of them."""
    _, c = counts
    calls, exact = c["mesa8"]["calls by function"], c["exact"]["calls by function"]
    want = {"quant.py:QuantMixin.quantize": 86, "packed.py:restore": 74, "packed.py:MappedQTensor.restore": 12}
    for name, n in want.items():
        assert calls[name] == n and name not in exact, (name, calls[name])
    assert c["exact"]["python calls"] > 1000 and c["exact"]["aten ops"] > 1000


def _top(c, key, n=8) -> str:
    e, m = c["exact"][key], c["mesa8"][key]
    extra = sorted(((m[k] - e.get(k, 0), k) for k in m), reverse=True)[:n]
    return "most added: " + ", ".join(f"{k} +{v}" for v, k in extra)
