"""training.crossval and tools/accuracy.py (the k-fold DIGITS accuracy benchmark), tiny settings."""
from __future__ import annotations

import json
import math
import statistics

import numpy as np
import pytest
import torch

from training import crossval as cv


def test_folds_validate_every_image_once_per_seed():
    y = torch.tensor([i % 10 for i in range(200)])
    for seed in (0, 1):
        splits = cv.fold_splits(y, 5, seed)
        val = np.concatenate([va for _, va in splits])
        assert sorted(val.tolist()) == list(range(200))
        for tr, va in splits:
            assert not set(tr) & set(va) and len(tr) + len(va) == 200
            assert np.bincount(y[va].numpy()).tolist() == [4] * 10  # stratified
    assert not np.array_equal(cv.fold_splits(y, 5, 0)[0][1], cv.fold_splits(y, 5, 1)[0][1])
    with pytest.raises(ValueError, match="folds must be >= 2"):
        cv.fold_splits(y, 1, 0)


def test_summary_pairs_by_fold_and_seed():
    # 2 seeds x 2 folds of 10 images; mode b is 1, 2, 3, 4 images (10..40 points) better
    runs = []
    for s in (0, 1):
        for f in (0, 1):
            runs.append({"mode": "a", "seed": s, "fold": f, "correct": 5, "n": 10, "acc1": 50.0,
                         "saved_mib": 4.0, "step_ms": 1.0})
            k = 1 + 2 * s + f
            runs.append({"mode": "b", "seed": s, "fold": f, "correct": 5 + k, "n": 10,
                         "acc1": 10.0 * (5 + k), "saved_mib": 1.0, "step_ms": 2.0})
    res = {"modes": ["a", "b"], "seeds": [0, 1], "folds": 2, "epochs": 1, "n_images": 20, "runs": runs}
    a, b = cv.summarize(res)
    assert a["acc"] == 50.0 and a["diff"] == 0.0 and a["pairs"] == 4
    assert b["acc"] == statistics.fmean([65.0, 85.0]) and b["diff"] == 25.0
    assert math.isclose(b["diff_se"], statistics.stdev([10, 20, 30, 40]) / 2)
    table = cv.format_results(res)
    assert "| b | 0 1 | 75.00% |" in table and "+25.00 +- 6.45 | 4 |" in table and "(0.250x)" in table


def test_a_mode_on_fewer_seeds_pairs_only_those():
    runs = [{"mode": m, "seed": s, "fold": f, "correct": c, "n": 10, "acc1": 10.0 * c, "saved_mib": 1.0,
             "step_ms": 1.0}
            for s in range(4) for f in (0, 1) for m, c in (("a", 5), ("b", 6 + s))
            if m == "a" or s < 2]
    res = {"modes": ["a", "b"], "seeds": [0, 1, 2, 3], "seeds_for": {"a": [0, 1, 2, 3], "b": [0, 1]},
           "folds": 2, "epochs": 1, "n_images": 20, "runs": runs}
    a, b = cv.summarize(res)
    assert a["pairs"] == 8 and b["pairs"] == 4 and b["seeds"] == [0, 1]
    assert b["diff"] == 15.0 and b["acc"] == 65.0
    assert "| a | 0-3 |" in cv.format_results(res)
    with pytest.raises(ValueError, match="reference mode"):
        cv.mode_seeds(["a", "b"], [0, 1], {"a": [0]})
    with pytest.raises(ValueError, match="subset"):
        cv.mode_seeds(["a", "b"], [0, 1], {"b": [2]})
    with pytest.raises(ValueError, match="not among the modes"):
        cv.mode_seeds(["a", "b"], [0, 1], {"c": [0]})
    assert cv.mode_seeds(["a", "b"], [3, 1, 0], {"b": [0, 3]}) == {"a": [3, 1, 0], "b": [3, 0]}
    assert cv.mode_seeds(["a", "b"], [1, 0], {"a": [0, 1]})["a"] == [1, 0]  # (any order)
    for modes, seeds in ((["a", "a"], [0]), (["a"], [0, 0])):
        with pytest.raises(ValueError, match="given twice"):
            cv.mode_seeds(modes, seeds)


def test_a_failing_worker_stops_the_pool(tmp_path):
    """With --jobs, a run's error comes back as that error (here a bad model name), and no run
    is left half-written."""
    from training.main import UsageError

    with pytest.raises(UsageError, match="unknown model 'no_such_model'"):
        cv.crossval(modes=("exact", "mesa8"), seeds=(0,), folds=2, epochs=1, jobs=2, progress=None,
                    extra_args=("--model", "no_such_model"), out_dir=str(tmp_path))
    assert not list((tmp_path / "runs").glob("*.json*"))


def test_seeds_for_parsing():
    from tools.accuracy import _mode_seeds

    assert _mode_seeds("mesa4=0-2,5") == ("mesa4", [0, 1, 2, 5])
    for bad in ("mesa4", "mesa4=", "mesa4=a-b"):
        with pytest.raises(ValueError, match="seeds-for"):
            _mode_seeds(bad)


def test_unknown_mode_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown mode 'mesa3'"):
        cv.crossval(modes=("exact", "mesa3"), seeds=(0,), folds=2, epochs=1)


def test_exact_run_is_reproducible_and_mesa_saves_bytes():
    x, y = cv.digits_all()
    assert x.shape == (1797, 3, 32, 32) and y.shape == (1797,)
    tr, va = cv.fold_splits(y, 10, 0)[0]
    r1 = cv.train_fold(x, y, tr, va, None, 0, 1)
    r2 = cv.train_fold(x, y, tr, va, None, 0, 1)
    assert r1["correct"] == r2["correct"] and r1["n"] == len(va)
    m = cv.train_fold(x, y, tr, va, 8, 0, 1)
    assert m["saved_mib"] < 0.3 * r1["saved_mib"]


def test_cli_tiny_run_writes_table_json_and_plot(tmp_path, capsys):
    from tools.accuracy import main

    res = main(["--folds", "2", "--seeds", "0", "--epochs", "1", "--modes", "exact", "mesa2",
                "--out", str(tmp_path)])
    assert len(res["runs"]) == 4
    for mode in ("exact", "mesa2"):  # every image validated once
        assert sum(r["n"] for r in res["runs"] if r["mode"] == mode) == 1797
    out = capsys.readouterr().out
    assert "| mesa2 |" in out and "vs exact (points)" in out
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [r["mode"] for r in saved["summary"]] == ["exact", "mesa2"]
    assert (tmp_path / "table.md").read_text().startswith("Demo DeiT on DIGITS")
    # --resume reads the runs back instead of training
    again = main(["--folds", "2", "--seeds", "0", "--epochs", "1", "--modes", "exact", "mesa2",
                  "--out", str(tmp_path), "--resume"])
    assert [r["correct"] for r in again["runs"]] == [r["correct"] for r in res["runs"]]
    # two worker processes: the same runs (each seeds itself), in the same order
    par = main(["--folds", "2", "--seeds", "0", "--epochs", "1", "--modes", "exact", "mesa2",
                "--out", str(tmp_path / "par"), "--jobs", "2"])
    assert [(r["mode"], r["fold"], r["correct"]) for r in par["runs"]] == \
        [(r["mode"], r["fold"], r["correct"]) for r in res["runs"]]
    assert "2 at a time, 1 thread each" in capsys.readouterr().out
    pytest.importorskip("matplotlib")  # (last: the rest runs without it)
    assert (tmp_path / "accuracy.png").stat().st_size > 1000
