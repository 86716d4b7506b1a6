#!/usr/bin/env bash
# Accuracy benchmark that resolves fractions of a point: the demo DeiT of scripts/demo.sh on all
# 1797 DIGITS images with k-fold cross-validation (every image validated once per seed) x several
# seeds; exact / mesa8 / mesa4 / mesa2 trained from the same initial weights and batch order per
# fold and seed. Prints the mean top-1 of each mode and its paired difference to exact +- the
# standard error, and plots accuracy against saved bytes (OUT/accuracy.png, if matplotlib is
# installed). See tools/accuracy.py and training/crossval.py.
#
# Env: FOLDS (5), SEEDS ("0 1"), EPOCHS (30), MODES ("exact mesa8 mesa4 mesa2"), OUT
# (outputs/accuracy), JOBS (1: runs trained at once, in processes of one thread each),
# OMP_NUM_THREADS (1, as the demo). Extra arguments go to tools/accuracy.py (e.g. --resume to
# reuse the runs already in OUT, --seeds-for mesa4=0-2 to run a mode on fewer seeds).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# shellcheck disable=SC2086
.venv/bin/python tools/accuracy.py --folds "${FOLDS:-5}" --seeds ${SEEDS:-0 1} --epochs "${EPOCHS:-30}" \
  --modes ${MODES:-exact mesa8 mesa4 mesa2} --out "${OUT:-outputs/accuracy}" --jobs "${JOBS:-1}" "$@"
