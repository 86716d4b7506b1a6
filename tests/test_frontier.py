"""benchmarks.frontier / tools/frontier.py: every kind of mode builds, runs and is measured; the
saved bytes order as the methods do (issue 38). Figures are in docs/benchmarks.md, not asserted."""
from __future__ import annotations

import math

import torch

from benchmarks import frontier as F


def test_frontier_modes_order_and_outputs(tmp_path, capsys):
    from tools import frontier as tool

    modes = ["exact", "ckpt", "ckpt/2", "sac", "mesa8", "cckpt8", "cckpt4", "plan@0.5", "compile@0.05"]
    tool.main(["--model", "deit_tiny_patch16_224", "--input-size", "64", "--batch-size", "4", "--modes",
               ",".join(modes), "--steps", "1", "--warmup", "1", "--json", str(tmp_path / "f.json"),
               "--plot", str(tmp_path / "f.png"), "--markdown", str(tmp_path / "f.md")])
    text = capsys.readouterr().out
    assert (tmp_path / "f.png").stat().st_size > 1000 and (tmp_path / "f.md").read_text().strip() in text
    import json
    rows = {r["mode"]: F.FrontierRow(**r) for r in json.loads((tmp_path / "f.json").read_text())}
    assert set(rows) == set(modes)
    b = {m: r.saved_bytes for m, r in rows.items()}
    assert all(r.saved_bytes > 0 and math.isfinite(r.time_x) for r in rows.values()), rows
    # what each method keeps: less than exact; every block > every 2nd block; packed < plain
    assert b["cckpt4"] < b["cckpt8"] < b["ckpt"] < b["ckpt/2"] < b["exact"]
    assert b["ckpt"] < b["sac"] < b["exact"]  # (the policy keeps the matmul outputs: counted)
    assert b["mesa8"] < 0.35 * b["exact"] and b["plan@0.5"] <= 0.5 * b["exact"]
    assert b["compile@0.05"] < b["exact"] and "compile" in rows["compile@0.05"].note
    assert rows["exact"].saved_x == 1.0 and rows["exact"].time_x == 1.0
    front = F.pareto(list(rows.values()))
    assert "cckpt4" in front  # the fewest bytes: nothing beats it on both
    assert "| deit_tiny_patch16_224 | cckpt4 |" in text


def test_sac_block_gradients_equal_exact():
    """Selective checkpointing recomputes exactly: the gradients are the plain block's."""
    from models.deit import Block

    torch.manual_seed(0)
    block = Block(32, 2).train()
    x = torch.randn(2, 9, 32, requires_grad=True)
    g0 = torch.autograd.grad(block(x).square().sum(), [x] + list(block.parameters()))
    sac = F.SACBlock(block)
    g1 = torch.autograd.grad(sac(x).square().sum(), [x] + list(block.parameters()))
    assert sac.kept[0] > 0
    for a, c in zip(g0, g1):
        torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-6)


def test_frontier_eager_modes_on_swin_and_pvt():
    """The checkpointing modes wrap Swin's and PVT's blocks from outside (they ran only on DeiT
    before: a Swin stage read the wrapper's missing with_cp)."""
    for name, kw in (("swin_tiny_patch4_window7_224", dict(window_size=2)), ("pvt_tiny", {})):
        rows = {r.mode: r for r in F.frontier(name, ["exact", "ckpt", "sac", "cckpt8"], batch=2, input_size=64,
                                               warmup=0, steps=1, model_kwargs=kw)}
        assert rows["cckpt8"].saved_bytes < rows["ckpt"].saved_bytes < rows["sac"].saved_bytes \
            < rows["exact"].saved_bytes, (name, rows)
