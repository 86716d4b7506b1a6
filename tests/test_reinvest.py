"""benchmarks/reinvest.py and tools/reinvest.py: the paper's second claim measured, an activation
budget re-invested in a larger model, exact against Mesa 8-bit (issue 39, item 2)."""
from __future__ import annotations

import json

import pytest

from benchmarks import reinvest as R
from training import crossval as cv
from tools import reinvest as tool


def test_arms_of_a_budget():
    arms = R.arms_for(0, {"exact": 2, "mesa8": 7}, "depth", 30, t_exact=0.01, t_mesa=0.04)
    assert list(arms) == ["B0-exact", "B0-mesa8", "B0-mesa8-time"]
    e, m, t = arms.values()
    assert (e.bits, e.epochs, m.bits, m.epochs, t.bits) == (None, 30, 8, 30, 8)
    assert "depth=2" in e.extra_args and "depth=7" in m.extra_args and "depth=7" in t.extra_args
    # exact's training time: 30 epochs x 10 ms / 40 ms, the demo's 3 warmup epochs of 30 scaled alike
    assert t.epochs == 8 and t.extra_args[-2:] == ("--warmup-epochs", "1")
    assert R.demo_variant_args("width", 3) == ("--model-kwargs", "patch_size=8", "depth=2", "embed_dim=192",
                                               "num_heads=3")


def test_budget_steps_choose_exact_there_and_mesa_deeper():
    b = R.budget_bytes("depth", 1)
    c = R.choose(b, "depth", max_step=8)
    assert c["exact"] == 1 and 2 < c["mesa8"] < 8, c
    k = c["mesa8"]
    assert c["bytes"][k]["mesa8"] <= b < c["bytes"][k + 1]["mesa8"]  # (bisection measured k + 1)


def test_tool_runs_pairs_and_refuses_a_changed_arm_on_resume(tmp_path, capsys):
    out = tmp_path / "rv"
    argv = ["--budget-steps", "1", "--seeds", "0", "--folds", "2", "--epochs", "1", "--out", str(out),
            "--markdown", str(tmp_path / "t.md"), "--plot", str(tmp_path / "p.png")]
    res = tool.main(argv)
    rows = R.summarize(res)
    assert [r["method"] for r in rows] == ["exact", "mesa8", "mesa8-time"]
    ex, m8, mt = rows
    assert m8["step"] > ex["step"] == 1 and mt["step"] == m8["step"]
    # what training measured fits the budget the steps were chosen by
    assert m8["saved_mib"] * 2 ** 20 <= ex["budget"] * 1.01 and ex["saved_mib"] * 2 ** 20 <= ex["budget"] * 1.01
    assert m8["pairs"] == mt["pairs"] == 2 and ex["diff"] != ex["diff"]  # (NaN: the reference)
    table = (tmp_path / "t.md").read_text()
    assert sum(line.startswith("| ") and " MiB | " in line for line in table.splitlines()) == 3
    assert "step times of the exact / Mesa models" in table
    run = json.loads((out / "runs" / "B0-mesa8_s0_f0.json").read_text())
    assert run["arm"]["bits"] == 8 and f"depth={m8['step']}" in run["arm"]["extra_args"]
    # resume reads every run and the step times back: the same table
    again = tool.main(argv + ["--resume"])
    assert R.format_table(again) == R.format_table(res)
    # a run file trained otherwise than its arm now says is refused, by name
    arms = {"B0-exact": cv.Arm(None, 2, R.demo_variant_args("depth", 1))}
    with pytest.raises(ValueError, match="B0-exact_s0_f0.json was trained with"):
        cv.crossval(["B0-exact"], [0], 2, 1, out_dir=str(out), resume=True, arms=arms, progress=None)
