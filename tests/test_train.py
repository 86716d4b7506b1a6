"""tools/train.py / the training package end to end on CPU: one epoch on FAKE and on DIGITS with
Mesa (finite loss, checkpoint written and weights_only-loadable, ``--eval --resume`` (also a
file:// URL) prints the same accuracy), exact resume, the throughput protocol, DeiT's spellings,
and bad arguments (one-line error, non-zero exit, no traceback). The 2-process torchrun run is in
tests/test_train_dist.py."""
from __future__ import annotations

import json
import os
import pathlib
import re
import runpy
import subprocess
import sys
import zipfile

import pytest
import torch

import mesa_ops as ms
import models
import training
from mesa_ops import planner
from training.args import parse_args

ROOT = pathlib.Path(__file__).resolve().parents[1]
TRAIN_PY = ROOT / "tools" / "train.py"
# a DeiT-Ti with 1 block of width 32 on 32 px images, patch 8 (16 tokens): seconds per epoch
TINY = ["--model", "deit_tiny_patch16_224", "--model-kwargs", "patch_size=8", "depth=1", "embed_dim=32",
        "num_heads=2", "--input-size", "32", "--num-workers", "0", "--print-freq", "2", "--device", "cpu"]
FAKE = ["--data-set", "FAKE", "--fake-size", "64", "--batch-size", "16"]
ACC_LINE = re.compile(r"^\* Acc@1 [\d.]+ Acc@5 [\d.]+ loss [\d.]+$", re.MULTILINE)


def run(argv) -> dict:
    return training.main(parse_args([str(a) for a in argv]))


def acc_lines(text: str) -> list[str]:
    return ACC_LINE.findall(text)


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: these tiny models gain nothing from two, and on a busy shared box
    OpenMP's spinning threads make them ~10x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _no_env(monkeypatch, tmp_path):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))  # torch.hub caches URLs by file name


def test_fake_one_epoch_checkpoint_logs_and_eval_from_url(tmp_path, capsys):
    out = tmp_path / "run"
    stats = run(TINY + FAKE + ["--epochs", "1", "--output-dir", out])
    text = capsys.readouterr().out
    assert torch.isfinite(torch.tensor(stats["train_loss"]))
    assert re.search(r"Epoch: \[0\]  \[0/4\]  eta: \S+  lr: [\d.]+  loss: [\d.]+ \([\d.]+\)  img/s: [\d.]+  "
                     r"time: [\d.]+  data: [\d.]+  max mem: \d+", text), text
    for name in ("checkpoint.pth", "best_checkpoint.pth", "args.json", "log.txt"):
        assert (out / name).is_file(), name
    assert list(out.glob("events.out.tfevents.*")), "no tensorboard file"
    assert not list(out.glob(".tmp_*")), "temporary checkpoint left behind"
    ck = torch.load(out / "checkpoint.pth", weights_only=True)
    assert ck["epoch"] == 0 and isinstance(ck["args"], dict) and ck["args"]["data_set"] == "FAKE"
    assert {"model", "optimizer", "lr_scheduler", "model_ema", "rng", "meta"} <= set(ck)
    rec = json.loads((out / "log.txt").read_text().splitlines()[-1])
    assert rec["epoch"] == 0 and rec["test_acc1"] == stats["test_acc1"] and rec["train_saved_act_mib"] > 0
    assert json.loads((out / "args.json").read_text())["model"] == "deit_tiny_patch16_224"
    trained = acc_lines(text)
    assert len(trained) == 1

    run(TINY + FAKE + ["--eval", "--resume", (out / "checkpoint.pth").as_uri()])
    assert acc_lines(capsys.readouterr().out) == trained


