#!/usr/bin/env bash
# CPU version of the paper's memory/speed comparison at a small batch (2 cores: ~10 minutes).
# Writes bench_cpu.json / bench_cpu.png under outputs/ (ignored by git).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT" && mkdir -p outputs
.venv/bin/python tools/benchmark_ops.py --steps 10 --json outputs/bench_ops_cpu.json
# DeiT-S at 384 px (577 tokens: the N x N matrix the explicit paths keep grows with N^2)
.venv/bin/python tools/benchmark.py --device cpu --model deit_small_patch16_224 --input-size 384 \
  --modes exact,exact-explicit,mesa8,mesa8-explicit,mesa4,ckpt,mesa8+cckpt --batch-size "${BATCH:-4}" \
  --precision fp32 --steps "${STEPS:-3}" --warmup 1 --json outputs/bench_cpu_384.json
exec .venv/bin/python tools/benchmark.py --device cpu \
  --model deit_tiny_patch16_224 deit_small_patch16_224 swin_tiny_patch4_window7_224 pvt_tiny \
  --modes exact,exact-explicit,mesa8,mesa8-explicit,mesa4,ckpt,mesa8+cckpt --batch-size "${BATCH:-4}" --input-size 224 \
  --precision fp32 --steps "${STEPS:-3}" --warmup 1 \
  --json outputs/bench_cpu.json --csv outputs/bench_cpu.csv --plot outputs/bench_cpu.png "$@"
