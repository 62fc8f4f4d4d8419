#!/usr/bin/env bash
# One GPU session for the TensorRT plugin: build libflashnorm_plugin.so and the harness with
# nvcc there, then run the harness through the lean runtime's plugin registry, CPU and GPU
# parts, both loading routes. Logs go to $OUT (or ./out).
#
#   LEAN_WHEEL=.carry/trtlean/tensorrt_lean_cu13_libs-*.whl plugins/flashnorm/tests/run_gpu_trt_harness.sh
set -uo pipefail
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
BUILD="${BUILD:-/tmp/flashnorm-trt-build}"
LEAN_DIR=/tmp/flashnorm-lean
exec > >(tee "$OUT/run_gpu.log") 2>&1

wheel=$(ls ${LEAN_WHEEL:-.carry/trtlean/tensorrt_lean_cu13_libs-*.whl} | head -n 1)
python3 -m zipfile -e "$wheel" "$LEAN_DIR" || exit 1
LEAN="$LEAN_DIR/tensorrt_lean_libs/libnvinfer_lean.so.11"

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
nvcc --version | tail -n 1
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90-real \
  -DTENSORRT_INCLUDE_DIR="$PWD/third_party/TensorRT/include" -DPython3_EXECUTABLE="$(command -v python3)" \
  | grep -E "FlashNorm|Error|error" || true
cmake --build "$BUILD" -j "$(nproc)" --target flashnorm_trt_harness 2>&1 | grep -E "error|warning|Built target" || true
PLUGIN="$BUILD/lib/libflashnorm_plugin.so"
HARNESS="$BUILD/plugins/flashnorm/tests/flashnorm_trt_harness"
[ -x "$HARNESS" ] || { echo "build failed"; exit 1; }
readelf -d "$PLUGIN" | grep -E "NEEDED|RUNPATH"
nm -D --defined-only "$PLUGIN"

status=0
echo "=== route: dlopen (self-registration), CPU checks"
"$HARNESS" --runtime "$LEAN" --plugin "$PLUGIN" --route dlopen || status=1
echo "=== route: IPluginRegistry::loadLibrary, CPU + GPU checks"
"$HARNESS" --runtime "$LEAN" --plugin "$PLUGIN" --route loadLibrary --gpu | tee "$OUT/harness_gpu.log" || status=1
echo "=== exit status $status"
exit $status
