"""mesa_ops.planner and tools/plan_memory.py on a tiny timm ViT (32 px, 8 px patches: 16 + 1 tokens, 3 blocks)."""
from __future__ import annotations

import pytest
import timm
import torch

import mesa_ops as ms
from mesa_ops import planner as P


def _model():
    torch.manual_seed(0)
    return ms.compress(timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=3,
                                         drop_path_rate=0.0),
                       "off", warn=False)


@pytest.fixture(scope="module")
def profiled():
    model = _model()
    x = torch.randn(2, 3, 32, 32)
    return model, x, P.measure(model, x, time_steps=1)


def test_profile_measures_each_option(profiled):
    model, x, prof = profiled
    assert len(prof.blocks) == 3 and prof.probe_batch == 2
    # time per element per bits (never less at fewer bits), each block's share of what
    # checkpointing them all added; the blocks are left as they were (timed checkpointed)
    assert set(prof.alphas) == {8, 4, 2} and 0 <= prof.alphas[8] <= prof.alphas[4] <= prof.alphas[2]
    assert prof.alpha == prof.alphas[8] and all(b.recompute_time >= 0 for b in prof.blocks)
    assert all(type(b).__name__ == "Block" and "mesa_ckpt_mode" not in vars(b) for b in model.blocks)
    names = {u.name for u in prof.units}
    assert "blocks.0.attn.attention" in names and "patch_embed.proj" not in names  # stem stays exact
    for u in prof.units:
        assert u.bytes[0] > u.bytes[8] > u.bytes[4] > u.bytes[2] > 0, u
        assert 0 == u.err[0] < u.err[8] < u.err[4] < u.err[2], u
    exact = ms.audit(model, x, verbose=False).total_bytes
    # the exact estimate is the audited total, or a little more where a tensor two exact units
    # share is counted for both (conservative)
    est = prof.fixed_bytes + sum(u.bytes[0] for u in prof.units)
    assert exact <= est <= 1.1 * exact


def test_a_bytes_only_profile_times_no_step(profiled):
    """``time_steps=0`` (models.scale: bytes only): the same units, bytes and errors, no step
    timed (step time, per-element costs and recomputation times 0), and a plan by error."""
    model, x, prof = profiled
    quick = P.measure(model, x, time_steps=0)
    assert [(u.name, u.bytes) for u in quick.units] == [(u.name, u.bytes) for u in prof.units]
    assert quick.step_time == 0 and set(quick.alphas.values()) == {0.0}
    assert all(b.recompute_time == 0 for b in quick.blocks)
    budget = prof.fixed_bytes + sum(u.bytes[8] for u in prof.units)
    plan = P.make_plan(quick, budget, 2)
    assert plan.est_bytes <= budget and plan.est_step_time == 0 and plan.est_error > 0


def test_a_copy_two_units_share_counts_once(profiled):
    """A Linear that reads its LayerNorm's packed copy (and fc2 reading GELU's) stores nothing of
    that copy itself at equal bits: with every unit at b bits the estimate is the audited total,
    within 2% (before: each unit's bytes alone, summed, counted those copies twice)."""
    from mesa_ops.plan_measure import _set

    model, x, prof = profiled
    readers = {u.name: u.reads for u in prof.units if u.reads}
    assert readers.get("blocks.0.attn.qkv") == "blocks.0.norm1", readers
    assert readers.get("blocks.0.mlp.fc2") == "blocks.0.mlp.act", readers
    for b in (8, 4, 2):
        st = P._State(prof, 1.0)
        for u in prof.units:
            st.bits[u.name] = b
        _set(model, {n: b for u in prof.units for n in u.layers})
        got = ms.audit(model, x, verbose=False).total_bytes
        summed = prof.fixed_bytes + sum(u.bytes[b] for u in prof.units)
        assert abs(st.cost()[0] - got) <= 0.02 * got < summed - got, (b, st.cost()[0], got, summed)
    _set(model, {})
    # the greedy reaches the all-2-bit configuration (a shared copy moves with its readers: moved
    # alone, either side would store a copy of its own and save nothing)
    plan = P.make_plan(prof, int(st.cost()[0] * 1.001), batch_size=2, checkpointing=False)
    assert plan.est_bytes <= st.cost()[0] * 1.001 and set(plan.bits.values()) <= {2, 4}


