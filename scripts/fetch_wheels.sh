#!/usr/bin/env bash
# Fills .whl/ (git-ignored) with the wheels scripts/cuda_check.sh may need on a GPU machine that
# cannot reach a registry: what the project needs beyond torch / torchvision / numpy (timm, tqdm,
# pytest and its dependencies), for CPython $PY_TAG (default 3.12, the GPU machines'), manylinux
# x86_64: ~4 MiB, carried by the device tool when asked (carry: [".whl"]). scripts/offline_deps.py
# unpacks from it only what the machine lacks. Versions: the tested set (requirements.txt, and
# ../shared/requirements.tested.txt for pytest's dependencies).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYV="${PY_TAG:-3.12}"
pin() { sed -n "s/^$1==\([^ ]*\).*/\1/p" requirements.txt | head -1; }
WHEELS=("timm==$(pin timm)" "pytest==$(pin pytest)" "tqdm==$(pin tqdm)"
        pluggy==1.7.0 iniconfig==2.3.1 packaging==26.4 pygments==2.21.0)
rm -rf .whl && mkdir -p .whl
# --no-deps: the list above is the closure that matters (torch and torchvision come with the
# machine); pip's own cap (a constraints file) does not apply to a download for another platform
PIP_CONSTRAINT= python3 -m pip download -q --no-deps --only-binary=:all: -d .whl \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  --python-version "$PYV" --implementation cp "${WHEELS[@]}"
du -sh .whl
ls .whl
