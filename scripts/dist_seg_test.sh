#!/usr/bin/env bash
# Distributed segmentation testing (mIoU) with torchrun (mmsegmentation's dist_test.sh, same knobs):
#   bash scripts/dist_seg_test.sh CONFIG CHECKPOINT GPUS [tools/seg_test.py options ...]
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 PORT=29500 bash scripts/dist_seg_test.sh CONFIG CKPT 8   (node 0)
# Environment: NNODES (1), NODE_RANK (0), MASTER_ADDR (127.0.0.1), PORT (29500), PYTHON (.venv/bin/python
# when it exists, else python). Without CUDA the processes test on CPUs (gloo; SyncBN becomes BN).
set -euo pipefail
if [ $# -lt 3 ]; then
    echo "usage: $0 CONFIG CHECKPOINT GPUS [tools/seg_test.py options ...]" >&2
    exit 2
fi
CONFIG=$1
CHECKPOINT=$2
GPUS=$3
shift 3
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
    tools/seg_test.py "$CONFIG" "$CHECKPOINT" --launcher pytorch "$@"