def test_digits_with_mesa_one_epoch_then_eval(tmp_path, capsys):
    out = tmp_path / "digits"
    stats = run(TINY + ["--data-set", "DIGITS", "--batch-size", "128", "--epochs", "1", "--output-dir", out,
                        "--ms-policy", ROOT / "configs/mesa/mesa_8bit.txt", "--unscale-lr", "--lr", "2e-3",
                        "--warmup-epochs", "0", "--mixup", "0", "--cutmix", "0"])
    text = capsys.readouterr().out
    assert "mesa policy: fc:" in text and torch.isfinite(torch.tensor(stats["train_loss"]))
    assert "Start training for 1 epochs (lr 0.002 as given, --unscale-lr: not scaled by the global batch " \
           "128)" in text
    ck = torch.load(out / "checkpoint.pth", weights_only=True)
    assert all(m["enable"] for n, m in ck["meta"]["mesa"].items() if "fc" in n)
    on = {n for n, m in ck["meta"]["mesa"].items() if m["enable"]}
    iters = {k: float(v) for k, v in ck["model"].items()
             if k.endswith(".iteration") and re.sub(r"(\.quant[12])?\.iteration$", "", k) in on}
    used = [v for v in iters.values() if v > 0]  # (attention may store q/k/v via SDPA instead of mm1/mm2)
    # layernorm, gelu, attention, the fc layers that store their own input...: 1497 // 128 steps
    # each (the fc fed by a LayerNorm or a GELU reuses that layer's copy and does not run)
    assert len(used) >= 4 and set(used) == {11.0}
    trained = acc_lines(text)
    run(TINY + ["--data-set", "DIGITS", "--batch-size", "128", "--eval", "--resume", out / "checkpoint.pth",
                "--ms-policy", ROOT / "configs/mesa/mesa_8bit.txt"])
    assert acc_lines(capsys.readouterr().out) == trained


def test_resume_is_exact(tmp_path, capsys):
    """2 epochs straight == 1 epoch, stop, resume 1 epoch: the same weights, EMA, optimizer state,
    with every random stream in use (mixup / cutmix, RandAugment, random erasing, drop path,
    Mesa's stochastic rounding)."""
    common = TINY + FAKE + ["--epochs", "2", "--mesa-bits", "8", "--drop-path", "0.1", "--warmup-epochs", "1",
                            "--model-ema-decay", "0.9"]
    run(common + ["--output-dir", tmp_path / "straight"])
    run(common + ["--output-dir", tmp_path / "split", "--stop-after", "1"])
    assert torch.load(tmp_path / "split" / "checkpoint.pth", weights_only=True)["epoch"] == 0
    run(common + ["--output-dir", tmp_path / "split", "--resume", tmp_path / "split" / "checkpoint.pth"])
    text = capsys.readouterr().out
    assert "resumed from" in text and "(lr 1.56e-05 = 0.0005 x 16 / 512)" in text
    a = torch.load(tmp_path / "straight" / "checkpoint.pth", weights_only=True)
    b = torch.load(tmp_path / "split" / "checkpoint.pth", weights_only=True)
    assert a["epoch"] == b["epoch"] == 1
    assert any(float(v) > 0 for k, v in a["model"].items() if k.endswith("iteration"))
    for part in ("model", "model_ema"):
        for k, v in a[part].items():
            assert torch.equal(v, b[part][k]), f"{part}.{k} differs after resume"
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])
    assert torch.equal(a["rng"][0]["torch"], b["rng"][0]["torch"])
    # a different seed gives different weights: the comparison above can fail
    run(common + ["--output-dir", tmp_path / "other", "--seed", "1", "--stop-after", "1"])
    c = torch.load(tmp_path / "other" / "checkpoint.pth", weights_only=True)
    d = torch.load(tmp_path / "split" / "checkpoint.pth", weights_only=True)
    assert not torch.equal(c["model"]["head.weight"], d["model"]["head.weight"])


def test_train_throughput_protocol(capsys):
    stats = run(TINY + FAKE + ["--train-throughput", "--mesa-bits", "8"])
    text = capsys.readouterr().out
    assert re.search(r"batch_size 16 throughput [\d.]+ img/s \([\d.]+ ms / step, "
                     r"20 warm-up \+ 30 timed steps\)", text)
    assert re.search(r"memory usage: \d+ MB \(peak RSS\)", text)
    assert stats["img/s"] > 0 and stats["max_mem_mb"] > 0


