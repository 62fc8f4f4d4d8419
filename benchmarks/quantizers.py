"""The quantizers FlashNorm is measured against, run as their users run them: NVIDIA ModelOpt's
ONNX quantization (`python -m modelopt.onnx.quantization`) and onnxruntime-genai's model builder
(`python -m onnxruntime_genai.models.builder`), each in the Python environment that holds them
(`pip install -e ".[quantize]"`, or the separate venv `.ci/quantize-env.sh` makes: ModelOpt pins
an older onnx than FlashNorm's); ONNX Runtime's own quantizers (`python -m
onnxruntime.quantization.matmul_nbits_quantizer`, `quantize_dynamic`, `quantize_static`) in
any Python with onnxruntime, FlashNorm's included. Shared by benchmarks/quantized_budget.py,
tests/quantize and samples/quantized_smollm2.py.

The environment: `--quantize-python PATH`, else `$FLASHNORM_QUANTIZE_VENV/bin/python`, else this
Python when it imports both producers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

VENV_VARIABLE = "FLASHNORM_QUANTIZE_VENV"


def quantize_python(explicit: str | None = None) -> str | None:
    """The Python that runs the producers, or None where none is installed."""
    if explicit:
        return explicit
    venv = os.environ.get(VENV_VARIABLE)
    if venv:
        python = Path(venv) / "bin" / "python"
        return str(python) if python.is_file() else None
    if all(importlib.util.find_spec(name) for name in ("modelopt", "onnxruntime_genai")):
        return sys.executable
    return None


def missing_reason() -> str:
    return (f"the quantizers are not installed: set {VENV_VARIABLE} to a venv made by .ci/quantize-env.sh "
            "(or pip install -e \".[quantize]\")")


def _run(command: Sequence[str], log: Path, timeout: float) -> float:
    started = time.monotonic()
    with open(log, "w") as handle:
        result = subprocess.run(list(command), stdout=handle, stderr=subprocess.STDOUT, timeout=timeout,
                                env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if result.returncode:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        raise RuntimeError(f"{' '.join(map(str, command[:4]))} ... failed ({result.returncode}); log {log}:\n"
                           + "\n".join(tail))
    return round(time.monotonic() - started, 1)


def modelopt(python: str, source: Path, output: Path, *, mode: str = "int4", method: str = "rtn_dq",
             extra: Sequence[str] = (), timeout: float = 3600) -> dict[str, Any]:
    """ModelOpt's ONNX quantization of `source` on CPU; returns the command and its seconds."""
    command = [python, "-m", "modelopt.onnx.quantization", "--onnx_path", str(source), "--output_path", str(output),
               "--quantize_mode", mode, "--calibration_method", method, "--calibration_eps", "cpu", *extra]
    seconds = _run(command, output.with_suffix(".log"), timeout)
    return {"command": _shown(command), "seconds": seconds}


def genai_builder(python: str, hf_dir: Path, output_dir: Path, *, precision: str = "int4",
                  extra: Sequence[str] = (), timeout: float = 3600) -> dict[str, Any]:
    """onnxruntime-genai's builder for CPU; the model is `output_dir / "model.onnx"`."""
    command = [python, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(output_dir),
               "-p", precision, "-e", "cpu", *extra]
    output_dir.mkdir(parents=True, exist_ok=True)
    seconds = _run(command, output_dir.parent / f"{output_dir.name}.log", timeout)
    return {"command": _shown(command), "seconds": seconds, "model": str(output_dir / "model.onnx")}


def ort_nbits(python: str, source: Path, output: Path, *, block: int, symmetric: bool, method: str = "default",
              timeout: float = 3600) -> dict[str, Any]:
    """ONNX Runtime's MatMulNBitsQuantizer (int4 weight-only, blocks of `block` along K) through its
    command line; `method` 'default' is round-to-nearest, 'hqq' half-quadratic (asymmetric only)."""
    command = [python, "-m", "onnxruntime.quantization.matmul_nbits_quantizer", "--input_model", str(source),
               "--output_model", str(output), "--block_size", str(block), "--quant_method", method]
    if method != "hqq":
        command += ["--symmetric", str(symmetric)]
    seconds = _run(command, output.with_suffix(".log"), timeout)
    return {"command": _shown(command), "seconds": seconds}


