#!/usr/bin/env bash
# Distributed segmentation training with torchrun (mmsegmentation's dist_train.sh, same knobs):
#   bash scripts/dist_seg_train.sh CONFIG GPUS [tools/seg_train.py options ...]
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 PORT=29500 bash scripts/dist_seg_train.sh CONFIG 8   (node 0)
# Environment: NNODES (1), NODE_RANK (0), MASTER_ADDR (127.0.0.1), PORT (29500), PYTHON (.venv/bin/python
# when it exists, else python). Without CUDA the processes train on CPUs (gloo; SyncBN becomes BN).
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: $0 CONFIG GPUS [tools/seg_train.py options ...]" >&2
    exit 2
fi
CONFIG=$1
GPUS=$2
shift 2
cd "$(dirname "$0")/.."
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
PORT=${PORT:-29500}
MASTER_ADDR=${MASTER_ADDR:-"127.0.0.1"}
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python; fi
fi
exec "$PYTHON" -m torch.distributed.run \
    --nnodes="$NNODES" --node_rank="$NODE_RANK" --master_addr="$MASTER_ADDR" \
    --nproc_per_node="$GPUS" --master_port="$PORT" \
    tools/seg_train.py "$CONFIG" --launcher pytorch "$@"