def test_deit_spellings_and_defaults():
    a = parse_args(["--model", "deit_small_patch16_224", "--data-path", "/d", "--output_dir", "o",
                    "--num_workers", "3", "--dist_url", "tcp://h:1", "--ms_policy", "p.txt",
                    "--batch-size", "128", "--no-model-ema"])
    assert (a.output_dir, a.num_workers, a.dist_url, a.ms_policy, a.data_path) == \
           ("o", 3, "tcp://h:1", "p.txt", "/d")
    assert (a.batch_size, a.model_ema, a.lr, a.weight_decay, a.smoothing, a.mixup, a.cutmix, a.reprob) == \
           (128, False, 5e-4, 0.05, 0.1, 0.8, 1.0, 0.25)
    assert a.aa == "rand-m9-mstd0.5-inc1" and a.repeated_aug and a.warmup_epochs == 5 and a.sched == "cosine"
    b = parse_args(["--output-dir", "o", "--num-workers", "1", "--data-set", "cifar"])
    assert (b.output_dir, b.num_workers, b.data_set) == ("o", 1, "CIFAR")


def _cli_error(argv) -> str:
    main = runpy.run_path(str(TRAIN_PY), run_name="train_under_test")["main"]
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in argv])
    msg = exc.value.code
    assert isinstance(msg, str) and msg.startswith("error: ") and "\n" not in msg, msg
    return msg


def test_bad_arguments_give_one_line_errors(tmp_path):
    assert "unknown model 'deit_nope'" in _cli_error(["--model", "deit_nope", "--data-set", "FAKE"])
    msg = _cli_error(TINY + ["--data-set", "IMNET", "--data-path", tmp_path / "no_imagenet"])
    assert "ImageNet folder" in msg and "train/n01440764" in msg
    bad = tmp_path / "bad_policy.txt"
    bad.write_text("on fc:\n    by_index: all\n    enable: maybe\n")
    assert "bad_policy.txt" in _cli_error(TINY + FAKE + ["--ms-policy", bad])
    assert "no such file" in _cli_error(TINY + FAKE + ["--ms-policy", tmp_path / "none.txt"])
    other = models.create_model("deit_tiny_patch16_224", patch_size=8, depth=1, embed_dim=48, num_heads=2,
                                img_size=32, num_classes=10)
    models.save_checkpoint(other, tmp_path / "other.pth")
    msg = _cli_error(TINY + FAKE + ["--eval", "--resume", tmp_path / "other.pth"])
    assert "does not fit the model: checkpoint is deit_tiny_patch16_224 (48-dim), model is " \
           "deit_tiny_patch16_224 (32-dim)" in msg, msg
    assert "there is no EMA to evaluate" in _cli_error(TINY + FAKE + ["--no-model-ema", "--model-ema-eval"])
    assert "--model-ema-force-cpu does not apply" in _cli_error(TINY + FAKE + ["--fsdp", "--model-ema-force-cpu"])


def test_checkpoint_of_another_model_is_one_line(tmp_path):
    """A DeiT-Ti checkpoint resumed into a DeiT-S (here: both narrowed): both models named with
    their widths, each key once (not listed as missing and mismatched), no quantizer-group hint."""
    kw = dict(patch_size=8, depth=1, num_heads=2, img_size=32, num_classes=10)
    models.save_checkpoint(models.create_model("deit_tiny_patch16_224", embed_dim=48, **kw), tmp_path / "ti.pth")
    small = [a if a != "deit_tiny_patch16_224" else "deit_small_patch16_224" for a in TINY]
    msg = _cli_error(small + FAKE + ["--eval", "--resume", tmp_path / "ti.pth"])
    assert f"{tmp_path / 'ti.pth'} does not fit the model: checkpoint is deit_tiny_patch16_224 (48-dim), " \
           "model is deit_small_patch16_224 (32-dim); " in msg, msg
    assert "e.g. cls_token: checkpoint (1, 1, 48) vs model (1, 1, 32)" in msg
    assert "missing" not in msg and "quant_group" not in msg
    # an official-style file (no recorded architecture) of another width: the same line
    sd = models.create_model("deit_small_patch16_224", embed_dim=48, **kw).state_dict()
    with pytest.raises(models.CheckpointError, match=r"checkpoint is of another model \(48-dim\), model is "
                                                     r"deit_tiny_patch16_224 \(32-dim\)"):
        models.load_checkpoint(models.create_model("deit_tiny_patch16_224", embed_dim=32, **kw), sd)


