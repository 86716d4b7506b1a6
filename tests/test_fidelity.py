"""mesa_ops.fidelity (gradient bias and noise against exact autograd) and tools/grad_fidelity.py,
on the demo DeiT (2 blocks, width 64, 32 px) with a few draws."""
from __future__ import annotations

import json
import math

import pytest
import torch

import mesa_ops as ms
import models
from mesa_ops import fidelity as FI
from mesa_ops.quant import QuantMixin

D = models.demo


def _model(policy="mesa8", seed=0):
    torch.manual_seed(seed)
    return models.create_model(D.DEMO_MODEL, **D.DEMO_KWARGS, img_size=D.DEMO_INPUT_SIZE,
                               num_classes=10, ms_policy=policy)


def _batches(n, b=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(b, 3, 32, 32, generator=g), torch.randint(0, 10, (b,), generator=g))
            for _ in range(n)]


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()
            if k.endswith(("clip_val", "shift", "iteration"))}


def test_param_group_replaces_block_indices():
    assert FI.param_group("blocks.3.attn.qkv.weight") == "blocks.*.attn.qkv.weight"
    assert FI.param_group("layers.0.blocks.11.norm1.bias") == "layers.*.blocks.*.norm1.bias"
    assert FI.param_group("0.weight") == "*.weight"
    assert FI.param_group("pos_embed") == "pos_embed"
    assert FI.default_ks(16) == [1, 2, 4, 8, 16] and FI.default_ks(6) == [1, 2, 4, 6]


def test_per_batch_ranges_floor_falls_like_inverse_sqrt_k():
    # per-batch ranges at 8 bits: no clipping, stochastic rounding unbiased -> the error of the
    # mean of K draws falls like 1 / sqrt(K) and the bias estimate is not resolved
    (x, y), *warm = _batches(3)
    rep = FI.grad_fidelity(_model(), x, y, draws=16, warm=warm, range_mode="batch")
    assert rep["range_mode"] == "batch" and rep["warm_steps"] == 2 and rep["ks"] == [1, 2, 4, 8, 16]
    a = rep["groups"]["all"]
    assert 0 < a["single"] < 0.05  # 8 bits: about 1% of the gradient norm per step
    assert 0.15 < a["mean_err"][16] / a["mean_err"][1] < 0.4, a  # 1/sqrt(16) = 0.25
    assert -0.65 < a["slope"] < -0.35, a
    assert a["bias"] < 2 * a["bias_se"] + 0.05 * a["noise"], a
    # one draw's error^2 = bias^2 + noise^2 (up to the sampling of 16 draws)
    assert math.isclose(a["single"] ** 2, a["bias"] ** 2 + a["noise"] ** 2, rel_tol=0.25)
    # every parameter group is listed once, "all" first, and adds up to the total
    names = list(rep["groups"])
    assert names[0] == "all" and "blocks.*.attn.qkv.weight" in names
    assert sum(g["numel"] for n, g in rep["groups"].items() if n != "all") == a["numel"]
    assert math.isclose(sum(g["grad_norm"] ** 2 for n, g in rep["groups"].items() if n != "all"),
                        a["grad_norm"] ** 2, rel_tol=1e-9)


def test_clipped_running_range_bias_is_detected_and_union_removes_it():
    # a deliberately biased quantizer: running ranges shrunk to 30% of what the warm-up learned,
    # so that the 'ema' rule clamps most values; 'union' widens each range to the batch's
    (x, y), *warm = _batches(3)
    out = {}
    for mode in ("ema", "union"):
        model = _model()
        FI.set_range_mode(model, mode)
        model.train()
        for wx, _ in warm:
            model(wx)
        with torch.no_grad():
            for q in model.modules():
                if isinstance(q, QuantMixin):
                    q.clip_val.mul_(0.3)
        out[mode] = FI.grad_fidelity(model, x, y, draws=8)["groups"]["all"]
    ema, union = out["ema"], out["union"]
    assert ema["bias"] > 5 * ema["bias_se"] and ema["bias"] > ema["noise"], ema  # bias dominates
    assert ema["slope"] > -0.25, ema  # the mean of draws does not approach the exact gradient
    assert union["bias"] < 0.2 * ema["bias"] and union["slope"] < -0.35, union


