"""A real TensorRT ONNX parser and builder: TensorRT for RTX (`tensorrt_rtx`, PyPI), which builds
engines on a machine without a GPU and has no plugin layers, so every FlashNormMatMul<N> node is
built from its model-local reference function. Installed by `pip install -e ".[dev]"`: in CI these
tests must run, elsewhere they skip without it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest

from flashnorm import cli, contract, modelio
from flashnorm.engine import BuildOptions, ShapeRange, build_engine_file, build_serialized_engine
from flashnorm.errors import FlashNormError
from flashnorm.passes import run_passes
from flashnorm.progress import Progress
from synthetic import build_multi_arity_model, feeds, run

if importlib.util.find_spec("tensorrt_rtx") is None:
    if os.environ.get("CI") == "true":
        pytest.fail("tensorrt_rtx is not installed: CI installs it with the [dev] extra", pytrace=False)
    pytest.skip("tensorrt_rtx is not installed (pip install -e '.[dev]')", allow_module_level=True)

PROFILE = {"x": ShapeRange((1, 1, 32), (2, 8, 32), (4, 512, 32))}


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setattr(Progress, "enabled", False)


@pytest.fixture
def models(rng, tmp_path) -> dict[str, Path]:
    """A model with three norms feeding 3, 2 and 1 projections: folded, and folded + deferred
    (FlashNormMatMul3, FlashNormMatMul2 and FlashNormMatMul1 in one file)."""
    model = build_multi_arity_model(rng)
    paths = {}
    for name, passes in (("folded", ["fold"]), ("deferred", ["fold", "defer"])):
        graph, _ = run_passes(gs.import_onnx(model), passes)
        paths[name] = tmp_path / f"{name}.onnx"
        modelio.save(graph, paths[name])
    return paths


def legacy_encoding(deferred: Path, destination: Path) -> Path:
    """The file as FlashNorm wrote it before FlashNormMatMul<N>: one op type for every arity,
    its reference functions ONNX overloads of that one name."""
    model = onnx.load(str(deferred))
    for node in model.graph.node:
        if contract.is_deferred_node(node.op_type, node.domain):
            node.overload = f"outputs{len(node.output)}"
            node.op_type = contract.LEGACY_OP_TYPE
    for function in model.functions:
        function.overload = f"outputs{contract.output_count(function.name)}"
        function.name = contract.LEGACY_OP_TYPE
    model.ir_version = 10
    onnx.save(model, str(destination))
    return destination


PARSE = """
import sys
import tensorrt_rtx as trt

logger = trt.Logger(trt.Logger.ERROR)
network = trt.Builder(logger).create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
parser = trt.OnnxParser(network, logger)
parsed = parser.parse_from_file(sys.argv[1])
print(parsed, parser.num_errors, parser.get_error(0).desc() if parser.num_errors else "")
"""


def test_old_encoding_fails_the_parser_and_the_new_one_builds(models, tmp_path):
    """The bug this encoding fixes: with one function name for 1-, 2- and 3-output nodes, the
    parser gave every node the first body it registered, and the Split inside it did not
    match the node's outputs. `flashnorm build` refuses such a file with what to do."""
    old = legacy_encoding(models["deferred"], tmp_path / "old.onnx")
    parsed = subprocess.run([sys.executable, "-c", PARSE, str(old)], capture_output=True, text=True, timeout=300)
    verdict = parsed.stdout.splitlines()[-1]  # TensorRT's own log lines come first
    assert verdict.startswith("False 1"), parsed.stdout + parsed.stderr[-2000:]
    assert "The number of the split attribute misaligns with the number of outputs" in verdict

    with pytest.raises(FlashNormError, match="re-run `flashnorm optimize`"):
        build_engine_file(old, tmp_path / "old.plan", BuildOptions(backend="tensorrt-rtx", shapes=PROFILE))
    assert not (tmp_path / "old.plan").exists()

    parsed = subprocess.run([sys.executable, "-c", PARSE, str(models["deferred"])], capture_output=True, text=True,
                            timeout=300)
    assert parsed.stdout.splitlines()[-1].startswith("True 0"), parsed.stdout + parsed.stderr[-2000:]


