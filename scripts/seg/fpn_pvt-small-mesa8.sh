#!/usr/bin/env bash
# Paper row: fpn_pvt-small-mesa8 on ADE20K (configs/seg/fpn_pvt-small-mesa8_8xb4-40k_ade20k-512x512.py).
# Trains on GPUS (8) GPUs with scripts/dist_seg_train.sh (NNODES NODE_RANK MASTER_ADDR PORT as there),
# then tests the last checkpoint (mIoU, single scale). Needs data/ade/ADEChallengeData2016 (data/ade20k.py)
# and the ImageNet checkpoint named in the config under pretrained/. Extra arguments go to seg_train.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
GPUS=${GPUS:-8}
WORK_DIR=${WORK_DIR:-work_dirs/fpn_pvt-small-mesa8}
bash scripts/dist_seg_train.sh configs/seg/fpn_pvt-small-mesa8_8xb4-40k_ade20k-512x512.py "$GPUS" --work-dir "$WORK_DIR" "$@"
bash scripts/dist_seg_test.sh configs/seg/fpn_pvt-small-mesa8_8xb4-40k_ade20k-512x512.py "$WORK_DIR/iter_40000.pth" "$GPUS" --work-dir "$WORK_DIR"
