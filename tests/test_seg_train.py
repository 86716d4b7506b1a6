"""Segmentation training end to end on a tiny synthetic ADE20K (data.ade20k): two iterations of
mmengine's Runner with Mesa on (PVT + Semantic FPN, Swin + UperNet), an evaluation (mIoU), a
checkpoint, a resumed run that continues from it (weights-only torch.load), the test tool's path;
and the saved activations of a segmentation train step, Mesa on vs off."""
from __future__ import annotations

import pytest

# the segmentation stack is optional (pip install -e ".[seg]"): without it these tests skip
for _mod in ("mmengine", "mmcv", "mmseg"):
    pytest.importorskip(_mod, reason=f"{_mod} is not installed (the optional segmentation stack)",
                        exc_type=ImportError)

import glob
import os
import subprocess
import sys
import uuid

import torch

import models.seg  # noqa: F401
from data.ade20k import make_synthetic_ade20k
from models.seg import build_config, run_test, run_train
from benchmarks.seg import train_step_stats
from models.seg.runner import tiny_run_options

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PVT_MESA = os.path.join(REPO, "configs/seg/fpn_pvt-tiny-mesa8_8xb4-40k_ade20k-512x512.py")
SWIN_MESA = os.path.join(REPO, "configs/seg/upernet_swin-tiny-patch4-window7-mesa8_8xb2-160k_ade20k-512x512"
                               ".py")


@pytest.fixture(scope="module")
def ade_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("ade") / "ADEChallengeData2016"
    assert make_synthetic_ade20k(root, num_train=4, num_val=2, size=(48, 64)) == {"training": 4,
                                                                                   "validation": 2}
    return str(root)


def _options(ade_root, crop, iters, extra):
    opts = tiny_run_options(ade_root, crop=crop, iters=iters, batch=2, test_scale=crop)
    opts["experiment_name"] = f"test_{uuid.uuid4().hex[:8]}"  # one log file per run in this process
    opts.update(extra)
    return opts


def _run_log(runner) -> str:
    with open(os.path.join(runner.log_dir, f"{runner.timestamp}.log")) as f:
        return f.read()


def _train_eval_resume(config, ade_root, work_dir, crop, extra, test_tool):
    cfg = build_config(config, work_dir=str(work_dir), cfg_options=_options(ade_root, crop, 2, extra))
    runner = run_train(cfg)
    assert runner.iter == 2
    assert os.path.isfile(work_dir / "iter_2.pth")
    log = _run_log(runner)
    assert "Iter(val) [2/2]" in log and "mIoU:" in log
    assert any(m.enable for m in runner.model.backbone.modules() if hasattr(m, "enable"))  # Mesa on
    if test_tool:  # what tools/seg_test.py runs: the checkpoint loaded (weights only), mIoU returned
        cfg = build_config(config, work_dir=str(work_dir), cfg_options=_options(ade_root, crop, 2, extra))
        metrics = run_test(cfg, str(work_dir / "iter_2.pth"))
        assert 0.0 <= metrics["mIoU"] <= 100.0
        print(f"{os.path.basename(config)}: 2 iterations, test mIoU {metrics['mIoU']:.2f} "
              f"(aAcc {metrics['aAcc']:.2f}) on the synthetic set")

    opts = _options(ade_root, crop, 3, extra)
    opts["default_hooks.checkpoint.interval"] = 1
    resumed = run_train(build_config(config, work_dir=str(work_dir), cfg_options=opts, resume="auto"))
    log = _run_log(resumed)
    assert "resumed epoch: 0, iter: 2" in log
    assert "Iter(train) [3/3]" in log and "Iter(train) [1/3]" not in log  # continued, not restarted
    assert resumed.iter == 3 and os.path.isfile(work_dir / "iter_3.pth")
    # an explicit checkpoint path resumes too
    opts = _options(ade_root, crop, 3, extra)
    cfg = build_config(config, work_dir=str(work_dir / "from_path"), cfg_options=opts,
                       resume=str(work_dir / "iter_2.pth"))
    assert cfg.resume is True and cfg.load_from.endswith("iter_2.pth")


def test_pvt_fpn_mesa_train_eval_resume(ade_root, tmp_path):
    _train_eval_resume(PVT_MESA, ade_root, tmp_path, crop=64, extra={"model.backbone.img_size": 64},
                       test_tool=True)


def test_swin_upernet_mesa_train_eval_resume(ade_root, tmp_path):
    # UperNet's 512-channel head dominates a CPU step: narrower heads keep the test in budget
    # 32x32 crops: stage maps 8, 4, 2, 1 px, each padded to the 7x7 window (the any-size path)
    _train_eval_resume(SWIN_MESA, ade_root, tmp_path, crop=32,
                       extra={"model.decode_head.channels": 32, "model.auxiliary_head.channels": 16},
                       test_tool=False)


