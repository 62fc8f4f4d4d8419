"""`flashnorm compare` on half-precision models: fp16 on ONNX Runtime as it runs the file, bf16 (no
bf16 MatMul in ONNX Runtime) as fp32 copies of the bf16 weights with every bf16 activation
rounded; the report says which, and nothing is skipped."""

from __future__ import annotations

import json

import pytest

from flashnorm import cli
from flashnorm.passes import optimize_file
from flashnorm.progress import Progress
from models import cache

pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setattr(Progress, "enabled", False)


@pytest.fixture(scope="module", params=["fp16", "bf16"])
def half_pair(request, tmp_path_factory):
    from flashnorm.export import export_causal_lm

    directory = tmp_path_factory.mktemp(request.param)
    original = directory / "model.onnx"
    export_causal_lm(cache.tiny_llama_model(), original, dtype=request.param, kv_cache=True)
    optimized = directory / "model.flashnorm.onnx"
    optimize_file(original, optimized, ("fold", "defer"))
    return request.param, original, optimized


def test_compare_half_models_says_how_they_ran(half_pair, tmp_path, capsys):
    dtype, original, optimized = half_pair
    report_path = tmp_path / "report.json"
    argv = ["compare", str(original), str(optimized), "--past-length", "3", "--generate", "4",
            "--max-rel-l2", "0.1", "--atol", "1", "--report", str(report_path)]
    cli.main(argv)
    out = capsys.readouterr().out
    report = json.loads(report_path.read_text())
    logits = next(o for o in report["outputs"] if o["name"] == "logits")
    assert logits["nonfinite"] == 0 and logits["rel_l2"] < {"fp16": 0.01, "bf16": 0.1}[dtype]
    assert {o["name"] for o in report["outputs"]} >= {"logits", "present.0.key", "present.1.value"}
    assert len(report["generation"]["candidate_tokens"]) == 4
    expected = "float16 on ONNX Runtime" if dtype == "fp16" else "bfloat16: float32 copy of the bfloat16 weights"
    for role in ("reference", "candidate"):
        assert report["precision"][role].startswith(expected)
        assert f"{role} ran in {expected}" in out


def test_bfloat16_on_another_provider_is_one_line(half_pair, capsys):
    dtype, original, optimized = half_pair
    if dtype != "bf16":
        pytest.skip("the provider restriction is bfloat16's")
    assert cli.main(["compare", str(original), str(optimized), "--providers", "CUDAExecutionProvider"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "runs emulated on ONNX Runtime's CPU provider only" in err


@pytest.fixture(scope="module", params=["fp16", "bf16"])
def budget_trio(request, tmp_path_factory):
    """The tiny Llama in fp32 and in the half type (no KV cache: the three take the same token
    ids), and the half export optimized with fold,defer."""
    from flashnorm.export import export_causal_lm

    directory = tmp_path_factory.mktemp(f"budget-{request.param}")
    fp32, half, optimized = directory / "model.onnx", directory / "half.onnx", directory / "half.flashnorm.onnx"
    export_causal_lm(cache.tiny_llama_model(), fp32)
    export_causal_lm(cache.tiny_llama_model(), half, dtype=request.param)
    optimize_file(half, optimized, ("fold", "defer"))
    return fp32, half, optimized


def test_budget_judges_instead_of_the_tolerances(budget_trio, tmp_path, capsys):
    fp32, half, optimized = budget_trio
    report_path = tmp_path / "report.json"
    argv = ["compare", str(half), str(optimized), "--budget", str(fp32), "--report", str(report_path)]
    # 32 positions: one argmax moves top-1 by 3 points, so the test judges the ratio alone.
    argv += ["--budget-top1-points", "100"]
    assert cli.main([*argv, "--budget-ratio", "1000"]) == 0
    out = capsys.readouterr().out
    report = json.loads(report_path.read_text())
    # The fp32-tight default tolerances fail a half model; with --budget they do not decide.
    assert report["tolerances_passed"] is False and report["passed"] is True
    (logits,) = report["budget"]["outputs"]
    assert logits["ratio"] == pytest.approx(logits["candidate_rel_l2"] / logits["reference_rel_l2"])
    assert report["budget"]["fp32_model"] == str(fp32) and report["budget"]["max_ratio"] == 1000
    assert "not judged: --budget judges" in out and f"half-precision budget against the fp32 model {fp32}" in out
    assert cli.main([*argv, "--budget-ratio", "0.01"]) == 1
    assert json.loads(report_path.read_text())["budget"]["passed"] is False
    assert "FAIL logits" in capsys.readouterr().out


@pytest.mark.parametrize("case,message", [
    ("half", "not float32: the budget measures both half models against the fp32 export"),
    ("missing", "does not exist or is not a file"),
    ("ratio", "argument --budget-ratio: must be greater than 0"),
    ("points", "argument --budget-top1-points: must be at least 0"),
])
def test_bad_budget_input_is_one_line(budget_trio, tmp_path, capsys, case, message):
    fp32, half, optimized = budget_trio
    tail = {"half": ["--budget", str(half)], "missing": ["--budget", str(tmp_path / "absent.onnx")],
            "ratio": ["--budget", str(fp32), "--budget-ratio", "0"],
            "points": ["--budget", str(fp32), "--budget-top1-points", "-1"]}[case]
    assert cli.main(["compare", str(half), str(optimized), *tail]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
