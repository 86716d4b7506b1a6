#!/usr/bin/env bash
# Creates .venv/ if missing, installs requirements.txt and this repo, runs the whole pytest suite.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k quant -x`).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec .venv/bin/python -m pytest "$@"
