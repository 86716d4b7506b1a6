#!/usr/bin/env bash
# The GPU check, for a bare GPU machine: no venv is created and nothing is installed from a network.
#
#   bash scripts/cuda_check.sh              # on a GPU: 8 min at most (--budget 480; not yet run on one)
#   bash scripts/cuda_check.sh --quick      # on a GPU: fewer modes and steps (4 min at most)
#   bash scripts/cuda_check.sh --rehearse   # no GPU: every stage that needs none (below)
#   bash scripts/cuda_check.sh --only bench # one stage (or a comma-separated list), after env and deps
#
# Interpreter: $PYTHON, else .venv/bin/python where it exists, else python3 (the machine's torch).
# What that interpreter lacks beyond torch (timm at the floor of pyproject.toml, pytest, tqdm) is
# unpacked from the wheel folder .whl/ (filled here by `bash scripts/fetch_wheels.sh`; the device
# tool carries it) into a temporary folder on PYTHONPATH (scripts/offline_deps.py).
#
# Stages on a GPU, each under its own time limit and all within one budget (--budget, default 480 s;
# 240 s with --quick):
#   env       Python, torch, CUDA, the GPU and its arch
#   deps      the offline dependencies above
#   build     the CUDA extension, compiled by nvcc for this GPU's arch (~1 min)
#   selfcheck every dtype x bits: the kernel vs the torch reference on the device, cases with many
#             chunks per group included
#   tests     the CUDA-marked tests of the files named below (no segmentation module is collected)
#   roofline  per kernel (quantize, dequantize, table x grad) on a DeiT-S activation at batch 128,
#             fp16: the bytes it must move, its time, GB/s against the GPU's own copy bandwidth
#             (benchmarks.roofline)
#   bench     the paper's memory column like for like (benchmarks.gpu): batch 128, 224 px, fp16 AMP,
#             AdamW, torch.cuda.max_memory_allocated, 20 warm-up + 30 timed steps (--quick: exact
#             and mesa8, 5 + 10); exact and Mesa with the paper's explicit attention beside fused
#             exact and our mesa8; DeiT-Ti/S, Swin-T, PVT-Ti; the CUDA kernels only
#             (MESA_BACKEND=cuda: a kernel that fails its self-check fails the run)
# --rehearse (no GPU; in an environment like the GPU machines', e.g.
#   PYTHON=.venv-compat/torch2.11.0-py3.12/bin/python from `bash scripts/compat.sh --torch 2.11.0
#   --python 3.12 --setup-only`): env, deps, build (for sm_90 unless TORCH_CUDA_ARCH_LIST is set),
#   collect (the CUDA test files collect), emulation (the CUDA kernels compiled for the host, bit
#   for bit against the CPU kernels), bench as a dry run (every model and mode built and stepped
#   once on the CPU at batch 1, the output files written), roofline on the CPU kernels (small x).
# Output: $OUT (the device tool's) or outputs/cuda_check/ (outputs/cuda_check_rehearse/): one .txt
# per stage, stages.txt, summary.json (each stage's rc and seconds), bench_gpu.json, bench.md,
# roofline.txt.
# Exit status: 0 when every stage passed.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
QUICK=0; REHEARSE=0; ONLY=""; BUDGET=""
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK=1; shift ;;
    --rehearse) REHEARSE=1; shift ;;
    --only) ONLY="$2"; shift 2 ;;
    --budget) BUDGET="$2"; shift 2 ;;
    -h|--help) sed -n "2,/^set -uo/p" "$0" | sed "\$d"; exit 0 ;;
    *) echo "cuda_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
CUDA_TESTS=(tests/test_cuda_kernels.py tests/test_kernels.py tests/test_amp.py tests/test_attention.py
            tests/test_layers.py tests/test_compile.py tests/test_zoos.py)
MODELS=(deit_tiny_patch16_224 deit_small_patch16_224 swin_tiny_patch4_window7_224 pvt_tiny)
if [ "$REHEARSE" = 1 ]; then
  STAGES="env deps build collect emulation roofline bench"
  OUTDIR="${OUT:-$ROOT/outputs/cuda_check_rehearse}"
  export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"  # the H100 / H200 of the device tool
else
  STAGES="env deps build selfcheck tests roofline bench"
  OUTDIR="${OUT:-$ROOT/outputs/cuda_check}"
