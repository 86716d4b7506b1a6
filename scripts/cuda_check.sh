#!/usr/bin/env bash
# The prepared device check (a few minutes on one GPU): build the CUDA kernels, run the
# CUDA-marked tests (kernels equal the CPU/reference bit for bit, layers, autocast), then the op
# benchmark and a short model benchmark. Output under $OUT (device tool) or outputs/.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUTDIR="${OUT:-$ROOT/outputs}"; mkdir -p "$OUTDIR"
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] && PY=.venv/bin/python
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
"$PY" -c "import torch; print(torch.__version__, torch.cuda.get_device_name())" 2>&1 | tee "$OUTDIR/env.txt"
"$PY" -m pytest -q -m cuda tests 2>&1 | tee "$OUTDIR/cuda_tests.txt"
"$PY" tools/benchmark_ops.py --device cuda --batch 64 --steps 20 2>&1 | tee "$OUTDIR/bench_ops_cuda.txt"
"$PY" tools/benchmark_ops.py --device cuda --batch 64 --steps 20 --precision fp16 --only Block 2>&1 | tee -a "$OUTDIR/bench_ops_cuda.txt"
"$PY" tools/benchmark.py --device cuda --model deit_tiny_patch16_224 deit_small_patch16_224 \
  --modes exact,mesa8,ckpt --batch-size 128 --precision fp16 --steps 5 --warmup 2 \
  --json "$OUTDIR/bench_gpu.json" 2>&1 | tee "$OUTDIR/bench_gpu.txt"
# Mesa attention (ms.SDPA) on the CUDA SDPA kernels: forward == F.scaled_dot_product_attention bit
# for bit, 8-bit gradient bounds (flash fp16/bf16, memory-efficient fp32 with masks, math), a
# DeiT-Ti fp16-autocast step; then exact vs fused / explicit Mesa vs compressed checkpointing
"$PY" -m pytest -q -m cuda tests/test_attention.py -rs 2>&1 | tee "$OUTDIR/cuda_attention_tests.txt"
"$PY" tools/benchmark.py --device cuda --model deit_small_patch16_224 \
  --modes exact,mesa8,mesa8-explicit,mesa8+cckpt --batch-size 128 --precision fp16 --steps 5 --warmup 2 \
  --json "$OUTDIR/bench_gpu_attention.json" 2>&1 | tee "$OUTDIR/bench_gpu_attention.txt"
