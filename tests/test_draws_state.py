"""The stochastic-rounding draw counter is a CPU buffer in the state dict (``draws``): an in-place
load (``torch.distributed.checkpoint``) restores it, also where it differs from ``iteration`` (a
skipped non-finite step draws but does not update the range); a checkpoint without it (older, or
the original Mesa code's) still loads strictly, the counter then following ``iteration``."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import models
from mesa_ops.quant import Quantizer


def _quantizer() -> Quantizer:
    q = Quantizer(enable=True, bits=8)
    q.layer_name = "fm"  # named: the same rounding stream in every instance (unnamed ones differ)
    q.nonfinite = "skip"
    return q.train()


def _step(q, x) -> torch.Tensor:
    """The packed codes of ``x`` (stochastic rounding: they depend on the draw counter)."""
    return q.quantize(x).packed.clone()


def _trained() -> Quantizer:
    torch.manual_seed(0)
    q = _quantizer()
    q.quantize(torch.randn(4, 8))
    bad = torch.randn(4, 8)
    bad[0, 0] = float("inf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q.quantize(bad)  # skipped: the range (and iteration) stay, the draw counter advances
    return q


def test_draws_is_a_cpu_buffer_in_the_state_dict():
    q = _trained()
    sd = q.state_dict()
    assert list(sd) == ["clip_val", "shift", "iteration", "draws"]
    assert sd["draws"].dtype == torch.int64 and sd["draws"].device.type == "cpu"
    assert int(sd["draws"]) == 2 and float(sd["iteration"]) == 1
    assert q.to(torch.float64)._draws.dtype == torch.int64


def test_in_place_dcp_load_resumes_the_rounding_stream(tmp_path):
    q = _trained()
    dcp.save(q.state_dict(), checkpoint_id=str(tmp_path / "ck"))
    x = torch.randn(4, 8)
    rng = torch.get_rng_state()
    want = _step(q, x)
    fresh = _quantizer()
    sd = fresh.state_dict()
    dcp.load(sd, checkpoint_id=str(tmp_path / "ck"))  # in place, into the module's own tensors
    assert int(fresh._draws) == 2 and float(fresh.iteration) == 1
    torch.set_rng_state(rng)
    assert torch.equal(_step(fresh, x), want)


def test_checkpoint_without_draws_loads_strictly_and_follows_iteration():
    q = _trained()
    old = {k: v for k, v in q.state_dict().items() if k != "draws"}
    fresh = _quantizer()
    res = fresh.load_state_dict(old, strict=True)
    assert not res.missing_keys and not res.unexpected_keys
    assert int(fresh._draws) == 1
    m = models.create_model("deit_tiny_patch16_224", patch_size=8, depth=1, embed_dim=32, num_heads=2,
                            img_size=32, num_classes=10)
    models.apply_policy(m, "mesa8", verbose=lambda *_: None)
    sd = {k: v for k, v in m.state_dict().items() if not k.endswith(".draws")}
    report = models.load_checkpoint(m, sd, verbose=lambda *_: None)
    assert not report.missing_quantizer_keys and any(k.endswith(".draws") for k in report.derived_keys)
    with pytest.raises(RuntimeError, match="draws"):  # a missing counter without iteration: an error
        _quantizer().load_state_dict({"clip_val": torch.ones(1), "shift": torch.zeros(1)}, strict=True)


def test_whole_module_pickles_and_copies_resume_the_rounding_stream():
    """torch.save of a whole trained model (not its state dict) and copy.deepcopy: the copy draws
    the codes the original would (its counter as saved, not re-read from ``iteration``)."""
    import copy
    import io

    q = _trained()  # draws 2, iteration 1: a counter re-read from iteration would differ
    buf = io.BytesIO()
    torch.save(q, buf)  # raised "cannot pickle 'weakref.ReferenceType'" before
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    twin = copy.deepcopy(q)
    x = torch.randn(4, 8)
    rng = torch.get_rng_state()
    want = _step(q, x)
    for other in (loaded, twin):
        assert int(other._draws) == 2
        torch.set_rng_state(rng)
        assert torch.equal(_step(other, x), want)


def test_settings_changed_after_a_step_take_effect():
    """What the quantizer decides once per input layout (its step plan) is decided again when a
    setting changes: bits, rounding, prefix rows, the layer's name (its noise stream), groups."""
    torch.manual_seed(0)
    x = torch.randn(2, 6, 16)
    q = _quantizer()
    first = q.quantize(x)
    assert first.bits == 8 and first.head is None and first.groups == 1
    plan = q.__dict__["_qplan"]
    q.quantize(x)
    q.prefix_tokens = q.prefix_tokens  # the same value (compressed checkpointing re-applies them)
    assert q.__dict__["_qplan"] is plan  # decided once, kept
    q.bits = 4
    assert q.quantize(x).packed.numel() == x.numel() // 2
    q.stochastic = False
    a, b = q.quantize(x).packed, q.quantize(x).packed
    assert torch.equal(a, b)  # round to nearest: no draws
    q.prefix_tokens = 1
    head = q.quantize(x).head
    assert head is not None and torch.equal(head, x[:, :1])
    q.stochastic, q.prefix_tokens = True, 0
    rng = torch.get_rng_state()
    before = q.quantize(x).packed
    q.layer_name, q._draws[0] = "another", int(q._draws) - 1
    torch.set_rng_state(rng)
    assert not torch.equal(q.quantize(x).packed, before)  # another salt: another stream
    fresh = Quantizer(enable=True, quant_groups=2).train()
    assert fresh.quantize(x).groups == 2
    fresh.iteration.zero_()
    fresh.update_quantization_parameter(by_index="all", quant_groups=4)
    assert fresh.quantize(x).groups == 4