fi
# --only: those stages, after env and deps (always: cheap, and the others need what deps unpacks)
[ -n "$ONLY" ] && STAGES="env deps $(echo "${ONLY//,/ }" | tr ' ' '\n' | grep -vx 'env\|deps' | tr '\n' ' ')"
[ -n "$BUDGET" ] || BUDGET=$([ "$QUICK" = 1 ] && echo 240 || echo 480)
mkdir -p "$OUTDIR"
PY="${PYTHON:-}"
[ -z "$PY" ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
PY="${PY:-python3}"
DEPS_DIR="$(mktemp -d "${TMPDIR:-/tmp}/mesa_deps.XXXXXX")"
trap 'rm -rf "$DEPS_DIR"' EXIT
export PYTHONPATH="$ROOT:$DEPS_DIR${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# the build stays out of $OUT (the device tool sends $OUT back; a build is tens of MiB)
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$ROOT/outputs/torch_extensions}"
if [ "$REHEARSE" = 0 ] && [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
  TORCH_CUDA_ARCH_LIST="$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())' 2>/dev/null)"
  export TORCH_CUDA_ARCH_LIST
fi
T_START=$SECONDS
: > "$OUTDIR/stages.txt"
echo "[" > "$OUTDIR/summary.json.part"
FAILED=0
stage() {  # stage NAME LIMIT CMD...: CMD under min(LIMIT, what is left of the budget)
  local name="$1" limit="$2"; shift 2
  local left=$(( BUDGET - (SECONDS - T_START) ))
  [ "$left" -lt "$limit" ] && limit="$left"
  if [ "$limit" -le 5 ]; then
    printf '%-10s skipped: the budget of %d s is spent\n' "$name" "$BUDGET" | tee -a "$OUTDIR/stages.txt"
    echo "{\"stage\": \"$name\", \"rc\": null, \"seconds\": 0, \"limit_s\": 0}," >> "$OUTDIR/summary.json.part"
    FAILED=1; return 1
  fi
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUTDIR/$name.txt"
  local rc=${PIPESTATUS[0]}
  local dt=$(( SECONDS - t0 ))
  local note=""
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && note=" (time limit ${limit} s)"
  printf '%-10s rc=%d %4d s%s\n' "$name" "$rc" "$dt" "$note" | tee -a "$OUTDIR/stages.txt"
  echo "{\"stage\": \"$name\", \"rc\": $rc, \"seconds\": $dt, \"limit_s\": $limit}," >> "$OUTDIR/summary.json.part"
  [ "$rc" -eq 0 ] || FAILED=1
  return "$rc"
}
want() { [[ " $STAGES " == *" $1 "* ]]; }
BENCH=(tools/benchmark.py --in-process --paper --optimizer adamw --model "${MODELS[@]}"
       --batch-size 128 --input-size 224 --precision fp16 --json "$OUTDIR/bench_gpu.json"
       --markdown "$OUTDIR/bench.md")
if [ "$QUICK" = 1 ]; then
  BENCH+=(--modes exact,mesa8 --warmup 5 --steps 10)
else
  BENCH+=(--modes exact,exact-explicit,mesa8,mesa8-explicit --warmup 20 --steps 30)
fi

ok=1
if want env; then
  if [ "$REHEARSE" = 1 ]; then
    stage env 60 "$PY" -c "import sys, torch; print('Python', sys.version.split()[0], 'torch', torch.__version__, 'CUDA', torch.version.cuda, '(rehearsal: no GPU needed; arch list $TORCH_CUDA_ARCH_LIST)')" || ok=0
  else
    stage env 60 "$PY" -c "import sys, torch; print('Python', sys.version.split()[0], 'torch', torch.__version__, 'CUDA', torch.version.cuda, 'cuDNN', torch.backends.cudnn.version()); print(torch.cuda.get_device_name(), 'capability', torch.cuda.get_device_capability(), 'arch list', '$TORCH_CUDA_ARCH_LIST')" || ok=0
  fi
fi
if [ "$ok" = 1 ] && want deps; then
  stage deps 60 "$PY" scripts/offline_deps.py --wheels "$ROOT/.whl" --target "$DEPS_DIR" || ok=0
fi
if [ "$ok" = 1 ] && want build; then
  stage build 240 "$PY" -c "from mesa_ops import backend; m = backend.build_extension('cuda'); print('built', m.__name__, 'for arch', '$TORCH_CUDA_ARCH_LIST')" || ok=0
fi
if [ "$ok" = 1 ]; then
  want selfcheck && stage selfcheck 60 "$PY" -m benchmarks.gpu --self-check
  want tests && stage tests 150 "$PY" -m pytest -q -m cuda -rs -p no:cacheprovider "${CUDA_TESTS[@]}"
  want collect && stage collect 120 "$PY" -m benchmarks.gpu --collect "${CUDA_TESTS[@]}"
  want emulation && stage emulation 300 "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda_emulation.py
  if want roofline; then
    if [ "$REHEARSE" = 1 ]; then
      stage roofline 60 "$PY" -m benchmarks.roofline --device cpu --shape 2 197 384 --repeats 3
    else
      MESA_BACKEND=cuda stage roofline 60 "$PY" -m benchmarks.roofline --device cuda
    fi
  fi
  if want bench; then
    if [ "$REHEARSE" = 1 ]; then
      stage bench 240 "$PY" "${BENCH[@]}" --device cuda --dry-run
    else
      MESA_BACKEND=cuda stage bench 300 "$PY" "${BENCH[@]}" --device cuda
    fi
  fi
fi
sed '$ s/,$//' "$OUTDIR/summary.json.part" > "$OUTDIR/summary.json" && echo "]" >> "$OUTDIR/summary.json"
rm -f "$OUTDIR/summary.json.part"
echo "== cuda_check ($([ "$REHEARSE" = 1 ] && echo rehearsal || echo GPU)), $(( SECONDS - T_START )) s of a $BUDGET s budget; files in $OUTDIR"
cat "$OUTDIR/stages.txt"
[ -f "$OUTDIR/bench.md" ] && cat "$OUTDIR/bench.md"
[ -f "$OUTDIR/roofline.txt" ] && cat "$OUTDIR/roofline.txt"
exit "$FAILED"