def test_deferred_model_builds_from_reference_functions(models, tmp_path):
    plan = tmp_path / "deferred.plan"
    report = build_engine_file(models["deferred"], plan, BuildOptions(backend="tensorrt-rtx", shapes=PROFILE))
    assert plan.is_file() and plan.stat().st_size == report["engine_bytes"] > 0
    assert report["backend"] == "tensorrt-rtx" and report["tensorrt"].startswith("1.")
    assert report["profile"] == {"x": "1x1x32,2x8x32,4x512x32"}
    assert report["flashnorm_nodes"] == 3 and report["flashnorm_plugin_layers"] == 0
    assert "reference functions" in report["note"]
    # Two mean reductions per node's reference body: the mean (times the statistic, 0 for an RMSNorm:
    # one body for both statistics) and the mean of squares.
    assert report["network"]["mean_reductions"] == 2 * 3
    assert report["network"]["layer_types"]["MATRIX_MULTIPLY"] == 3
    assert report["parser_warnings_suppressed"] > 0
    inspector = report["engine_inspector"]
    assert inspector["available"] or "cannot be deserialized here" in inspector["reason"]


def test_folded_and_deferred_are_the_same_network_arithmetic(models):
    """What defer changes inside TensorRT without the plugin: the same norms (each reference body
    also takes the mean, multiplied by the RMS statistic's 0), the projections' matrix multiplies
    merged into one per norm."""
    options = BuildOptions(backend="tensorrt-rtx", shapes=PROFILE, optimization_level=0)
    _, folded = build_serialized_engine(models["folded"], options)
    _, deferred = build_serialized_engine(models["deferred"], options)
    assert folded["network"]["mean_reductions"] == 3 and deferred["network"]["mean_reductions"] == 2 * 3
    assert folded["network"]["layer_types"]["MATRIX_MULTIPLY"] == 6
    assert deferred["network"]["layer_types"]["MATRIX_MULTIPLY"] == 3
    assert folded["optimization_level"] == 0