_ORT_INT8 = """
import sys, numpy as np
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_dynamic, quantize_static
mode, source, output, calibration = sys.argv[1:5]
if mode == "dynamic":
    quantize_dynamic(source, output, weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul"])
else:
    class Reader(CalibrationDataReader):
        def __init__(self):
            data = np.load(calibration)
            self.items = iter([{name: data[name] for name in data.files}])
        def get_next(self):
            return next(self.items, None)
    quantize_static(source, output, Reader(), quant_format=QuantFormat.QDQ, op_types_to_quantize=["MatMul"],
                    nodes_to_exclude=sys.argv[5:])
"""


def ort_int8(python: str, source: Path, output: Path, *, mode: str, calibration: Path | None = None,
             exclude: Sequence[str] = (), timeout: float = 3600) -> dict[str, Any]:
    """ONNX Runtime's int8 quantizers on the MatMuls, otherwise at their defaults: `mode` 'dynamic'
    (`quantize_dynamic`: int8 weights, one scale per tensor; each activation quantized per call by
    DynamicQuantizeLinear) or 'static' (`quantize_static`, QDQ: int8 weights per tensor, uint8
    activations with scales calibrated on the `calibration` .npz, MinMax; `exclude`: node names
    left float)."""
    command = [python, "-c", _ORT_INT8, mode, str(source), str(output), str(calibration or ""), *exclude]
    seconds = _run(command, output.with_suffix(".log"), timeout)
    shown = (f"quantize_static(quant_format=QDQ, op_types_to_quantize=['MatMul'], {len(exclude)} nodes excluded)"
             if mode == "static" else "quantize_dynamic(weight_type=QInt8, op_types_to_quantize=['MatMul'])")
    return {"command": f"onnxruntime.quantization.{shown}", "seconds": seconds}


_GENAI_GREEDY = """
import json, sys
import onnxruntime_genai as og
directory, ids, count = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
model = og.Model(directory)
params = og.GeneratorParams(model)
params.set_search_options(max_length=len(ids) + count, do_sample=False)
generator = og.Generator(model, params)
generator.append_tokens(ids)
out = []
while len(out) < count and not generator.is_done():
    generator.generate_next_token()
    out.append(int(generator.get_next_tokens()[0]))
print(json.dumps(out))
"""


def genai_greedy(python: str, model_dir: Path, prompt: Sequence[int], count: int) -> list[int]:
    """`count` greedy tokens after `prompt` from onnxruntime-genai's own Generator."""
    result = subprocess.run([python, "-c", _GENAI_GREEDY, str(model_dir), json.dumps([int(t) for t in prompt]),
                             str(count)], capture_output=True, text=True, timeout=600)
    if result.returncode:
        raise RuntimeError(f"onnxruntime-genai generation failed: {result.stderr.strip().splitlines()[-1:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def save_hf_dir(model: Any, tokenizer: Any, directory: Path) -> Path:
    """A plain float Hugging Face directory of a loaded model (a GGUF-loaded one included:
    transformers refuses to save those, so the weights go into a fresh model of the same config,
    without the `quantization_config` that records the GGUF file)."""
    import copy

    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config)
    fresh.load_state_dict(model.state_dict())
    fresh.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def tiny_llama_hf(directory: Path, seed: int = 0) -> Path:
    """A small random Llama (the architecture of SmolLM2: tied head, GQA) with random, partly
    negative gains, hidden 256 so that int4 blocks of 128 and 32 fit, saved with a word-level
    tokenizer of its 384 tokens ("<unk>", "<s>", "</s>", "t3" … "t383"; the genai builder writes
    the tokenizer too). The vocabulary differs from every projection's width: onnxruntime-genai
    0.18's builder wires its LM head to the wrong tensor when the intermediate size equals the
    vocabulary size (seen with 512 and 512: logits from layer 0)."""
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    config = LlamaConfig(vocab_size=384, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
                         tie_word_embeddings=True, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                gain = rng.uniform(0.05, 2.0, parameter.shape) * np.where(rng.random(parameter.shape) < 0.2, -1, 1)
                parameter.copy_(torch.from_numpy(gain.astype(np.float32)))
    model.save_pretrained(directory)
    _tiny_tokenizer(config.vocab_size).save_pretrained(directory)
    return directory


def _tiny_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def _shown(command: Sequence[str]) -> str:
    return " ".join("python" if i == 0 else str(part) for i, part in enumerate(command))