def test_round_to_nearest_is_all_bias_no_noise():
    (x, y), *warm = _batches(2)
    model = _model()
    for q in model.modules():
        if isinstance(q, QuantMixin):
            q.stochastic = False
    a = FI.grad_fidelity(model, x, y, draws=4, warm=warm)["groups"]["all"]
    assert a["noise"] < 1e-3 * a["bias"] and a["bias_se"] < 1e-3 * a["bias"]  # every draw the same
    assert a["bias"] > 0 and math.isclose(a["bias"], a["single"], rel_tol=1e-5)
    assert max(a["mean_err"].values()) < (1 + 1e-5) * min(a["mean_err"].values())  # no fall with K


def test_state_is_restored_and_draws_are_reproducible():
    (x, y), *warm = _batches(3)
    model = _model()
    model.train()
    for wx, _ in warm:
        model(wx)
    before = _state(model)
    ms_state, torch_state = ms.get_rng_state(), torch.random.get_rng_state()
    r1 = FI.grad_fidelity(model, x, y, draws=3)
    after = _state(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(ms.get_rng_state(), ms_state)
    assert torch.equal(torch.random.get_rng_state(), torch_state)
    assert all(q.enable for q in model.modules() if isinstance(q, QuantMixin) and q.tag != "conv")
    r2 = FI.grad_fidelity(model, x, y, draws=3)
    assert r1["groups"]["all"] == r2["groups"]["all"]  # the same draws again
    r3 = FI.grad_fidelity(model, x, y, draws=3, base=100)
    assert r3["groups"]["all"]["single"] != r1["groups"]["all"]["single"]  # other draws


def test_bad_input_is_a_clear_error():
    (x, y), = _batches(1)
    with pytest.raises(ValueError, match="draws must be >= 2"):
        FI.grad_fidelity(_model(), x, y, draws=1)
    with pytest.raises(ValueError, match="no Mesa quantizer of the model is enabled"):
        FI.grad_fidelity(_model(policy=None), x, y, draws=2)
    with pytest.raises(ValueError, match="ks must lie in"):
        FI.grad_fidelity(_model(), x, y, draws=2, ks=[4])
    with pytest.raises(ValueError, match="range_mode must be one of"):
        FI.set_range_mode(_model(), "clip")


def test_cli_compares_range_modes_and_writes_json(tmp_path, capsys):
    from tools.grad_fidelity import main

    out = tmp_path / "f.json"
    reps = main(["--model", "demo", "--data-set", "random", "--num-classes", "10", "--batch-size", "2",
                 "--warm-steps", "1", "--draws", "2", "--policy", "mesa8", "mesa4",
                 "--range-mode", "ema", "union", "--json", str(out)])
    assert [(r["policy"], r["range_mode"]) for r in reps] == [
        ("mesa8", "ema"), ("mesa8", "union"), ("mesa4", "ema"), ("mesa4", "union")]
    text = capsys.readouterr().out
    assert "mesa4, range_mode union" in text and "| all |" in text
    saved = json.loads(out.read_text())
    assert len(saved) == 4 and saved[0]["groups"]["all"]["mean_err"].keys() == {"1", "2"}
    # 4 bits are noisier than 8 (the same weights, batch and warm-up)
    assert saved[2]["groups"]["all"]["single"] > 3 * saved[0]["groups"]["all"]["single"]


def test_cli_rejects_an_unknown_policy():
    from tools.grad_fidelity import main

    with pytest.raises(SystemExit, match="neither mesa8/mesa4/mesa2 nor a file"):
        main(["--model", "demo", "--data-set", "random", "--num-classes", "10", "--batch-size", "2",
              "--warm-steps", "0", "--draws", "2", "--policy", "mesa3"])


def test_planner_verify_reports_bias_and_noise():
    from mesa_ops import planner as P

    model = _model(policy=None)
    x = torch.randn(2, 3, 32, 32)
    names = [n for n, _ in ms.policy.mesa_layers(model) if not n.startswith("patch_embed")]
    plan = P.Plan(bits={}, ckpt={}, batch_size=2, budget=0, est_bytes=0, est_error=0.0,
                  est_extra_time=0.0, est_step_time=0.0, layer_bits={n: 4 for n in names})
    got = P.verify(model, plan, x, draws=3)
    assert got["grad_draws"] == 3
    assert 0 < got["grad_noise"] and 0 <= got["grad_bias"] < got["grad_rel_error"] < 2
    assert "bias" in P.summary(plan, P.Profile([], [], 0, 2, 0.0, 1.0, False))
    # an exact plan (no quantizer, no packed checkpoint): the gradient is exact
    plan.layer_bits = {}
    got = P.verify(model, plan, x, draws=2)
    assert got["grad_rel_error"] == 0 and got["grad_noise"] == 0