def test_build_config_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config not found"):
        build_config(str(tmp_path / "nope.py"))
    with pytest.raises(ValueError, match="launcher"):
        build_config(PVT_MESA, launcher="mars")
    with pytest.raises(FileNotFoundError, match="--resume checkpoint not found"):
        build_config(PVT_MESA, resume=str(tmp_path / "missing.pth"))


@pytest.mark.parametrize("config,crop", [(PVT_MESA, 128), (SWIN_MESA, 64)])
def test_seg_train_step_saved_activations(config, crop):
    """Saved activations of one train iteration of the whole segmentor (backbone + neck + heads +
    loss), Mesa 8-bit vs off, at the largest crop the test budget allows (the benchmark,
    tools/seg_benchmark.py, measures 512x512)."""
    on = train_step_stats(config, crop=crop, batch=2, mesa=True, steps=0)
    off = train_step_stats(config, crop=crop, batch=2, mesa=False, model=on["model"], steps=0)
    ratio = on["saved_bytes"] / off["saved_bytes"]
    print(f"{os.path.basename(config)} crop {crop} batch 2: saved {on['saved_bytes'] / 2**20:.1f} MiB "
          f"with Mesa "
          f"vs {off['saved_bytes'] / 2**20:.1f} MiB exact ({ratio:.3f}x)")
    assert off["mesa_layers_on"] == 0 and on["mesa_layers_on"] > 0
    assert ratio < 0.8  # the backbone's activations at ~1/4, the heads' exact


def test_seg_configs_listed():
    assert len(glob.glob(os.path.join(REPO, "configs/seg/*.py"))) == 14


# ---- the tools' bad-input errors: one line, exit status 1, before the Runner is built ----------
def _tool_error(tool: str, argv) -> str:
    import runpy

    main = runpy.run_path(os.path.join(REPO, "tools", tool), run_name="tool_under_test")["main"]
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in argv])
    msg = exc.value.code
    assert isinstance(msg, str) and msg.startswith("error: ") and "\n" not in msg, msg
    return msg


def _roots(root) -> list:
    return ["--cfg-options"] + [f"{d}.dataset.data_root={root}"
                                for d in ("train_dataloader", "val_dataloader", "test_dataloader")]


def test_tools_missing_ade20k_is_one_line_with_the_layout(tmp_path, capsys):
    root = tmp_path / "ade" / "ADEChallengeData2016"
    msg = _tool_error("seg_train.py", [PVT_MESA, "--work-dir", tmp_path / "w"] + _roots(root))
    assert f"ADE20K not found (train_dataloader): no directory {root}/images/training" in msg, msg
    assert f"expected {root}/images/training/*.jpg with {root}/annotations/training/*.png" in msg
    assert "python -m data.ade20k DIR" in msg and "--synthetic" in msg and "ADEChallengeData2016.zip" in msg
    assert "Environment" not in capsys.readouterr().out  # failed before the Runner's environment dump
    ck = tmp_path / "c.pth"
    torch.save({"state_dict": {}}, ck)
    msg = _tool_error("seg_test.py", [PVT_MESA, ck, "--work-dir", tmp_path / "w"] + _roots(root))
    assert "ADE20K not found (test_dataloader)" in msg
    # the layout checker the message points at
    from data.ade20k import main as check

    with pytest.raises(SystemExit, match="missing directory"):
        check([str(root)])
    check([str(root), "--synthetic"])
    assert "ADE20K layout ok, training 4 image/label pairs, validation 2" in capsys.readouterr().out


def test_tools_truncated_checkpoint_is_one_line(ade_root, tmp_path):
    full = tmp_path / "iter_2.pth"
    torch.save({"state_dict": {"w": torch.randn(64, 64)}, "meta": {}}, full)
    cut = tmp_path / "cut.pth"
    cut.write_bytes(full.read_bytes()[: full.stat().st_size // 2])
    msg = _tool_error("seg_test.py", [PVT_MESA, cut, "--work-dir", tmp_path / "w"] + _roots(ade_root))
    assert f"checkpoint {cut}: not a readable PyTorch checkpoint" in msg and "truncated" in msg, msg
    msg = _tool_error("seg_train.py", [PVT_MESA, "--resume", cut, "--work-dir", tmp_path / "w"] + _roots(ade_root))
    assert f"--resume checkpoint {cut}: not a readable" in msg
    # --resume alone: the work dir's last checkpoint, checked the same way
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "last_checkpoint").write_text(str(cut))
    msg = _tool_error("seg_train.py", [PVT_MESA, "--resume", "--work-dir", tmp_path / "w"] + _roots(ade_root))
    assert f"--resume checkpoint {cut}: not a readable" in msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="--amp is refused only without CUDA")
def test_tools_amp_on_cpu_is_one_line_exit_1(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(REPO, "tools", "seg_train.py"), PVT_MESA, "--amp",
                        "--work-dir", str(tmp_path / "w")], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode == 1, p.stderr
    assert p.stderr.strip() == ("error: --amp needs a CUDA device: mmengine's AmpOptimWrapper (fp16 with a "
                                "dynamic loss scale) does not run on CPU"), p.stderr
