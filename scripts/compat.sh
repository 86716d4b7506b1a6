#!/usr/bin/env bash
# A second environment at another PyTorch, without the segmentation stack (mmseg / mmengine / mmcv),
# and the compat subset of the tests run in it. Default: the supported floor (torch 2.8.0 with the
# torchvision pip picks for it, timm at the floor in pyproject.toml, Python 3.10), which
# scripts/test.sh (so CI) runs after the main suite.
#
# Usage: bash scripts/compat.sh [--torch VER] [--python VER] [--timm VER] [--setup-only] [pytest args...]
#   e.g. bash scripts/compat.sh --torch 2.11.0 --python 3.12      (the GPU machines' stack)
#        PIP_CONFIG_FILE=/dev/null bash scripts/compat.sh --torch 2.15.0 --python 3.11
#          (past a pip cap in /etc/xdg/pip: PIP_CONSTRAINT= does not lift it with pip 26)
# The environment is .venv-compat/torch<VER>-py<VER>/ (git-ignored), built once (several minutes: a
# CUDA build of torch is ~3 GB from PyPI) and reused while its inputs are unchanged.
# The subset: tests marked `compat` (pytest -m compat): the C++ and nvcc builds, quantizer, layers,
# attention (fake CUDA and the CUDA emulation included), models, torch.compile, timm's contract, a
# training smoke run. Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
TORCH=2.8.0
PYVER=3.10
TIMM="$(sed -n 's/^ *"timm>=\([0-9.]*\)[",].*/\1/p' pyproject.toml | head -1)"
SETUP_ONLY=0
PY_GIVEN=0
PYTEST_ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --torch) TORCH="$2"; shift 2 ;;
    --python) PYVER="$2"; PY_GIVEN=1; shift 2 ;;
    --timm) TIMM="$2"; shift 2 ;;
    --setup-only) SETUP_ONLY=1; shift ;;
    *) PYTEST_ARGS+=("$1"); shift ;;
  esac
done
[ -n "$TIMM" ] || { echo "compat.sh: no timm floor found in pyproject.toml" >&2; exit 2; }
PY="${PYTHON:-python$PYVER}"
if ! "$PY" --version >/dev/null 2>&1; then  # a pyenv shim of a version not selected: its own binary
  PY="$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$PYVER"*/bin/python"$PYVER" 2>/dev/null | tail -1)"
fi
if [ -z "$PY" ] || ! "$PY" --version >/dev/null 2>&1; then
  [ "$PY_GIVEN" = 1 ] && { echo "compat.sh: no python$PYVER found (set PYTHON=/path/to/python)" >&2; exit 2; }
  PY=python3  # the default floor's Python is not here: the machine's, said in the line below
  PYVER="$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
  echo "[compat] python3.10 not found: the floor environment uses Python $PYVER"
fi
VENV="$ROOT/.venv-compat/torch$TORCH-py$PYVER"
STAMP="$VENV/.inputs.sha256"
WANT="$( (echo "$TORCH $PYVER $TIMM"; cat requirements-compat.txt pyproject.toml) | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "[compat] building $VENV: torch $TORCH, timm $TIMM, $($PY --version), no segmentation stack"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade "pip<27"
  # the repo with its declared dependencies (pyproject.toml), resolved at this torch and timm: a
  # floor outside the declared range fails here
  "$VENV/bin/python" -m pip install -q -c requirements-compat.txt -e ".[test]" \
    "torch==$TORCH" "timm==$TIMM"
  echo "$WANT" > "$STAMP"
fi
"$VENV/bin/python" - <<'EOF'
import importlib.util, sys, torch, torchvision, timm
missing = [m for m in ("mmseg", "mmengine", "mmcv") if importlib.util.find_spec(m)]
print(f"[compat] Python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"torchvision {torchvision.__version__}, timm {timm.__version__}")
if missing:
    raise SystemExit(f"[compat] this environment must not have the segmentation stack: {missing}")
EOF
[ "$SETUP_ONLY" = 1 ] && exit 0
exec "$VENV/bin/python" -m pytest -p no:cacheprovider -m "compat and not slow" "${PYTEST_ARGS[@]}"
