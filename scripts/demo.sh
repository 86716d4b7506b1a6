#!/usr/bin/env bash
# Creates .venv/ if missing, installs, then runs the demo: a DeiT-style model trained a few steps
# exact and with Mesa, printing saved-activation memory and step time for each.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec .venv/bin/python tools/demo.py "$@"
