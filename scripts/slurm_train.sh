#!/usr/bin/env bash
# Training on a Slurm cluster with srun: one task per GPU; tools/train.py reads SLURM_PROCID /
# SLURM_NTASKS / SLURM_LOCALID and takes the first node of the job as MASTER_ADDR.
#
#   PARTITION=gpu GPUS=16 GPUS_PER_NODE=8 bash scripts/slurm_train.sh --model swin_tiny_patch4_window7_224 \
#       --data-path /data/imagenet --batch-size 128 --output-dir outputs/swin_t
# Env: PARTITION (required), JOB_NAME, GPUS (total, default 8), GPUS_PER_NODE (8), CPUS_PER_TASK (10),
# MASTER_PORT (29500), SRUN_ARGS (extra srun options, e.g. "--time=72:00:00 --account=x").
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
: "${PARTITION:?set PARTITION to the Slurm partition}"
JOB_NAME="${JOB_NAME:-mesa}"
GPUS="${GPUS:-8}"
GPUS_PER_NODE="${GPUS_PER_NODE:-$(( GPUS < 8 ? GPUS : 8 ))}"
CPUS_PER_TASK="${CPUS_PER_TASK:-10}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
export MASTER_PORT="${MASTER_PORT:-29500}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# shellcheck disable=SC2086
exec srun -p "$PARTITION" --job-name="$JOB_NAME" --gres="gpu:$GPUS_PER_NODE" --ntasks="$GPUS" \
  --ntasks-per-node="$GPUS_PER_NODE" --cpus-per-task="$CPUS_PER_TASK" --kill-on-bad-exit=1 ${SRUN_ARGS:-} \
  "$PY" -u "$ROOT/tools/train.py" "$@"
