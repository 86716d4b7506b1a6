#!/usr/bin/env bash
# The test command (CI runs it): creates .venv/ if missing and installs requirements.txt and this
# repo (the exact tested set), runs the whole pytest suite there, then the compat subset at the
# supported floor (scripts/compat.sh: torch 2.8.0, timm 1.0.3, Python 3.10, no segmentation stack;
# its environment .venv-compat/ is built on first use, ~3 GB from PyPI).
# Extra arguments go to the main suite's pytest only, and then the floor is left out
# (e.g. `bash scripts/test.sh -k quant -x`); MESA_FLOOR=0 leaves it out too.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
rc=0
.venv/bin/python -m pytest "$@" || rc=$?
if [ $# -eq 0 ] && [ "${MESA_FLOOR:-1}" != 0 ]; then
  echo "== the compat subset at the supported floor (scripts/compat.sh)"
  bash scripts/compat.sh -q || rc=$((rc ? rc : $?))
fi
exit "$rc"
