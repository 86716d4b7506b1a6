"""What scripts/cuda_check.sh needs beyond torch, taken from a wheel folder where the interpreter
lacks it: no network, no pip needed (a wheel is a zip archive; its files are unpacked into a
folder that the caller puts on PYTHONPATH).

    python scripts/offline_deps.py --wheels .whl --target DIR   # prints what it did, one line each

For each requirement (import name, distribution, minimum version): present at that version or
newer -> nothing; missing or older -> the distribution's wheel and those of its dependencies
that are missing too are unpacked into ``--target``. Exit status 1 (with the reason) when a
needed wheel is not in the folder (fill it with ``bash scripts/fetch_wheels.sh``). Standard
library only: it runs before anything else is known to import.
"""
from __future__ import annotations

import argparse
import glob
import importlib
import importlib.metadata
import os
import re
import sys
import zipfile

# import name -> (distribution, minimum version or None, dependencies: import name -> distribution)
REQUIRED = {
    "pytest": ("pytest", "8.0", {"pluggy": "pluggy", "iniconfig": "iniconfig", "packaging": "packaging",
                                 "pygments": "pygments"}),
    # timm imports huggingface_hub, safetensors and yaml only where it uses them (hub downloads,
    # .safetensors files, webdataset readers): torch, torchvision and numpy come with the machine
    "timm": ("timm", None, {}),
    "tqdm": ("tqdm", None, {}),
}


def timm_floor(pyproject: str) -> str | None:
    """The timm floor declared in pyproject.toml (``"timm>=X"``)."""
    try:
        with open(pyproject, encoding="utf-8") as f:
            m = re.search(r'"timm>=([0-9.]+)', f.read())
    except OSError:
        return None
    return m.group(1) if m else None


def _version_tuple(v: str) -> tuple:
    return tuple(int(p) for p in re.findall(r"\d+", v.split("+")[0])[:3])


def installed_version(module: str, dist: str) -> str | None:
    """The version of ``dist`` when ``module`` imports, else None."""
    try:
        importlib.import_module(module)
    except ImportError:
        return None
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return getattr(sys.modules[module], "__version__", "0")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def find_wheel(folder: str, dist: str) -> str | None:
    """The newest wheel of ``dist`` in ``folder`` (by version), or None."""
    hits = [p for p in glob.glob(os.path.join(folder, "*.whl"))
            if _norm(os.path.basename(p).split("-")[0]) == _norm(dist)]
    return max(hits, key=lambda p: _version_tuple(os.path.basename(p).split("-")[1]), default=None)


def unpack(wheel: str, target: str) -> None:
    """Install ``wheel`` into ``target`` as pip --target would for a pure or platlib wheel: its
    packages and .dist-info at the top, the ``.data/purelib|platlib`` contents merged in."""
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            name = info.filename
            parts = name.split("/")
            if parts[0].endswith(".data"):
                if len(parts) > 2 and parts[1] in ("purelib", "platlib"):
                    name = "/".join(parts[2:])
                else:
                    continue  # scripts, headers, data: not needed to import
            dest = os.path.join(target, name)
            if name.endswith("/"):
                os.makedirs(dest, exist_ok=True)
                continue
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with z.open(info) as src, open(dest, "wb") as out:
                out.write(src.read())


def plan(required: dict, floors: dict) -> tuple[list[str], list[str]]:
    """(distributions to unpack, report lines) for what this interpreter lacks."""
    todo, report = [], []
    for module, (dist, minimum, deps) in required.items():
        minimum = floors.get(dist, minimum)
        have = installed_version(module, dist)
        if have is not None and (minimum is None or _version_tuple(have) >= _version_tuple(minimum)):
            report.append(f"{dist} {have}: present")
            continue
        why = "missing" if have is None else f"{have} is older than {minimum}"
        report.append(f"{dist}: {why}, from the wheel folder")
        todo.append(dist)
        todo += [d for m, d in deps.items() if installed_version(m, d) is None]
    return list(dict.fromkeys(todo)), report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wheels", default=".whl", help="the wheel folder (scripts/fetch_wheels.sh fills it)")
    ap.add_argument("--target", required=True, help="folder to unpack into (put it on PYTHONPATH)")
    ap.add_argument("--pyproject", default="pyproject.toml")
    args = ap.parse_args(argv)
    floors = {"timm": timm_floor(args.pyproject)} if timm_floor(args.pyproject) else {}
    todo, report = plan(REQUIRED, floors)
    for line in report:
        print(f"[deps] {line}")
    missing = [d for d in todo if find_wheel(args.wheels, d) is None]
    if missing:
        print(f"[deps] not in the wheel folder {args.wheels!r}: {', '.join(missing)} "
              "(run `bash scripts/fetch_wheels.sh` on a machine with PyPI, carry .whl/ along)",
              file=sys.stderr)
        return 1
    os.makedirs(args.target, exist_ok=True)
    for dist in todo:
        wheel = find_wheel(args.wheels, dist)
        unpack(wheel, args.target)
        print(f"[deps] unpacked {os.path.basename(wheel)} into {args.target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