def test_cli_error_exit_status_without_traceback():
    p = subprocess.run([sys.executable, str(TRAIN_PY), "--model", "deit_nope", "--data-set", "FAKE"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 1
    assert "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip().startswith("error: unknown model 'deit_nope'"), p.stderr


def test_finetune_keeps_the_backbone_and_reinitialises_a_head_of_another_size(tmp_path):
    kw = dict(patch_size=8, depth=1, embed_dim=32, num_heads=2, img_size=32)
    src = models.create_model("deit_tiny_patch16_224", num_classes=1000, **kw)
    torch.save({"model": src.state_dict()}, tmp_path / "imagenet.pth")  # an official-style checkpoint
    a = training.resolve_args(parse_args(TINY + FAKE + ["--finetune", str(tmp_path / "imagenet.pth")]))
    m = training.build_model(a, num_classes=10)
    assert torch.equal(m.blocks[0].attn.qkv.weight, src.blocks[0].attn.qkv.weight)
    assert m.head.weight.shape == (10, 32)


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "scripts" / "paper").glob("*.sh")))
def test_paper_scripts_give_valid_arguments(script, tmp_path):
    """Each paper script, launched with PYTHON=echo, prints the torchrun command; its tools/train.py
    arguments parse, name a known model and an existing policy file."""
    env = {"PATH": "/usr/bin:/bin", "PYTHON": "echo", "HOME": str(tmp_path)}
    p = subprocess.run(["bash", str(ROOT / "scripts" / "paper" / script)], capture_output=True, text=True,
                       env=env, timeout=60, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    words = p.stdout.split()
    assert words[:2] == ["-m", "torch.distributed.run"] and "--nproc_per_node" in words
    a = parse_args(words[words.index(str(TRAIN_PY)) + 1:])
    assert models.is_model(a.model)
    assert a.batch_size == (96 if script.startswith("cifar") else 128)
    assert (a.ms_policy is not None) == script.endswith("_mesa.sh")
    if a.ms_policy:
        assert (ROOT / a.ms_policy).is_file()
    assert a.amp == "fp16" and a.epochs in (300, 1000) and a.output_dir.endswith(script[:-3])


def test_report_groups_runs_by_label_prefix(tmp_path):
    """The demo's table: one row per run, and per GROUP/NAME group the mean final top-1 and its
    difference to the first group."""
    import json

    from training import report

    def log(name, acc):
        d = tmp_path / name
        d.mkdir(parents=True)
        (d / "log.txt").write_text(json.dumps(dict(epoch=1, test_acc1=acc, max_accuracy=acc + 1,
                                                   train_saved_act_mib=4.0 if "exact" in name else 1.0,
                                                   train_step_ms=10.0, train_max_mem_mb=800)) + "\n")
        return str(d)

    runs = {"exact/s0": log("exact0", 98.0), "mesa8/s0": log("mesa0", 96.0),
            "exact/s1": log("exact1", 96.0), "mesa8/s1": log("mesa1", 97.0)}
    out = report.table(runs)
    assert "| mesa8/s0 | 2 | 96.00% (97.00%) | 1.00 MiB (0.250x) |" in out
    assert "| exact | 2 | 97.00% (96.00 - 98.00) | +0.00 points | 98.00% |" in out
    assert "| mesa8 | 2 | 96.50% (96.00 - 97.00) | -0.50 points | 97.50% |" in out


def _flip_tensor_bytes(path, n: int = 400) -> None:
    """Invert ``n`` bytes in the middle of the largest tensor record of a torch.save zip (what a
    bad disk or copy does; torch.load does not check the zip's CRCs)."""
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = (int.from_bytes(f.read(2), "little") for _ in range(2))
        start = info.header_offset + 30 + name_len + extra_len + info.file_size // 2 - n // 2
        f.seek(start)
        data = f.read(n)
        f.seek(start)
        f.write(bytes(b ^ 0xFF for b in data))


def test_corrupted_checkpoint_is_refused_and_foreign_ones_load(tmp_path, capsys):
    out = tmp_path / "run"
    run(TINY + FAKE + ["--epochs", "1", "--output-dir", out])
    path = out / "checkpoint.pth"
    ck = torch.load(path, weights_only=True)
    assert ck["checksum"]["algorithm"] == "sha256-tree-v1"
    assert ck["checksum"]["value"] == models.checkpoint.payload_checksum(ck)
    assert models.checkpoint.verify_checksum(training.checkpoint.read_checkpoint(path), str(path))
    _flip_tensor_bytes(path)
    torch.load(path, weights_only=True)  # torch itself reads the damaged file without complaint
    msg = _cli_error(TINY + FAKE + ["--eval", "--resume", path])
    assert "checksum mismatch" in msg and str(path) in msg and "corrupted" in msg
    # a checkpoint without a checksum (official / original Mesa files) loads as before
    foreign = tmp_path / "foreign.pth"
    torch.save({"model": ck["model"]}, foreign)
    capsys.readouterr()
    run(TINY + FAKE + ["--eval", "--resume", foreign])
    assert acc_lines(capsys.readouterr().out)
    # models.save_checkpoint writes one too
    m = models.create_model("deit_tiny_patch16_224", patch_size=8, depth=1, embed_dim=32, num_heads=2,
                            img_size=32, num_classes=10)
    models.save_checkpoint(m, tmp_path / "m.pth")
    assert models.checkpoint.verify_checksum(torch.load(tmp_path / "m.pth", weights_only=True), "m.pth")


def test_output_dir_of_a_run_needs_resume_or_overwrite(tmp_path, capsys):
    out = tmp_path / "run"
    args = TINY + FAKE + ["--epochs", "1", "--output-dir", out, "--no-tensorboard"]
    run(args)
    first = (out / "log.txt").read_text()
    msg = _cli_error(args)
    assert f"--output-dir {out} holds a run already" in msg and "--resume" in msg and "--overwrite" in msg
    assert (out / "log.txt").read_text() == first  # nothing touched
    (out / "notes.txt").write_text("mine")
    run(args + ["--overwrite", "--seed", "1"])
    assert "--overwrite: deleted" in capsys.readouterr().out
    lines = (out / "log.txt").read_text().splitlines()
    assert len(lines) == 1 and lines[0] != first.strip()  # one run in the log, the new one
    assert json.loads((out / "args.json").read_text())["seed"] == 1
    assert (out / "notes.txt").read_text() == "mine"  # files the run did not write stay
    # --resume continues the run in place (the log grows by the new epoch)
    run(TINY + FAKE + ["--epochs", "2", "--output-dir", out, "--no-tensorboard", "--seed", "1",
                       "--resume", out / "checkpoint.pth"])
    assert len((out / "log.txt").read_text().splitlines()) == 2


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_checkpoint_file_mode_honours_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        training.checkpoint.atomic_save({"x": torch.zeros(2)}, str(tmp_path / "c.pth"))
        with open(tmp_path / "other.txt", "w") as f:
            f.write("x")
    finally:
        os.umask(old)
    mode = os.stat(tmp_path / "c.pth").st_mode & 0o777
    assert mode == 0o666 & ~umask == os.stat(tmp_path / "other.txt").st_mode & 0o777, oct(mode)


def test_eval_builds_no_training_split(tmp_path, capsys, monkeypatch):
    """--eval on FAKE with 16 training images and the default --batch-size 64: evaluation needs
    the validation split only (16 images at --fake-size 16)."""
    m = models.create_model("deit_tiny_patch16_224", patch_size=8, depth=1, embed_dim=32, num_heads=2,
                            img_size=32, num_classes=10)
    models.save_checkpoint(m, tmp_path / "m.pth")
    import data

    splits = []
    real = data.build_dataset
    monkeypatch.setattr(data, "build_dataset", lambda is_train, a: (splits.append(is_train), real(is_train, a))[1])
    stats = run(TINY + ["--data-set", "FAKE", "--fake-size", "16", "--eval", "--resume", tmp_path / "m.pth"])
    assert splits == [False] and 0 <= stats["acc1"] <= 100
    assert "on the 16 test images" in capsys.readouterr().out


def test_url_that_cannot_be_fetched_says_so(tmp_path):
    url = "http://127.0.0.1:9/deit_tiny_mesa.pth"  # nothing listens on the discard port
    msg = _cli_error(TINY + FAKE + ["--eval", "--resume", url])
    dst = tmp_path / "torch_home" / "hub" / "checkpoints" / "deit_tiny_mesa.pth"
    assert f"{url}: could not be downloaded (URLError" in msg and f"download it by hand to {dst}" in msg, msg
    assert "not a readable" not in msg
    msg = _cli_error(TINY + FAKE + ["--eval", "--resume", (tmp_path / "gone.pth").as_uri()])
    assert "could not be downloaded" in msg


# ---- memory plans that train -------------------------------------------------------------------
DIGITS2 = [a if a != "depth=1" else "depth=2" for a in TINY] + [
    "--data-set", "DIGITS", "--epochs", "1", "--no-tensorboard", "--print-freq", "100"]
MiB = 2.0 ** 20


def _exact_bytes_per_image() -> float:
    a = training.resolve_args(parse_args(DIGITS2))
    x = torch.randn(8, 3, 32, 32)
    return ms.audit(training.build_model(a, 10), x, verbose=False).total_bytes / 8


def _plan_line(text: str) -> tuple[float, float]:
    m = re.search(r"memory plan \(.*\): predicted saved activations ([\d.]+) MiB in the forward.*, measured "
                  r"([\d.]+) MiB in the first step's forward \(([\d.]+)x\), budget [\d.]+ MiB", text)
    assert m, text
    return float(m.group(1)), float(m.group(2))


def test_memory_budget_plans_for_the_given_batch(tmp_path, capsys):
    budget = 0.5 * 64 * _exact_bytes_per_image()  # half of the exact run's saved bytes
    out = tmp_path / "run"
    stats = run(DIGITS2 + ["--batch-size", "64", "--memory-budget-gb", budget / 1e9, "--output-dir", out])
    text = capsys.readouterr().out
    info = planner.read_plan(str(out / "memory_plan.txt"))
    assert info["batch_size"] == 64 and info["budget"] == int(budget)
    pred, measured = _plan_line(text)
    assert measured * MiB <= budget and measured <= 1.05 * pred  # the plan holds, and its prediction
    assert measured == pytest.approx(stats["train_saved_act_mib"], abs=0.01)
    assert re.search(r"memory plan \(.*memory_plan.txt\): batch 64, budget [\d.e-]+ GB, units ", text)
    # the plan it wrote trains again in the same directory, afresh: --overwrite keeps the plan it reads
    run(DIGITS2 + ["--batch-size", "64", "--ms-plan", out / "memory_plan.txt", "--output-dir", out, "--overwrite"])
    again = capsys.readouterr().out
    deleted = re.search(r"^--overwrite: deleted (.*) of the previous run", again, re.MULTILINE).group(1)
    assert _plan_line(again)[1] == pytest.approx(measured) and "checkpoint.pth" in deleted
    assert "memory_plan.txt" not in deleted and (out / "memory_plan.txt").is_file()


def test_batch_size_auto_takes_the_largest_batch_that_fits(tmp_path, capsys):
    per_image = _exact_bytes_per_image()
    budget = 16 * per_image  # the exact model fits batch 16
    out = tmp_path / "auto"
    stats = run(DIGITS2 + ["--batch-size", "auto", "--memory-budget-gb", budget / 1e9, "--output-dir", out])
    text = capsys.readouterr().out
    batch = json.loads((out / "args.json").read_text())["batch_size"]
    assert f"--batch-size auto: {batch}, the largest even batch" in text
    assert batch % 2 == 0 and batch >= 2 * 16  # Mesa's saving re-invested in a larger batch
    _, measured = _plan_line(text)
    assert measured * MiB <= budget and stats["train_saved_act_mib"] * MiB <= budget
    assert planner.read_plan(str(out / "memory_plan.txt"))["batch_size"] == batch
    assert "Start training for 1 epochs (lr" in text and f"x {batch} / 512" in text
    assert "needs --memory-budget-gb" in _cli_error(DIGITS2 + ["--batch-size", "auto"])


def test_ms_plan_of_plan_memory_trains_and_create_model_applies_it(tmp_path, capsys):
    """tools/plan_memory.py writes one file; tools/train.py --ms-plan applies its bits and
    checkpointed blocks and compares the predicted saved bytes with the first step's;
    models.create_model(ms_policy=plan) applies the same."""
    from tools.plan_memory import main as plan_memory

    per_image = _exact_bytes_per_image()
    plan_path = tmp_path / "plan.txt"
    plan, _ = plan_memory(["--model", "deit_tiny_patch16_224", "--model-kwargs", "patch_size=8", "depth=2",
                           "embed_dim=32", "num_heads=2", "--num-classes", "10", "--input-size", "32",
                           "--batch-size", "32", "--budget-gb", str(0.7 * 32 * per_image / 1e9),
                           "--out", str(plan_path)])
    assert any(plan.ckpt.values())  # exact checkpointing comes first (no error)
    capsys.readouterr()
    stats = run(DIGITS2 + ["--batch-size", "32", "--ms-plan", plan_path, "--output-dir", tmp_path / "run"])
    text = capsys.readouterr().out
    assert "mesa policy: checkpoint: " in text
    pred, measured = _plan_line(text)
    assert measured <= 1.05 * pred and measured * MiB <= 0.7 * 32 * per_image
    assert torch.isfinite(torch.tensor(stats["train_loss"]))
    assert re.search(r"\d+ Mesa layers enabled, [1-9]\d* blocks checkpointed", text)
    # the same file as --ms-policy (the run: no checkpointing, all exact, no word) does the same
    stats2 = run(DIGITS2 + ["--batch-size", "32", "--ms-policy", plan_path, "--output-dir", tmp_path / "run2"])
    text2 = capsys.readouterr().out
    assert _plan_line(text2)[1] == pytest.approx(measured) and torch.isfinite(torch.tensor(stats2["train_loss"]))
    m = models.create_model("deit_tiny_patch16_224", patch_size=8, depth=2, embed_dim=32, num_heads=2,
                            img_size=32, num_classes=10, ms_policy=str(plan_path))
    chosen = {f"blocks.{i}": b.mesa_checkpoint for i, b in enumerate(m.blocks)
              if getattr(b, "mesa_checkpoint", None)}
    assert {n: ("packed8" if c[1] == 8 else "exact") for n, c in chosen.items() if c[0]} == \
           {n: v for n, v in plan.ckpt.items() if v}
    assert {n: (mm.bits if mm.enable else 0) for n, mm in ms.policy.mesa_layers(m)} == \
           {n: plan.layer_bits.get(n, 0) for n, _ in ms.policy.mesa_layers(m)}
    # a plan of another depth is refused in one line
    other = [a if a != "depth=2" else "depth=1" for a in DIGITS2]
    msg = _cli_error(other + ["--batch-size", "32", "--ms-plan", plan_path])
    assert "with 2 blocks" in msg and "this model has 1 blocks" in msg
    assert "not a memory plan" in _cli_error(DIGITS2 + ["--ms-plan", ROOT / "configs/mesa/mesa_8bit.txt"])


def test_policy_enabling_no_layer_warns_loudly(tmp_path, capsys):
    pol = tmp_path / "nothing.txt"
    pol.write_text("on fc:\n    by_index: all\n    enable: False\n")
    a = training.resolve_args(parse_args(TINY + FAKE + ["--ms-policy", str(pol)]))
    training.build_model(a, 10)
    err = capsys.readouterr().err
    assert f"WARNING: --ms-policy {pol} enables no Mesa layer and checkpoints no block" in err
    with pytest.warns(UserWarning, match="enables no Mesa layer"):
        models.create_model("deit_tiny_patch16_224", img_size=32, depth=1, ms_policy=str(pol))
    a = training.resolve_args(parse_args(TINY + FAKE + ["--ms-policy", str(ROOT / "configs/mesa/mesa_8bit.txt")]))
    training.build_model(a, 10)
    assert "WARNING" not in capsys.readouterr().err


def test_epoch_lines(tmp_path, capsys):
    """--epoch-lines (scripts/demo.sh writing to a file or pipe): one line per epoch with its
    loss, lr, step time, saved activations and top-1, and no progress, averages or accuracy
    lines."""
    stats = run(TINY + FAKE + ["--epochs", "2", "--epoch-lines", "--no-model-ema", "--no-tensorboard"])
    text = capsys.readouterr().out
    lines = re.findall(r"^Epoch (\d)/2: loss [\d.]+  lr [\d.]+  step [\d.]+ ms  saved activations [\d.]+ MiB  "
                       r"top-1 ([\d.]+)% \(best [\d.]+%\)$", text, re.MULTILINE)
    assert [e for e, _ in lines] == ["1", "2"], text
    assert float(lines[-1][1]) == pytest.approx(stats["test_acc1"], abs=0.05)
    for other in ("Epoch: [", "Averaged stats", "* Acc@1", "Accuracy of the network", "Test:"):
        assert other not in text, other
    run(TINY + FAKE + ["--epochs", "1", "--epoch-lines", "--model-ema-eval", "--no-tensorboard"])
    text = capsys.readouterr().out  # (with the EMA evaluated: its top-1 on the same line)
    assert re.findall(r"^Epoch 1/1: .* EMA top-1 [\d.]+%$", text, re.MULTILINE), text
    assert "Accuracy of the EMA" not in text and "* Acc@1" not in text


def test_tqdm_bar_only_on_a_terminal(capsys, monkeypatch):
    """--tqdm draws a bar on a terminal; written to a file or pipe (not a tty) a bar would be
    one ever-growing line, so progress lines come instead."""
    from training.logs import MetricLogger

    ml = MetricLogger()
    for _ in ml.log_every(range(5), 2, "Epoch: [0]", use_tqdm=True):
        ml.update(loss=1.0)
    out = capsys.readouterr().out
    assert "\r" not in out and out.count("Epoch: [0]  [") == 3  # steps 0, 2, 4
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True, raising=False)
    for _ in ml.log_every(range(5), 2, "Epoch: [1]", use_tqdm=True):
        ml.update(loss=1.0)
    out = capsys.readouterr().out
    assert "Epoch: [1]  [" not in out and "5/5" in out  # the bar, no progress lines