def test_plugin_with_tensorrt_rtx_is_refused_in_one_line(models, tmp_path, capsys):
    plugin = tmp_path / "libflashnorm_plugin.so"
    plugin.write_bytes(b"\x7fELF stand-in")  # never loaded: the refusal comes first
    plan = tmp_path / "model.plan"
    code = cli.main(["build", str(models["deferred"]), "-o", str(plan), "--backend", "tensorrt-rtx",
                     "--plugin", str(plugin), "--shapes", "x:1x1x32,2x8x32,4x512x32"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "TensorRT for RTX has no plugin layers" in err and "--backend tensorrt" in err
    assert not plan.exists()


def test_timing_cache_is_not_used_by_tensorrt_rtx(models, tmp_path):
    cache = tmp_path / "timing.cache"
    report = build_engine_file(models["deferred"], tmp_path / "model.plan",
                               BuildOptions(backend="tensorrt-rtx", shapes=PROFILE, timing_cache=cache))
    assert report["timing_cache"] is None and "selects kernels at run time" in report["timing_cache_note"]
    assert not cache.exists()


def test_compare_trt_says_it_did_not_compare(models, tmp_path, capsys):
    """No GPU TensorRT-RTX runs on here: the engine is built (checked), one line says why
    nothing was compared, and exit code 3 says it was not a comparison that failed."""
    code = cli.main(["compare", str(models["folded"]), str(models["deferred"]), "--trt", "--backend", "tensorrt-rtx",
                     "--input-shapes", "x:2x8x32", "-q"])
    captured = capsys.readouterr()
    if code == 0:
        pytest.skip("a GPU TensorRT-RTX runs on is present: the comparison ran")
    assert code == 3, captured.err
    assert captured.err.count("\n") == 1 and "not compared" in captured.err and "built the engine" in captured.err
    assert captured.out == ""


def test_sanitized_deferred_file_still_runs_and_parses(models, tmp_path, rng):
    """`polygraphy surgeon sanitize --fold-constants`, the usual step before TensorRT, rewrites
    the file through onnx-graphsurgeon: ONNX Runtime still runs it with the folded model's
    outputs, and TensorRT-RTX still parses and builds it."""
    sanitized = tmp_path / "sanitized.onnx"
    result = subprocess.run(["polygraphy", "surgeon", "sanitize", str(models["deferred"]), "--fold-constants",
                             "-o", str(sanitized)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    model = onnx.load(str(sanitized))
    assert sorted(f.name for f in model.functions) == ["FlashNormMatMul1", "FlashNormMatMul2", "FlashNormMatMul3"]
    inputs = feeds(model, rng)
    for got, want in zip(run(str(sanitized), inputs), run(str(models["folded"]), inputs)):
        assert np.max(np.abs(got - want)) <= 1e-5 * max(1.0, float(np.max(np.abs(want))))
    _, report = build_serialized_engine(sanitized, BuildOptions(backend="tensorrt-rtx", shapes=PROFILE,
                                                                optimization_level=0))
    assert report["flashnorm_nodes"] == 3


def test_build_report_as_json(models, tmp_path, capsys):
    plan = tmp_path / "model.plan"
    code = cli.main(["build", str(models["deferred"]), "-o", str(plan), "--shapes", "x:1x1x32,2x8x32,4x512x32",
                     "--backend", "tensorrt-rtx", "--optimization-level", "0", "--report", "-"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["backend"] == "tensorrt-rtx" and report["output"] == str(plan) and plan.is_file()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_models_build_folded_and_deferred(dtype, rng, tmp_path):
    """fp16/bf16 graphs (norm in fp32 between Casts, half weights) build strongly typed, folded
    and deferred; the engine holds half weights (smaller than the fp32 build of the same
    graph) where folded."""
    from synthetic import build_half_norm_model

    seed = int(rng.integers(2**31))
    sizes = {}
    for precision in ("float32", dtype):
        model = build_half_norm_model("pow_div", seed, precision, hidden=256, widths=(256, 256, 256))
        for name, passes in (("folded", ["fold"]), ("deferred", ["fold", "defer"])):
            graph, _ = run_passes(gs.import_onnx(model), passes)
            path = tmp_path / f"{precision}.{name}.onnx"
            modelio.save(graph, path)
            options = BuildOptions(backend="tensorrt-rtx", shapes={"x": ShapeRange((1, 1, 256), (2, 8, 256), (4, 64, 256))},
                                   optimization_level=0)
            plan, report = build_serialized_engine(path, options)
            assert report["strongly_typed"] and report["network"]["mean_reductions"] == (2 if name == "deferred" else 1)
            assert report["flashnorm_nodes"] == (1 if name == "deferred" else 0)
            sizes[precision, name] = report["engine_bytes"]
    weights = 3 * 256 * 256  # elements of the three projections
    assert sizes["float32", "folded"] - sizes[dtype, "folded"] >= weights * 2 * 0.9


@pytest.mark.parametrize("spelling", ["ln_decomposed", "layer_normalization"])
def test_deferred_layernorm_builds_from_its_reference_function(spelling, rng, tmp_path):
    """LayerNorm mode: the parser reads the node's statistic and its bias input, and builds the
    reference body (the mean subtracted for the variance; the projections' biases added)."""
    from synthetic import build_parallel_block

    graph, _ = run_passes(gs.import_onnx(build_parallel_block(rng, spelling=spelling)), ["fold", "defer"])
    path = tmp_path / "deferred_ln.onnx"
    modelio.save(graph, path)
    _, report = build_serialized_engine(path, BuildOptions(backend="tensorrt-rtx", shapes=PROFILE, optimization_level=0))
    assert report["flashnorm_nodes"] == 2 and report["flashnorm_plugin_layers"] == 0
    assert report["network"]["layer_types"]["MATRIX_MULTIPLY"] == 2 + 2  # one per node, two in the attention stand-in