@pytest.mark.parametrize("fraction", [0.6, 0.25])
def test_plan_fits_budget_when_measured(profiled, tmp_path, fraction):
    model, x, prof = profiled
    exact = ms.audit(model, x, verbose=False).total_bytes
    budget = int(fraction * exact)
    plan = P.make_plan(prof, budget, batch_size=2)
    assert plan.est_bytes <= budget
    path = P.write_plan(plan, model, str(tmp_path / "plan.txt"))
    # a fresh model with the written plan (one policy file: the bits and an 'on checkpoint:'
    # section); its measured saved bytes fit the budget, module names unchanged
    fresh = _model()
    ckpt = P.apply_plan(fresh, path)
    assert ckpt == {k: v for k, v in plan.ckpt.items() if v}
    got = ms.audit(fresh, x, verbose=False).total_bytes
    assert got <= budget, (got, budget, plan)
    if fraction == 0.6:  # exact checkpointing (no error) suffices before any quantization
        assert all(b == 0 for b in plan.bits.values()) and any(plan.ckpt.values())
    on = {n: m.enable for n, m in ms.policy.mesa_layers(fresh)}
    assert on == {n: plan.layer_bits.get(n, 0) > 0 for n in on}
    info = P.read_plan(path)
    assert info["budget"] == budget and info["est_bytes"] == plan.est_bytes
    assert not (tmp_path / "plan.txt.json").exists()  # one file


def test_impossible_budget_is_a_clear_error(profiled):
    _, _, prof = profiled
    with pytest.raises(P.PlanError, match="below the smallest configuration"):
        P.make_plan(prof, 1000, batch_size=2)


def test_cli_writes_policy_and_exits_2_on_impossible_budget(tmp_path, capsys):
    from tools.plan_memory import main

    out = tmp_path / "p.txt"
    plan, got = main(["--model", "test_vit", "--input-size", "32", "--batch-size", "2",
                      "--budget-gb", "0.00012", "--out", str(out)])
    assert got["saved_bytes"] <= 0.00012e9 and any(plan.ckpt.values())
    assert "measured: saved" in capsys.readouterr().out
    ms.policy.parse_policy(str(out))  # a valid policy file
    with pytest.raises(SystemExit) as exc:
        main(["--model", "test_vit", "--input-size", "32", "--batch-size", "2",
              "--budget-gb", "0.000001"])
    assert exc.value.code == 2
    assert "below the smallest configuration" in capsys.readouterr().err


def test_checkpoint_blocks_exact_and_packed_keep_names_and_gradients():
    model = _model()
    x = torch.randn(2, 3, 32, 32)
    keys = list(model.state_dict())
    exact = ms.audit(model, x, verbose=False).total_bytes
    g0 = P._grads(model, x)
    P.checkpoint_blocks(model, {"blocks.0": "exact", "blocks.1": "packed8", "blocks.2": "packed8"})
    assert list(model.state_dict()) == keys
    rows = ms.audit(model, x, verbose=False)
    assert rows.total_bytes < 0.5 * exact
    assert any(t.dtype == "uint8" for t in rows.tensors)  # the packed block inputs
    g = P._grads(model, x)
    num = sum(float((g[k] - g0[k]).square().sum()) for k in g0)
    den = sum(float(g0[k].square().sum()) for k in g0)
    assert (num / den) ** 0.5 < 0.05  # exact recomputation from an 8-bit input
    model.eval()
    with torch.no_grad():
        model(x)  # no checkpointing outside training


