"""Issue 50 (part): any ImageFolder, bad images, image modes, one run per folder, temporary files
of killed writes, the best checkpoint written first, input sizes the patch does not divide,
non-finite validation and Mesa's non-finite stop with the epoch and step."""
from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

import mesa_ops as ms
import training
from data.images import load_image
from tests.test_train import TINY, TRAIN_PY, _cli_error, run  # noqa: F401  (fixtures below)
from tests.test_train import _no_env, _one_thread  # noqa: F401

CLASSES = ("ant", "bee", "cat")


def _folder(root, bad=True):
    """root/{train,val}/{ant,bee,cat}: small images of several modes and sizes, and in train a
    truncated JPEG, a zero-byte file and a text file named .JPEG."""
    rng = np.random.default_rng(0)
    for split, n in (("train", 6), ("val", 2)):
        for c, name in enumerate(CLASSES):
            d = root / split / name
            d.mkdir(parents=True)
            for i in range(n):
                arr = (rng.random((20 + 3 * i, 28, 3)) * 80 + 60 * c).astype(np.uint8)
                img = Image.fromarray(arr)
                img = (img, img.convert("L"), img.convert("RGBA"), img.convert("P"))[i % 4]
                img.save(d / f"{i}.png")
    if bad:
        t = root / "train" / "ant"
        Image.fromarray((rng.random((40, 40, 3)) * 255).astype(np.uint8)).save(t / "full.jpg", quality=90)
        data = (t / "full.jpg").read_bytes()
        (t / "truncated.jpg").write_bytes(data[: len(data) // 2])
        os.unlink(t / "full.jpg")
        (t / "empty.JPEG").write_bytes(b"")
        (t / "text.JPEG").write_text("not an image")
    return root


def _args(root, out, *extra):
    return TINY + ["--data-set", "FOLDER", "--data-path", root, "--batch-size", "6", "--epochs", "1",
                   "--output-dir", out, "--warmup-epochs", "0", *extra]


def test_any_image_folder_trains_and_skips_bad_images(tmp_path, capsys):
    root = _folder(tmp_path / "data")
    out = tmp_path / "out"
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        stats = run(_args(root, out))
    assert "test_acc1" in stats
    said = {str(r.message) for r in rec if "skipping unreadable image" in str(r.message)}
    assert {os.path.basename(m.split(" (")[0].split()[-1]) for m in said} == {"truncated.jpg", "empty.JPEG",
                                                                              "text.JPEG"}
    text = capsys.readouterr().out
    assert "skipped 3 unreadable image(s)" in text and "skipped_images.txt" in text
    # the class count is the folders': a 3-way head
    ckpt = torch.load(out / "checkpoint.pth", weights_only=True)
    assert ckpt["model"]["head.weight"].shape[0] == len(CLASSES)


def test_strict_data_names_the_first_bad_file(tmp_path):
    root = _folder(tmp_path / "data")
    msg = _cli_error(_args(root, tmp_path / "out", "--strict-data"))
    assert "unreadable image" in msg and str(root / "train" / "ant") in msg


def test_folders_with_other_classes_and_imagenet_hint(tmp_path):
    root = _folder(tmp_path / "data", bad=False)
    (root / "val" / "dog").mkdir()
    Image.new("RGB", (8, 8)).save(root / "val" / "dog" / "0.png")
    msg = _cli_error(_args(root, tmp_path / "out"))
    assert "hold different classes" in msg and "only in val: dog" in msg
    msg = _cli_error(TINY + ["--data-set", "IMNET", "--data-path", root])
    assert "expected 1000" in msg and "--data-set FOLDER" in msg


def test_image_modes_keep_their_content(tmp_path):
    """16-bit grayscale is scaled, not clipped to white; transparency is composited over white,
    not dropped; a palette image with a transparent colour too."""
    ramp = (np.arange(64 * 64).reshape(64, 64) * 16).astype(np.uint16)  # 0 .. 65520
    Image.fromarray(ramp).save(tmp_path / "g16.png")
    assert Image.open(tmp_path / "g16.png").mode.startswith("I")
    g = np.asarray(load_image(str(tmp_path / "g16.png")))
    assert g.shape == (64, 64, 3) and g.min() == 0 and g.max() >= 250 and len(np.unique(g)) > 200
    rgba = np.zeros((8, 8, 4), np.uint8)
    rgba[..., 0] = 200          # red under a transparent alpha
    Image.fromarray(rgba, "RGBA").save(tmp_path / "clear.png")
    assert np.asarray(load_image(str(tmp_path / "clear.png"))).min() == 255  # white, not red


def test_input_size_the_patch_does_not_divide_is_refused():
    argv = [a if a != "32" else "36" for a in TINY] + ["--data-set", "FAKE", "--fake-size", "16"]
    msg = _cli_error(argv)
    assert "--input-size 36 is not a multiple of" in msg and "patch size 8" in msg
    assert "use --input-size 32 or 40" in msg


def test_one_live_run_per_folder_and_temporaries_removed(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / ".tmp_checkpoint.pth.123.abcd").write_bytes(b"x" * 100)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from training.runfolder import lock_folder; f = lock_folder(sys.argv[1]); "
        "print('locked', flush=True); time.sleep(60)"), str(out)],
        stdout=subprocess.PIPE, text=True, cwd=str(TRAIN_PY.parents[1]),
        env={**os.environ, "PYTHONPATH": str(TRAIN_PY.parents[1])})
    try:
        assert holder.stdout.readline().strip() == "locked"
        argv = TINY + ["--data-set", "FAKE", "--fake-size", "16", "--batch-size", "8", "--epochs", "1",
                       "--output-dir", out]
        msg = _cli_error(argv)
        assert "is in use by a live run (PID" in msg and str(holder.pid) in msg
    finally:
        holder.kill()
        holder.wait()
    run(argv)  # the holder died: its lock went with it
    assert not list(out.glob(".tmp_*"))
    assert "removed 1 temporary file(s)" in capsys.readouterr().out


