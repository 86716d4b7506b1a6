"""Issue 34: the GPU check runs on a bare GPU machine (no venv, no network, no segmentation stack),
and its cheap stages are rehearsed here: offline dependencies from a wheel folder, the CUDA test
files collected, the benchmark's dry run with the paper's protocol; the project imports and the
segmentation tests skip without mmseg / mmengine / mmcv."""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _offline_deps():
    import importlib.util

    spec = importlib.util.spec_from_file_location("offline_deps", ROOT / "scripts" / "offline_deps.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _wheel(folder: pathlib.Path, dist: str, version: str, module: str, body: str) -> pathlib.Path:
    """A minimal wheel of ``dist`` holding package ``module`` (``__init__`` = body), as pip
    download leaves one; platlib content under .data/ exercises the merge."""
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{module}/__init__.py", body)
        z.writestr(f"{dist}-{version}.data/platlib/{module}_ext.py", "VALUE = 7\n")
        z.writestr(f"{dist}-{version}.data/scripts/tool", "#!/bin/sh\n")
        z.writestr(f"{dist}-{version}.dist-info/METADATA",
                   f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        z.writestr(f"{dist}-{version}.dist-info/RECORD", "")
    return path


def test_offline_deps_unpacks_what_is_missing_or_too_old(tmp_path):
    od = _offline_deps()
    wheels = tmp_path / "whl"
    wheels.mkdir()
    _wheel(wheels, "mesa_fake_dep", "1.0.0", "mesa_fake_dep", "__version__ = '1.0.0'\n")
    _wheel(wheels, "mesa_fake_dep", "2.1.0", "mesa_fake_dep", "__version__ = '2.1.0'\n")
    _wheel(wheels, "mesa_fake_sub", "0.3", "mesa_fake_sub", "")
    required = {"mesa_fake_dep": ("mesa_fake_dep", "2.0", {"mesa_fake_sub": "mesa_fake_sub"}),
                "json": ("json", None, {})}  # present (the standard library): left alone
    todo, report = od.plan(required, {})
    assert todo == ["mesa_fake_dep", "mesa_fake_sub"]
    assert report[0] == "mesa_fake_dep: missing, from the wheel folder" and "present" in report[1]
    assert od.find_wheel(str(wheels), "mesa-fake-dep").endswith("2.1.0-py3-none-any.whl")  # newest
    target = tmp_path / "target"
    for dist in todo:
        od.unpack(od.find_wheel(str(wheels), dist), str(target))
    assert (target / "mesa_fake_dep_ext.py").exists() and not (target / "tool").exists()
    out = subprocess.run([sys.executable, "-c", "import mesa_fake_dep, mesa_fake_dep_ext, mesa_fake_sub, "
                          "importlib.metadata as m; print(mesa_fake_dep.__version__, "
                          "m.version('mesa_fake_dep'), mesa_fake_dep_ext.VALUE)"],
                         env=dict(os.environ, PYTHONPATH=str(target)), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2.1.0", "2.1.0", "7"]
    # now present at 2.1.0 (on the path, as cuda_check.sh puts it): a floor of 2.0 is met, one of
    # 3.0 is not (planned in a process whose PYTHONPATH has the target, as above)
    code = ("import json, sys; sys.argv = ['x']; import offline_deps as od; "
            f"req = {{'mesa_fake_dep': ('mesa_fake_dep', '2.0', {{'mesa_fake_sub': 'mesa_fake_sub'}})}}; "
            "print(json.dumps([od.plan(req, {}), od.plan(req, {'mesa_fake_dep': '3.0'})]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=f"{target}{os.pathsep}{ROOT / 'scripts'}"))
    assert out.returncode == 0, out.stderr
    (met, _), (todo, report) = json.loads(out.stdout.splitlines()[-1])
    assert met == [] and todo == ["mesa_fake_dep"] and "2.1.0 is older than 3.0" in report[0]

def test_offline_deps_names_a_wheel_the_folder_lacks(tmp_path, monkeypatch):
    od = _offline_deps()
    monkeypatch.setattr(od, "REQUIRED", {"mesa_absent_mod": ("mesa-absent", None, {})})
    rc = od.main(["--wheels", str(tmp_path), "--target", str(tmp_path / "t")])
    assert rc == 1
    assert od.timm_floor(str(ROOT / "pyproject.toml")) is not None


def test_cuda_check_installs_nothing_from_a_network():
    text = (ROOT / "scripts" / "cuda_check.sh").read_text()
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    for bad in ("pip install", "pip download", "-m venv", "setup_env.sh", "curl ", "wget "):
        assert bad not in code, bad
    # the test files it names hold no segmentation module
    assert "test_seg" not in code and "pytest -q -m cuda -rs -p no:cacheprovider tests\n" not in code


def test_cuda_check_rehearsal_cheap_stages(tmp_path):
    """The suite's part of `cuda_check.sh --rehearse`: env, deps (nothing missing here), the CUDA
    test files collected (CUDA-marked tests found), the benchmark's dry run (the four models in
    the four modes built and stepped once on the CPU at batch 1, the files written)."""
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "cuda_check.sh"), "--rehearse",
                           "--only", "collect,roofline,bench"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [s["stage"] for s in summary] == ["env", "deps", "collect", "roofline", "bench"]
    assert all(s["rc"] == 0 for s in summary)
    collect = (tmp_path / "collect.txt").read_text()
    assert "tests/test_cuda_kernels.py:" in collect and "CUDA-marked" in collect
    rows = json.loads((tmp_path / "bench_gpu.json").read_text())
    assert {(r["model"], r["mode"]) for r in rows} == {
        (m, md) for m in ("deit_tiny_patch16_224", "deit_small_patch16_224", "swin_tiny_patch4_window7_224",
                          "pvt_tiny") for md in ("exact", "exact-explicit", "mesa8", "mesa8-explicit")}
    assert all(r["dry_run"] and r["batch"] == 128 and r["precision"] == "fp16" for r in rows)
    md = (tmp_path / "bench.md").read_text()
    assert "adamw" in md and "paper exact MB" in md and "dry run" in md
    roof = (tmp_path / "roofline.txt").read_text()
    assert "| quantize | 151,296 |" in roof and "| copy |" in roof and "cpu" in roof.splitlines()[0]


def test_bench_optimizer_and_dry_run():
    from benchmarks import models as B

    cfg = B.Config("deit_tiny_patch16_224", "mesa8", 4, input_size=32, optimizer="adamw", device="cuda")
    rec = B.dry_run(cfg)
    assert rec.dry_run and rec.device == "cuda" and rec.batch == 4
    import torch

    opt = B.make_optimizer(torch.nn.Linear(2, 2), cfg)
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["lr"] == pytest.approx(5e-4 * 4 / 512)
    with pytest.raises(ValueError, match="expected one of sgd, adamw"):
        B.make_optimizer(torch.nn.Linear(2, 2), B.Config("m", "exact", 1, optimizer="lamb"))


_BLOCK_SEG = ("import sys; sys.modules.update(mmseg=None, mmengine=None, mmcv=None); ")


def test_everything_but_segmentation_imports_without_the_seg_stack():
    """mmseg / mmengine / mmcv blocked (an import of them raises ImportError): every module of
    the packages imports, but models.seg and the segmentation tools."""
    mods = []
    for pkg in ("mesa_ops", "models", "training", "data", "benchmarks"):
        for f in sorted((ROOT / pkg).rglob("*.py")):
            name = ".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            if name.startswith("models.seg") or name in ("benchmarks.seg",):
                continue
            if name == "mesa_ops.hf_layers" and importlib.util.find_spec("transformers") is None:
                continue  # (imported only for a model holding transformers' Conv1D)
            mods.append(name)
    code = _BLOCK_SEG + "import importlib\nfor m in %r:\n    importlib.import_module(m)\nprint(len(%r))" % (
        mods, mods)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout.split()[-1]) == len(mods) > 40


def test_segmentation_tests_skip_without_the_seg_stack():
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_seg_*.py"))
    assert len(files) == 4
    code = _BLOCK_SEG + f"import pytest; sys.exit(pytest.main(['-q', '-rs', '-p', 'no:cacheprovider', *{files!r}]))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode in (0, 5), out.stdout[-3000:]  # 5: every module skipped, nothing ran
    assert "4 skipped" in out.stdout and "error" not in out.stdout.lower() and "is not installed (the optional segmentation stack)" in out.stdout


def test_tested_pins_lie_in_the_declared_range():
    """requirements.txt (the exact tested set) satisfies pyproject.toml's supported range, and the
    floor scripts/compat.sh builds is that range's lower end."""
    import re

    from packaging.requirements import Requirement
    try:
        import tomllib
    except ImportError:  # Python 3.10 (the floor): pytest's own dependency
        import tomli as tomllib

    deps = {Requirement(d).name: Requirement(d) for d in
            tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==([^\s#]+)", (ROOT / "requirements.txt").read_text(), re.M))
    for name in ("torch", "torchvision", "timm", "numpy", "scikit-learn"):
        assert deps[name].specifier.contains(pins[name]), (name, pins[name], str(deps[name].specifier))
    script = (ROOT / "scripts" / "compat.sh").read_text()
    assert "TORCH=2.8.0" in script and deps["torch"].specifier.contains("2.8.0")
    assert not deps["torch"].specifier.contains("2.7.1") and deps["torch"].specifier.contains("2.15.0")
    assert str(deps["timm"].specifier) == ">=1.0.3"
