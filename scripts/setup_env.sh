#!/usr/bin/env bash
# Creates .venv/ at the repo root if missing and installs requirements.txt into it.
# Sourced by scripts/demo.sh and scripts/test.sh; safe to run on its own.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x "$ROOT/.venv/bin/python" ]; then
  echo "[setup] creating $ROOT/.venv with $($PY --version)"
  "$PY" -m venv "$ROOT/.venv"
fi
STAMP="$ROOT/.venv/.requirements.sha256"
WANT="$(cat "$ROOT/requirements.txt" "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "[setup] installing requirements.txt (first run: several minutes)"
  "$ROOT/.venv/bin/python" -m pip install -q --upgrade "pip<27"
  "$ROOT/.venv/bin/python" -m pip install -q -r "$ROOT/requirements.txt"
  "$ROOT/.venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$ROOT"
  echo "$WANT" > "$STAMP"
fi