@pytest.mark.parametrize("backend_name", ("emu", "cpp", "torch"))
def test_quantize_many_equals_the_calls_in_turn(monkeypatch, backend_name):
    """quant.quantize_many (an attention's q, k, v) gives, over three steps, the packed copies
    (codes, scales, exact prefix rows), running states and draw counters that QuantMixin.quantize
    of each gives in turn: 8 and 4 bits, head-wise groups, a strided q read in place, a prefix
    row kept exactly; on the emulated CUDA kernels (the three in one launch: counted), the C++
    kernels and the reference (a call each)."""
    import copy

    from mesa_ops import backend, quant

    emu = None
    if backend_name == "emu":  # (the CUDA backend's methods over the emulated kernels)
        emu = backend.build_extension("emu")
        be = backend._Extension(emu, "cuda")
        monkeypatch.setattr(quant, "kernel_for", lambda *a: be)
        monkeypatch.setattr(quant, "restorer", lambda *a: be)  # (quantize_many's cached lookup)
    else:
        monkeypatch.setenv("MESA_BACKEND", backend_name)
    qs = []
    for i, bits in enumerate((8, 4, 8)):
        q = Quantizer(quant_groups=3, enable=True, bits=bits)
        q.group_dim = "last"
        q.layer_name = f"attn.q{i}"
        q.prefix_tokens = 1
        qs.append(q.train())
    twins = copy.deepcopy(qs)
    torch.manual_seed(0)
    for step in range(3):
        qkv = torch.randn(2, 9, 3 * 24) * (1 + step)
        xs = [qkv[..., 24 * i:24 * (i + 1)] for i in range(3)]
        before = emu.launches() if emu else 0
        got = quant.quantize_many(list(zip(qs, xs)))
        if emu:
            assert emu.launches() - before == 1
        want = [q.quantize(x) for q, x in zip(twins, xs)]
        for a, b, x in zip(got, want, xs):
            assert torch.equal(a.packed, b.packed) and torch.equal(a.step, b.step)
            assert torch.equal(a.shift, b.shift) and torch.equal(a.head, b.head)
            assert a.head.shape == (2, 1, 24) and torch.equal(a.head, x[:, :1])
        for q, t in zip(qs, twins):
            for k, v in q.state_dict().items():
                assert torch.equal(v, t.state_dict()[k]), (step, k)
