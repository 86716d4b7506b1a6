#!/usr/bin/env bash
# The README's main job. Creates .venv/ if missing and installs (scripts/setup_env.sh), then trains a
# small DeiT (2 blocks, width 64, 2 heads, 32 px, patch 8) on DIGITS -- the 8x8 handwritten digits that
# scikit-learn ships, upscaled; 1497 training / 300 validation images -- with tools/train.py on the
# CPU, exact and with Mesa 8-bit (configs/mesa/mesa_8bit.txt), from the same seeds (SEEDS, default
# "0 1 2": one pair of runs per seed, as 300 validation images make one run's top-1 move by +-2
# points from seed to seed), and prints top-1 accuracy, saved-activation memory and step time of
# every run, and the mean top-1 of each mode.
#
# Env: EPOCHS (default 30), SEEDS ("0 1 2"), OUT (outputs/demo), OMP_NUM_THREADS (1: this model is too small to gain
# from more threads, and a busy machine makes spinning OpenMP threads much slower).
# Extra arguments go to both tools/train.py runs.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
OUT="${OUT:-outputs/demo}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
ARGS=(--model deit_tiny_patch16_224 --model-kwargs patch_size=8 depth=2 embed_dim=64 num_heads=2
      --data-set DIGITS --input-size 32 --batch-size 32 --epochs "${EPOCHS:-30}"
      --unscale-lr --lr 3e-3 --warmup-epochs 3 --clip-grad 1.0 --sched-on-updates --min-lr 1e-5
      --aa none --color-jitter 0 --reprob 0 --mixup 0 --cutmix 0 --drop-path 0 --no-model-ema
      --num-workers 0 --device cpu)
# a tqdm bar per epoch on a terminal; one line per epoch written to a file or pipe
if [ -t 1 ]; then ARGS+=(--tqdm); else ARGS+=(--epoch-lines); fi
rm -rf "$OUT/exact" "$OUT/mesa8"
start=$SECONDS
RUNS=()
for seed in ${SEEDS:-0 1 2}; do
  echo "== exact, seed $seed"
  .venv/bin/python tools/train.py "${ARGS[@]}" --seed "$seed" --output-dir "$OUT/exact/s$seed" "$@"
  echo "== mesa8 (--ms-policy configs/mesa/mesa_8bit.txt), seed $seed"
  .venv/bin/python tools/train.py "${ARGS[@]}" --seed "$seed" --ms-policy configs/mesa/mesa_8bit.txt \
    --output-dir "$OUT/mesa8/s$seed" "$@"
  RUNS+=("exact/s$seed=$OUT/exact/s$seed" "mesa8/s$seed=$OUT/mesa8/s$seed")
done
echo
echo "DeiT (2 blocks, width 64) on DIGITS, batch 32, $(( SECONDS - start )) s for all runs on $(getconf _NPROCESSORS_ONLN) CPU cores, OMP_NUM_THREADS=$OMP_NUM_THREADS:"
.venv/bin/python -m training.report "${RUNS[@]}"
echo "tensorboard --logdir $OUT   # loss, lr, accuracy, memory, throughput curves"