def test_largest_batch_fits_and_one_more_does_not(profiled):
    model, x, prof = profiled
    budget = int(8 * ms.audit(model, x, verbose=False).total_bytes / x.shape[0])  # exact: batch 8
    plan = P.largest_batch(prof, budget, limit=1000)
    assert plan.batch_size > 8 and plan.est_bytes <= budget
    with pytest.raises(P.PlanError):
        P.make_plan(prof, budget, plan.batch_size + 1)
    assert P.largest_batch(prof, budget, limit=10).batch_size == 10  # capped (e.g. by the data)


@pytest.mark.parametrize("fraction", [0.6, 0.4, 0.25])
def test_time_objective_fastest_plan_fits(profiled, fraction, tmp_path):
    """objective='time': fits the budget (measured), and by the estimate it is no slower than the
    least-error plan (beyond the tolerance), nor than the greedy's 8-bit-or-exact plan."""
    model, x, prof = profiled
    exact = ms.audit(model, x, verbose=False).total_bytes
    budget = int(fraction * exact)
    fast = P.make_plan(prof, budget, batch_size=2, objective="time")
    assert fast.est_bytes <= budget
    slack = 0.02 * prof.step_time
    assert fast.est_extra_time <= P.make_plan(prof, budget, batch_size=2).est_extra_time + slack
    eight = P._greedy(prof, 1.0, budget, None, "time", lowest_bits=8)
    if eight is not None:
        assert fast.est_extra_time <= eight.cost()[2] + slack
    fresh = _model()
    P.apply_plan(fresh, P.write_plan(fast, model, str(tmp_path / "p.txt")))
    assert ms.audit(fresh, x, verbose=False).total_bytes <= budget
    with pytest.raises(ValueError, match="objective"):
        P.make_plan(prof, budget, batch_size=2, objective="speed")


def _synthetic(alphas, recompute_time=0.5):
    """Two blocks of two units, 1e6 elements each: 4 MB exact, 1 / 0.5 / 0.25 MB at 8 / 4 / 2
    bits; each block's input 1 MB; ``alphas`` seconds per element per bits; step 1 s."""
    units = [P.Unit(f"b{i}.u{j}", [f"b{i}.u{j}"], f"b{i}", 10**6,
                    {0: 4 * 10**6, 8: 10**6, 4: 5 * 10**5, 2: 25 * 10**4},
                    {0: 0.0, 8: 0.01, 4: 0.05, 2: 0.2}) for i in range(2) for j in range(2)]
    blocks = [P.BlockInfo(f"b{i}", in_bytes=10**6, in_err8=0.01, recompute_time=recompute_time, in_elements=25 * 10**4)
              for i in range(2)]
    return P.Profile(units, blocks, 0, 1, alphas[8], 1.0, True, dict(alphas))


def test_time_objective_weighs_fewer_bits_against_recomputation():
    """Where 4 bits fit and cost less time (per the measured alphas) than recomputing blocks,
    the time plan takes 4 bits, not 8 bits plus checkpointing (the rule before: 8 bits or exact
    whenever such a plan fit); its estimate counts each bits' own cost per element."""
    prof = _synthetic({8: 1e-7, 4: 1.2e-7, 2: 1.5e-7})
    plan = P.make_plan(prof, int(2.5e6), batch_size=1, objective="time", recompute_transient=False)
    assert not any(plan.ckpt.values()) and 4 in plan.bits.values(), plan
    assert set(plan.bits.values()) <= {8, 4} and plan.est_bytes <= 2.5e6
    n4 = sum(b == 4 for b in plan.bits.values())
    assert plan.est_extra_time == pytest.approx(0.1 * (4 - n4) + 0.12 * n4)
    # the same with recomputation cheap: 8 bits and packed checkpoints beat 4 bits
    cheap = P.make_plan(_synthetic({8: 1e-7, 4: 1e-6, 2: 2e-6}, recompute_time=0.01), int(2.5e6), 1,
                        objective="time", recompute_transient=False)
    assert any(cheap.ckpt.values()) and 4 not in cheap.bits.values(), cheap


