"""A 2-process torchrun run on gloo with Mesa on: DDP keeps the weights equal, and the quantizers'
running ranges agree across ranks because their statistics are all-reduced before each EMA update
(``--no-mesa-dist-sync`` switches that off: then they differ, so the check can fail)."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
QUANT = ("clip_val", "shift", "iteration")


def torchrun(out: pathlib.Path, *extra) -> tuple[dict, dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "tools" / "train.py"), "--model", "deit_tiny_patch16_224", "--model-kwargs",
           "patch_size=8", "depth=1", "embed_dim=32", "num_heads=2", "--input-size", "32",
           "--data-set", "FAKE", "--fake-size", "64",
           "--batch-size", "8", "--epochs", "1", "--num-workers", "0", "--device", "cpu", "--mesa-bits", "8",
           "--output-dir", str(out), "--save-rank-state", "--print-freq", "100", "--no-tensorboard", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "2 process(es)" in p.stdout
    return tuple(torch.load(out / f"rank{r}_state.pth", weights_only=True)["model"] for r in (0, 1))


def test_two_ranks_end_with_the_same_weights_and_quantizer_state(tmp_path):
    a, b = torchrun(tmp_path / "sync")
    assert a.keys() == b.keys()
    quant = [k for k in a if k.rsplit(".", 1)[-1] in QUANT]
    assert any(float(a[k].max()) > 0 for k in quant if k.endswith("iteration"))
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs between ranks"
    ck = torch.load(tmp_path / "sync" / "checkpoint.pth", weights_only=True)
    assert len(ck["rng"]) == 2  # each rank's generators, for an exact resume

    c, d = torchrun(tmp_path / "nosync", "--no-mesa-dist-sync")
    differ = [k for k in quant if k.rsplit(".", 1)[-1] != "iteration" and not torch.equal(c[k], d[k])]
    assert differ, "without the all-reduce the ranks' running ranges should differ (different data)"
    assert all(torch.equal(c[k], d[k]) for k in c if k not in quant)  # weights: DDP
