"""A 2-process torchrun run on gloo with Mesa on: DDP keeps the weights equal, and the quantizers'
running ranges agree across ranks because their statistics are all-reduced before each EMA update
(``--no-mesa-dist-sync`` switches that off: then they differ, so the check can fail)."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
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


# ---- FSDP2 (tools/train.py --fsdp) against DDP, on DIGITS with Mesa on -----------------------
DIGITS = ["--model", "deit_tiny_patch16_224", "--model-kwargs", "patch_size=8", "depth=1", "embed_dim=32",
          "num_heads=2", "--input-size", "32", "--data-set", "DIGITS", "--batch-size", "64", "--epochs", "2",
          "--num-workers", "0", "--device", "cpu", "--mesa-bits", "8", "--save-rank-state",
          "--print-freq", "100", "--no-tensorboard", "--no-model-ema", "--mixup", "0", "--cutmix", "0",
          "--warmup-epochs", "0", "--unscale-lr", "--lr", "2e-3"]


def torchrun_digits(out: pathlib.Path, *extra, base=DIGITS) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "tools" / "train.py"), *base, "--output-dir", str(out), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


def rank_states(out: pathlib.Path) -> tuple[dict, dict]:
    return tuple(torch.load(out / f"rank{r}_state.pth", weights_only=True)["model"] for r in (0, 1))


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp") / "straight"
    return out, torchrun_digits(out, "--fsdp")


@pytest.mark.slow
def test_fsdp_equals_ddp_on_the_same_global_batch(fsdp_run, tmp_path):
    """Weights and quantizer state (ranges, iteration, draw counters) of 2 epochs under FSDP2 equal
    DDP's bit for bit, on both ranks; the sharded checkpoint folder and the whole model are written."""
    out, text = fsdp_run
    f0, f1 = rank_states(out)
    torchrun_digits(tmp_path / "ddp")
    d0, _ = rank_states(tmp_path / "ddp")
    assert f0.keys() == d0.keys()
    assert any(k.endswith(".draws") and int(v) > 0 for k, v in f0.items())
    for k in d0:
        assert torch.equal(f0[k], d0[k]), f"{k}: FSDP differs from DDP"
        assert torch.equal(f0[k], f1[k]), f"{k} differs between the FSDP ranks"
    assert (out / "checkpoint" / ".metadata").is_file() and (out / "checkpoint_full.pth").is_file()
    assert "saved activations" in text


@pytest.mark.slow
def test_fsdp_stop_and_resume_equals_an_uninterrupted_run(fsdp_run, tmp_path):
    straight, _ = fsdp_run
    torchrun_digits(tmp_path / "split", "--fsdp", "--stop-after", "1")
    text = torchrun_digits(tmp_path / "split", "--fsdp", "--resume", str(tmp_path / "split" / "checkpoint"))
    assert "resumed from" in text and "at epoch 1" in text
    a, _ = rank_states(straight)
    b, _ = rank_states(tmp_path / "split")
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs after resume"


@pytest.mark.slow
def test_fsdp_full_and_sharded_checkpoints_evaluate_to_the_same_acc1(fsdp_run, monkeypatch, capsys):
    """One process, no process group: --eval on the exported whole model (models.load_checkpoint)
    and on the sharded folder prints the training run's last accuracy line."""
    import models
    import training
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(k, raising=False)
    out, text = fsdp_run
    last = [ln for ln in text.splitlines() if ln.startswith("* Acc@1")][-1]
    full = torch.load(out / "checkpoint_full.pth", weights_only=True)
    m = models.create_model("deit_tiny_patch16_224", patch_size=8, depth=1, embed_dim=32, num_heads=2,
                            img_size=32, num_classes=10, ms_policy="mesa8")
    report = models.load_checkpoint(m, full, verbose=lambda *_: None)
    assert not report.missing_quantizer_keys
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for ck in ("checkpoint_full.pth", "checkpoint"):
            training.main(training.parse_args(DIGITS + ["--eval", "--resume", str(out / ck)]))
            lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("* Acc@1")]
            assert lines == [last], ck
    finally:
        torch.set_num_threads(n)


# ---- FSDP2 with DeiT's model EMA (issue 37 item 3) ---------------------------------------------
EMA = [a for a in DIGITS if a != "--no-model-ema"] + ["--model-ema-decay", "0.9", "--model-ema-eval"]


def torchrun_ema(out: pathlib.Path, *extra) -> str:
    return torchrun_digits(out, *extra, base=EMA)


def _ema_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("Accuracy of the EMA model")]


def test_fsdp_with_model_ema_equals_ddp_resumes_and_evaluates(tmp_path, monkeypatch, capsys):
    """``--fsdp`` with model EMA on (DeiT's default): each rank's EMA of its shards, gathered, is
    DDP's ModelEmaV3 bit for bit; stop + resume from the DCP folder continues it bit for bit; the
    exported whole checkpoint and the folder evaluate to the EMA accuracy the run printed."""
    import training

    text = torchrun_ema(tmp_path / "fsdp", "--fsdp")
    full = torch.load(tmp_path / "fsdp" / "checkpoint_full.pth", weights_only=True)
    ema = full["model_ema"]
    assert ema.keys() == full["model"].keys()
    assert not torch.equal(ema["head.weight"], full["model"]["head.weight"])
    torchrun_ema(tmp_path / "ddp")
    ddp = torch.load(tmp_path / "ddp" / "checkpoint.pth", weights_only=True)
    for k, v in ddp["model_ema"].items():  # ModelEmaV3: 'module.' + the model's keys
        assert torch.equal(ema[k[len("module."):]], v), f"{k}: the sharded EMA differs from DDP's"

    torchrun_ema(tmp_path / "split", "--fsdp", "--stop-after", "1")
    resumed = torchrun_ema(tmp_path / "split", "--fsdp", "--resume", str(tmp_path / "split" / "checkpoint"))
    assert "resumed from" in resumed and "none taken from" not in resumed
    again = torch.load(tmp_path / "split" / "checkpoint_full.pth", weights_only=True)["model_ema"]
    for k, v in ema.items():
        assert torch.equal(again[k], v), f"{k}: the EMA differs after resume"

    last = _ema_lines(text)
    assert len(last) == 2 and _ema_lines(resumed) == last[1:]
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(k, raising=False)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for ck in ("checkpoint_full.pth", "checkpoint"):
            training.main(training.parse_args(EMA + ["--eval", "--resume", str(tmp_path / "fsdp" / ck)]))
            assert _ema_lines(capsys.readouterr().out) == last[-1:], ck
    finally:
        torch.set_num_threads(n)
