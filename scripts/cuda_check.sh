#!/usr/bin/env bash
# The GPU check, for the first machine with a CUDA GPU (offline: no pip; it uses the prepared
# .venv when there is one, else python3 with torch installed). Stages, each timed:
#   env -> build (the CUDA kernels, for this GPU's arch) -> self-check (every dtype x bits, kernel
#   vs the torch reference on the device) -> CUDA-marked tests (kernels == CPU kernels bit for bit,
#   SDPA == F.sdpa, train steps without a host sync) -> benchmark (DeiT-Ti/S, Swin-T, PVT-Ti at
#   batch 64 and 128, AMP fp16 and bf16, exact vs mesa8: max_memory_allocated and img/s beside the
#   paper's memory column). Output: $OUT (the device tool) or outputs/cuda_check/: one .txt per
#   stage, stages.txt (rc and seconds), bench_gpu.json and the tables in bench.txt.
# Usage: bash scripts/cuda_check.sh [--quick]   (--quick: batch 64 fp16 only)
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUTDIR="${OUT:-$ROOT/outputs/cuda_check}"
mkdir -p "$OUTDIR"
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] && PY=.venv/bin/python
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$OUTDIR/../torch_extensions}"
if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
  TORCH_CUDA_ARCH_LIST="$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())' 2>/dev/null)"
  export TORCH_CUDA_ARCH_LIST
fi
BATCHES="64 128"; PRECISIONS="fp16 bf16"
[ "${1:-}" = "--quick" ] && { BATCHES="64"; PRECISIONS="fp16"; }
: > "$OUTDIR/stages.txt"
FAILED=0
stage() {  # stage NAME CMD...: runs CMD, output to NAME.txt and the terminal, rc and time to stages.txt
  local name="$1"; shift
  local t0; t0=$(date +%s.%N)
  "$@" > >(tee "$OUTDIR/$name.txt") 2>&1
  local rc=$?
  local dt; dt=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { print b - a }')
  printf '%-10s rc=%d %6.1f s\n' "$name" "$rc" "$dt" | tee -a "$OUTDIR/stages.txt"
  [ "$rc" -eq 0 ] || FAILED=1
  return "$rc"
}
stage env "$PY" -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, 'CUDA', torch.version.cuda, 'cuDNN', torch.backends.cudnn.version()); print(torch.cuda.get_device_name(), 'capability', torch.cuda.get_device_capability(), 'arch list', '$TORCH_CUDA_ARCH_LIST')" || exit 1
stage build "$PY" -c "from mesa_ops import backend; m = backend.build_extension('cuda'); print('built', m.__name__)" || exit 1
stage selfcheck "$PY" -c "
import torch
from mesa_ops import backend
be = backend.get_backend(torch.zeros(1, device='cuda'))
bad = 0
for dt in (torch.float32, torch.float16, torch.bfloat16):
    for bits in (8, 4, 2, 1):
        p = backend.self_check(be, torch.device('cuda'), dt, bits)
        print(f'{str(dt):16s} {bits} bits: {p or \"identical to the reference\"}')
        bad += p is not None
raise SystemExit(bad)"
stage tests "$PY" -m pytest -q -m cuda -rs -p no:cacheprovider tests
stage bench "$PY" tools/benchmark.py --device cuda --in-process --paper \
  --model deit_tiny_patch16_224 deit_small_patch16_224 swin_tiny_patch4_window7_224 pvt_tiny \
  --modes exact,mesa8 --batch-size $BATCHES --precision $PRECISIONS --steps 5 --warmup 2 \
  --json "$OUTDIR/bench_gpu.json"
cat "$OUTDIR/stages.txt"
exit "$FAILED"
