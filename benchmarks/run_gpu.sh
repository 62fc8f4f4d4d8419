#!/usr/bin/env bash
# The kernel benchmark on the GPU machine, in one call: build libflashnorm.so (build/) and run
# benchmarks/kernel_benchmark.py on it. The GPU tests (every test marked `gpu`, the long-generation
# test and its race variants against the join-dropping mutant included) are
# plugins/flashnorm/tests/run_gpu.sh's job: one runner selects them by marker.
# Everything lands under $OUT: summary.txt  build.log  bench.log  kernels.md  kernels.json
# Usage on the device: bash benchmarks/run_gpu.sh [--bench-args "..."]
#        bash benchmarks/run_gpu.sh --layernorm
#   --layernorm: issue 48's tables instead: the kernel benchmark's LayerNorm sites (--norm layer)
#   and the ViT-B/16 encoder forward (benchmarks/encoder_step.py); under $OUT also encoder.log
#   encoder_step.md encoder_step.json.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/exporter${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }

bench_args=()
layernorm=0
while [ $# -gt 0 ]; do
  case "$1" in
    --layernorm) layernorm=1 ;;
    --bench-args) read -r -a bench_args <<<"$2"; shift ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
  nvcc --version | tail -n 1
} 2>&1 | tee -a "$SUMMARY"

# Without CUTLASS, AUTO never picks the epilogue-scale GEMM and the tables would measure another
# library: configuring fails then, with the reason.
started=$SECONDS
cmake -S . -B build -G Ninja -DFLASHNORM_BUILD_TESTS=OFF -DFLASHNORM_REQUIRE_CUTLASS=ON \
  -DPython3_EXECUTABLE="$(command -v python3)" >"$OUT/build.log" 2>&1 \
  && cmake --build build --target flashnorm >>"$OUT/build.log" 2>&1
rc=$?
say "build: rc=$rc ($((SECONDS - started)) s)"
if [ "$rc" -ne 0 ]; then
  tail -n 40 "$OUT/build.log"
  exit 1
fi

if [ "$layernorm" -eq 1 ]; then  # issue 48: the LayerNorm kernel tables and the encoder forward
  started=$SECONDS
  FLASHNORM_LIBRARY="$PWD/build/plugins/flashnorm/libflashnorm.so" timeout "${BENCH_TIMEOUT:-200}" \
    python3 benchmarks/kernel_benchmark.py --out "$OUT" --norm layer >"$OUT/bench.log" 2>&1
  say "kernel benchmark, LayerNorm sites: rc=$? ($((SECONDS - started)) s)"
  started=$SECONDS
  FLASHNORM_LIBRARY="$PWD/build/plugins/flashnorm/libflashnorm.so" timeout "${ENCODER_TIMEOUT:-240}" \
    python3 benchmarks/encoder_step.py --out "$OUT" >"$OUT/encoder.log" 2>&1
  say "encoder forward: rc=$? ($((SECONDS - started)) s)"
  [ -f "$OUT/kernels.md" ] && grep -E "^- " "$OUT/kernels.md" | tee -a "$SUMMARY"
  [ -f "$OUT/encoder_step.md" ] && tail -n 16 "$OUT/encoder_step.md" | tee -a "$SUMMARY"
  exit 0
fi

started=$SECONDS
FLASHNORM_LIBRARY="$PWD/build/plugins/flashnorm/libflashnorm.so" timeout "${BENCH_TIMEOUT:-150}" \
  python3 benchmarks/kernel_benchmark.py --out "$OUT" ${bench_args[@]+"${bench_args[@]}"} >"$OUT/bench.log" 2>&1
say "benchmark: rc=$? ($((SECONDS - started)) s)"
[ -f "$OUT/kernels.md" ] && tail -n 12 "$OUT/kernels.md"
cat "$SUMMARY"
