#!/usr/bin/env bash
# Reproduces: CIFAR-100 fine-tuning of DeiT-S w/ Mesa 8-bit from its ImageNet weights, at 224 px
# (DeiT's transfer setting, as in facebookresearch/deit issue #45: SGD, lr 0.01 x global batch / 512,
# weight decay 1e-4, 1000 epochs, 8 GPUs x 96 = 768 images per step; AMP fp16).
# Env overrides: DATA (folder holding cifar-100-python/), WEIGHTS (the ImageNet checkpoint, path or URL;
# default the official deit_small_patch16_224-cd65a155.pth), OUT, GPUS (8), BATCH (per GPU, 96), EPOCHS (1000), LAUNCH=dist|slurm.
# Extra arguments are passed to tools/train.py.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
export GPUS="${GPUS:-8}"
exec bash "scripts/${LAUNCH:-dist}_train.sh" \
  --model deit_small_patch16_224 --data-set CIFAR100 --data-path "${DATA:-data/cifar100}" --input-size 224 \
  --finetune "${WEIGHTS:-https://dl.fbaipublicfiles.com/deit/deit_small_patch16_224-cd65a155.pth}" \
  --batch-size "${BATCH:-96}" --epochs "${EPOCHS:-1000}" \
  --opt sgd --lr 0.01 --weight-decay 1e-4 --momentum 0.9 --sched cosine --warmup-epochs 5 \
  --smoothing 0.1 --mixup 0.8 --cutmix 1.0 --aa rand-m9-mstd0.5-inc1 --reprob 0.25 --drop-path 0.1 \
  --no-repeated-aug --amp fp16 \
  --ms-policy configs/mesa/mesa_8bit.txt \
  --output-dir "${OUT:-outputs/paper/cifar100_deit_s_mesa}" "$@"
