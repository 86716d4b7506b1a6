#!/usr/bin/env bash
# The paper's setting on one GPU: batch 128, 224x224, AMP (fp16 autocast), DeiT-Ti/S, Swin-T,
# PVT-Ti, every mode; sized to finish in under 8 minutes on one recent GPU.
# Writes outputs/bench_gpu.{json,csv,png}.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT" && mkdir -p outputs
exec .venv/bin/python tools/benchmark.py --device cuda \
  --model deit_tiny_patch16_224 deit_small_patch16_224 swin_tiny_patch4_window7_224 pvt_tiny \
  --modes exact,exact-explicit,mesa8,mesa8-explicit,mesa4,ckpt,mesa8+cckpt --batch-size "${BATCH:-128}" --input-size 224 \
  --precision fp16 --steps "${STEPS:-10}" --warmup 3 \
  --json outputs/bench_gpu.json --csv outputs/bench_gpu.csv --plot outputs/bench_gpu.png "$@"
