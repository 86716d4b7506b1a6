#!/usr/bin/env bash
# Distributed training with torchrun (DDP, NCCL on GPUs). Extra arguments go to tools/train.py.
#
# One node, 8 GPUs:
#   GPUS=8 bash scripts/dist_train.sh --model deit_tiny_patch16_224 --data-path /data/imagenet \
#       --batch-size 128 --output-dir outputs/deit_ti_mesa --ms-policy configs/mesa/mesa_8bit.txt
# Two nodes (run on each, NODE_RANK 0 and 1):
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 MASTER_PORT=29500 GPUS=8 bash scripts/dist_train.sh ...
# CPU processes instead of GPUs (gloo): GPUS=2 bash scripts/dist_train.sh --device cpu ...
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
GPUS="${GPUS:-8}"
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
command -v "$PY" >/dev/null 2>&1 || PY=python
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$PY" -m torch.distributed.run --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$GPUS" \
  --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" "$ROOT/tools/train.py" "$@"