def test_non_finite_validation_is_an_error_naming_where():
    model = torch.nn.Linear(4, 3)
    x = torch.randn(8, 4)
    x[5, 1] = float("nan")
    loader = [(x[:4], torch.zeros(4, dtype=torch.long)), (x[4:], torch.zeros(4, dtype=torch.long))]
    with pytest.raises(training.TrainingError, match=r"validation at epoch 3: 1 of 8 images gave non-finite"):
        training.evaluate(loader, model, torch.device("cpu"), num_classes=3, where="epoch 3")


def test_mesa_non_finite_stop_names_epoch_and_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(ms.Linear(4, 8), ms.GELU(), ms.Linear(8, 3))
    ms.policy.set_mesa(model, True, 8)
    x = torch.randn(12, 4)
    x[9, 0] = float("inf")
    loader = [(x[i:i + 4], torch.zeros(4, dtype=torch.long)) for i in range(0, 12, 4)]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = training.engine.make_scaler("none", torch.device("cpu"))
    with pytest.raises(training.TrainingError, match=r"non-finite values at epoch 1, step 2: "):
        training.train_one_epoch(model, torch.nn.CrossEntropyLoss(), loader, opt, torch.device("cpu"), 1,
                                 scaler, "none", print_freq=100, quiet=True)
    assert math.isfinite(float(model[0].weight.sum()))


def _table_cases(tmp):
    """(argv, what the one line must say) for errors a user causes with arguments, files, folders."""
    root = _folder(tmp / "data", bad=False)
    empty = tmp / "empty"
    (empty / "train").mkdir(parents=True)
    (empty / "val").mkdir()
    notckpt = tmp / "notckpt.pth"
    notckpt.write_text("hello")
    badpolicy = tmp / "policy.txt"
    badpolicy.write_text("on fc:\n    bits: eleven\n")
    fake = ["--data-set", "FAKE", "--fake-size", "16", "--batch-size", "8"]
    return [
        (TINY + ["--data-set", "FOLDER"], "needs --data-path"),
        (TINY + ["--data-set", "FOLDER", "--data-path", tmp / "nowhere"], "not found"),
        (TINY + ["--data-set", "FOLDER", "--data-path", empty], str(empty / "train")),
        (TINY + ["--data-set", "IMNET", "--data-path", root], "expected 1000"),
        (TINY + fake + ["--resume", tmp / "missing.pth"], "missing.pth"),
        (TINY + fake + ["--eval", "--resume", notckpt], "notckpt.pth"),
        (TINY + fake + ["--ms-policy", badpolicy], "policy.txt"),
        ([a if a != "32" else "30" for a in TINY] + fake, "use --input-size 24 or 32"),
        (["--model", "deit_nope"] + fake, "unknown model 'deit_nope'"),
    ]


def test_user_errors_are_one_line_each(tmp_path):
    """Item 5: a table of inputs a user can get wrong, each answered by one line naming it."""
    for argv, says in _table_cases(tmp_path):
        msg = _cli_error(argv)
        assert says in msg, (argv, msg)


def test_verify_with_a_loss_of_the_whole_batch_falls_back():
    """A loss_fn closing over the whole batch's labels cannot take a part of the batch: verify
    judges by relative error then, and says why."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(ms.Linear(8, 16), ms.GELU(), ms.Linear(16, 3))
    ms.policy.set_mesa(net, True, 8)
    x, y = torch.randn(8, 8), torch.randint(0, 3, (8,))
    rep = ms.verify(net, x, loss_fn=lambda out: torch.nn.functional.cross_entropy(out, y), draws=1)
    assert rep.noise == {} and "loss_fn failed on a part of the batch" in rep.summary()


def test_overlapping_patch_embeddings_take_any_size(tmp_path):
    """The size check reads a patch embedding that drops a remainder (kernel = stride, no
    padding) only: timm's PVT-v2 (overlapping, padded) runs at 256 and is not refused; 16-bit
    grayscale loads alike from PNG (mode I;16) and TIFF (mode I)."""
    import timm

    from training.runfolder import check_patch_size

    check_patch_size(timm.create_model("pvt_v2_b0"), 256, "pvt_v2_b0")
    ramp = (np.arange(32 * 32).reshape(32, 32) * 3).astype(np.uint16)
    Image.fromarray(ramp).save(tmp_path / "a.png")
    Image.fromarray(ramp.astype(np.int32)).save(tmp_path / "a.tif")
    a, b = (np.asarray(load_image(str(tmp_path / n))) for n in ("a.png", "a.tif"))
    assert np.array_equal(a, b)
