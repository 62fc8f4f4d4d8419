"""The real quantizers on a small random Llama (SmolLM2's architecture: tied head, GQA, hidden
256 so that int4 blocks of 128 and 32 fit), run through the quantize environment's Python
(`.ci/quantize-env.sh`, FLASHNORM_QUANTIZE_VENV): ModelOpt int4 rtn_dq on `flashnorm export`'s
file, unfolded and folded selectively; onnxruntime-genai's builder (fp32 and int4) on the
Hugging Face directory and on `fold-checkpoint`'s. Each quantized pair goes through the NLL
budget (`flashnorm compare --budget`); random weights make no promise about the verdict, so the
tests check that the machinery runs and reports, and what must hold exactly: the builder's fp32
model measures the NLL of our fp32 export, and onnxruntime-genai's own Generator gives the
greedy tokens our measurement gives. The real figures: benchmarks/quantized_budget.py,
docs/QUANTIZATION.md."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from flashnorm import cli
from flashnorm.progress import Progress
from flashnorm.validate import likelihood

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import quantizers  # noqa: E402

pytest.importorskip("torch")
PYTHON = quantizers.quantize_python()
# Minutes on two cores (ModelOpt and the builder each start torch): out of the fast loop; CI runs it.
pytestmark = [pytest.mark.slow, pytest.mark.skipif(PYTHON is None, reason=quantizers.missing_reason())]

IDS = np.random.default_rng(0).integers(3, 384, 96).tolist()


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setattr(Progress, "enabled", False)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    from flashnorm.export.onnx_export import export_source
    from flashnorm.export.sources import resolve_source

    directory = tmp_path_factory.mktemp("quantize")
    hf = quantizers.tiny_llama_hf(directory / "hf")
    export_source(resolve_source(hf), directory / "model.onnx")
    return directory


def _budget(tmp_path, fp32, reference, candidate) -> dict:
    report = tmp_path / "budget.json"
    code = cli.main(["compare", str(reference), str(candidate), "--budget", str(fp32), "--input-ids",
                     ",".join(map(str, IDS)), "--optimization-level", "basic", "--generate", "8", "--budget-segment", "8",
                     "--report", str(report), "-q"])
    result = json.loads(report.read_text())["quantized_budget"]
    assert code == result["exit_code"] == {"within": 0, "over": 1, "inconclusive": 4}[result["verdict"]]
    assert result["interval"]["low"] <= result["interval"]["estimate"] <= result["interval"]["high"]
    assert all(np.isfinite([result["float_nll"], result["reference_nll"], result["candidate_nll"]]))
    assert len(result["candidate_greedy"]) == 8
    return result


def test_modelopt_int4_rtn(work, tmp_path):
    from flashnorm.passes import optimize_file

    fp32 = work / "model.onnx"
    optimize_file(fp32, work / "select.onnx", ["fold"], for_quantization="int4")
    made = {}
    for name in ("model", "select"):  # two runs: each starts torch and ModelOpt (about 40 s on two cores)
        made[name] = work / f"{name}.int4.onnx"
        quantizers.modelopt(PYTHON, work / f"{name}.onnx", made[name], mode="int4", method="rtn_dq", timeout=600)
        assert likelihood.quantized_ops(made[name]) == {"DequantizeLinear": 14}  # 7 projections × 2 layers
    result = _budget(tmp_path, fp32, made["model"], made["select"])
    assert result["quantized_ops"]["candidate"] == {"DequantizeLinear": 14}


def test_genai_builder(work, tmp_path):
    from flashnorm.checkpoint import fold_checkpoint
    from flashnorm.validate.runners import make_session

    fold_checkpoint(work / "hf", work / "hf-folded")
    fp32 = quantizers.genai_builder(PYTHON, work / "hf", work / "genai-fp32", precision="fp32", timeout=600)
    int4 = quantizers.genai_builder(PYTHON, work / "hf", work / "genai-int4", timeout=600)
    folded = quantizers.genai_builder(PYTHON, work / "hf-folded", work / "genai-folded-int4", timeout=600)
    assert "MatMulNBits" in likelihood.quantized_ops(int4["model"])

    # The builder's fp32 model (GroupQueryAttention, fused norms, a KV cache fed empty) measures
    # what our fp32 export measures: the NLL runs any causal LM's inputs correctly.
    ours = likelihood.measure(work / "model.onnx", IDS, greedy=8)
    theirs = likelihood.measure(fp32["model"], IDS, greedy=8)
    assert theirs.nll == pytest.approx(ours.nll, abs=1e-4)
    # onnxruntime-genai's own runtime generates what our measurement generates.
    assert quantizers.genai_greedy(PYTHON, work / "genai-fp32", IDS[:16], 8) == theirs.greedy == ours.greedy

    result = _budget(tmp_path, work / "model.onnx", int4["model"], folded["model"])
    assert "MatMulNBits" in result["quantized_ops"]["candidate"]
    generated = quantizers.genai_greedy(PYTHON, work / "genai-int4", IDS[:16], 8)
    session = make_session(int4["model"])
    assert generated == likelihood.greedy_tokens(session, IDS[:16], 8, head_size=likelihood.past_head_size(int4["model"]))
