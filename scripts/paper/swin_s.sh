#!/usr/bin/env bash
# Reproduces: Swin-S, exact (paper: 83.0% top-1)
# (Mesa, Pan et al. arXiv 2111.11124, ImageNet-1K classification, 224 px, AMP fp16, 8 GPUs x 128 images).
# Env overrides: DATA (ImageNet root with train/ val/), OUT, GPUS (8), BATCH (per GPU, 128), EPOCHS (300),
# LAUNCH=dist|slurm (scripts/dist_train.sh or scripts/slurm_train.sh; their env vars apply too).
# Extra arguments are passed to tools/train.py (e.g. --resume outputs/.../checkpoint.pth).
# The learning rate is --lr x global batch / 512, as DeiT does.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
export GPUS="${GPUS:-8}"
exec bash "scripts/${LAUNCH:-dist}_train.sh" \
  --model swin_small_patch4_window7_224 --data-set IMNET --data-path "${DATA:-data/imagenet}" \
  --batch-size "${BATCH:-128}" --epochs "${EPOCHS:-300}" \
  --opt adamw --lr 5e-4 --weight-decay 0.05 --sched cosine --sched-on-updates --warmup-epochs 20 --min-lr 5e-6 --warmup-lr 5e-7 \
  --clip-grad 5.0 --smoothing 0.1 --mixup 0.8 --cutmix 1.0 --mixup-switch-prob 0.5 \
  --aa rand-m9-mstd0.5-inc1 --reprob 0.25 --color-jitter 0.4 --no-repeated-aug --no-model-ema --amp fp16 \
  --drop-path 0.3 \
  --output-dir "${OUT:-outputs/paper/swin_s}" "$@"