def test_time_objective_tolerance_prefers_less_error():
    """A plan at fewer bits that is faster by less than the tolerance (2% of the step) loses to
    the one with less error; with no tolerance the faster wins."""
    prof = _synthetic({8: 1e-7, 4: 0.99e-7, 2: 0.98e-7})  # 0.400 / 0.396 / 0.392 s all at 8 / 4 / 2
    plan = P.make_plan(prof, int(3.9e6), batch_size=1, checkpointing=False, objective="time")
    assert sorted(plan.bits.values()) == [4, 8, 8, 8], plan.bits  # one unit below 8 bits fits
    strict = P.make_plan(prof, int(3.9e6), batch_size=1, checkpointing=False, objective="time",
                         time_tolerance=0.0)
    assert 2 in strict.bits.values(), strict.bits
    assert strict.est_extra_time < plan.est_extra_time < strict.est_extra_time + 0.02


def test_recompute_transient_counted_or_not():
    """Below every all-bits configuration only checkpointing fits: counting the recomputation
    transient (a block's exact 8 MB re-created in backward) nothing does, and the error names
    both smallest configurations; not counting it, a packed checkpoint fits."""
    prof = _synthetic({8: 1e-7, 4: 1.2e-7, 2: 1.5e-7})
    with pytest.raises(P.PlanError, match="every block checkpointed with its recomputation transient"):
        P.make_plan(prof, int(0.8e6), batch_size=1, objective="time")
    plan = P.make_plan(prof, int(0.8e6), batch_size=1, objective="time", recompute_transient=False)
    assert "packed8" in plan.ckpt.values() and not plan.counts_recompute
    assert plan.est_bytes <= 0.8e6 and plan.est_recompute == 8 * 10**6


def test_no_transient_plan_still_tries_bits_alone():
    """Not counting the transient must not force checkpointing: where one unit at 8 bits fits
    (budget 15 of 16 MB), that is the plan, as when the transient is counted."""
    prof = _synthetic({8: 1e-7, 4: 1.2e-7, 2: 1.5e-7}, recompute_time=0.2)
    for counted in (True, False):
        plan = P.make_plan(prof, int(15e6), batch_size=1, objective="time", recompute_transient=counted)
        assert not any(plan.ckpt.values()) and plan.est_extra_time == pytest.approx(0.1), (counted, plan)
    # per sample: 2 x 0.25 MB (+ 1 KB) with both blocks' inputs packed, 1 MB with every unit at 2 bits
    plan = P.largest_batch(prof, int(4.5e6), limit=100, objective="time", recompute_transient=False)
    assert plan.batch_size == 8 and not plan.counts_recompute and set(plan.ckpt.values()) == {"packed8"}
    assert P.largest_batch(prof, int(4.5e6), limit=100, objective="time").batch_size == 4


def test_first_step_report_of_a_plan_without_the_transient(tmp_path, monkeypatch):
    """A plan file keeps counts_recompute; training's first-step report subtracts the transient
    from the prediction only where the plan counted it."""
    from training import memory

    lines = []
    monkeypatch.setattr(memory, "log", lines.append)
    model = _model()
    prof = _synthetic({8: 1e-7, 4: 1.2e-7, 2: 1.5e-7})
    for counted, budget in ((False, int(0.8e6)), (True, int(30e6))):
        plan = P.make_plan(prof, budget, batch_size=1, recompute_transient=counted)
        plan.ckpt = {"blocks.0": "packed8"} if not counted else {}
        plan.layer_bits = {}
        info = P.read_plan(P.write_plan(plan, model, str(tmp_path / f"p{counted}.txt")))
        assert info["counts_recompute"] is counted and info["est_recompute"] == plan.est_recompute
        memory.first_step_report(info, 1, "p")(plan.est_bytes)
        assert f"predicted saved activations {plan.est_bytes / 2**20:.2f} MiB in the forward" in lines[-1] \
            or (counted and plan.est_recompute == 0), lines[-1]
        assert ("while a checkpointed block is recomputed" in lines[-1]) is (counted and plan.est_recompute > 0)
