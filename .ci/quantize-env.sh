# Sourced by .ci/run. The tests in tests/quantize run the real quantizers FlashNorm is measured
# against: NVIDIA ModelOpt's ONNX quantization and onnxruntime-genai's model builder. ModelOpt
# pins onnx 1.21 (FlashNorm uses a newer one), so they get a venv of their own, named by
# FLASHNORM_QUANTIZE_VENV; the tests call its Python by subprocess. torch first, the CPU build
# (an unpinned torch is a multi-GB CUDA build); transformers for the builder.
FLASHNORM_QUANTIZE_VENV="${FLASHNORM_QUANTIZE_VENV:-$PWD/.venv-quantize}"
export FLASHNORM_QUANTIZE_VENV
if [ ! -x "$FLASHNORM_QUANTIZE_VENV/bin/python" ]; then
    python3 -m venv "$FLASHNORM_QUANTIZE_VENV"
fi
"$FLASHNORM_QUANTIZE_VENV/bin/python" -m pip install -q --upgrade pip
"$FLASHNORM_QUANTIZE_VENV/bin/python" -m pip install -q torch==2.13.0
"$FLASHNORM_QUANTIZE_VENV/bin/python" -m pip install -q "nvidia-modelopt[onnx]==0.47.0" onnxruntime-genai==0.18.0 \
    transformers==5.25.0
"$FLASHNORM_QUANTIZE_VENV/bin/python" -c 'import modelopt.onnx.quantization, onnxruntime_genai' 2>/dev/null
