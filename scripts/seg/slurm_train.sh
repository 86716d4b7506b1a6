#!/usr/bin/env bash
# Segmentation training on a Slurm cluster (mmsegmentation's slurm_train.sh; --launcher slurm: each
# task reads its rank from SLURM_PROCID, the master from the node list):
#   bash scripts/seg/slurm_train.sh PARTITION JOB_NAME CONFIG [tools/seg_train.py options ...]
# Environment: GPUS (8), GPUS_PER_NODE (8), CPUS_PER_TASK (5), SRUN_ARGS (""), PORT (29500),
# PYTHON (.venv/bin/python when it exists, else python).
set -euo pipefail
if [ $# -lt 3 ]; then
    echo "usage: $0 PARTITION JOB_NAME CONFIG [tools/seg_train.py options ...]" >&2
    exit 2
fi
PARTITION=$1
JOB_NAME=$2
CONFIG=$3
shift 3
cd "$(dirname "$0")/../.."
GPUS=${GPUS:-8}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
CPUS_PER_TASK=${CPUS_PER_TASK:-5}
SRUN_ARGS=${SRUN_ARGS:-""}
export MASTER_PORT=${PORT:-29500}
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python; fi
fi
# shellcheck disable=SC2086
srun -p "$PARTITION" --job-name="$JOB_NAME" --gres=gpu:"$GPUS_PER_NODE" --ntasks="$GPUS" \
    --ntasks-per-node="$GPUS_PER_NODE" --cpus-per-task="$CPUS_PER_TASK" --kill-on-bad-exit=1 $SRUN_ARGS \
    "$PYTHON" -u tools/seg_train.py "$CONFIG" --launcher slurm "$@"