def test_compiled_training_step_trains_as_the_eager_one(tmp_path, capsys):
    """--compile: the training step's model under torch.compile (aot_eager here: seconds to compile;
    inductor is the default). Mesa's kernels run as native ops in the compiled graphs, with the
    eager step's seeds: the same losses and weights as the eager run bit for bit, the saved
    activations measured on the second step (none while dynamo traces), the compiling step's time
    logged apart from the step time; a checkpoint of the uncompiled model's keys."""
    torch._dynamo.reset()  # (what earlier tests compiled: sizes dynamo would make symbolic)
    mesa = ["--ms-policy", ROOT / "configs/mesa/mesa_8bit.txt", "--epochs", "1", "--no-model-ema"]
    eager = run(TINY + FAKE + mesa + ["--output-dir", tmp_path / "eager"])
    capsys.readouterr()
    compiled = run(TINY + FAKE + mesa + ["--output-dir", tmp_path / "compiled", "--compile", "aot_eager"])
    text = capsys.readouterr().out
    assert "torch.compile (backend aot_eager)" in text
    assert re.search(r"torch\.compile: the first step took [\d.]+ s \(compiling; not in the step time\)", text), text
    assert compiled["train_loss"] == eager["train_loss"]
    assert compiled["train_saved_act_mib"] == pytest.approx(eager["train_saved_act_mib"], rel=0.02)
    a = torch.load(tmp_path / "eager" / "checkpoint.pth", weights_only=True)["model"]
    b = torch.load(tmp_path / "compiled" / "checkpoint.pth", weights_only=True)["model"]
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert "--compile with --fsdp: not supported yet" in _cli_error(TINY + FAKE + ["--compile", "--fsdp"])
