"""`flashnorm triton`: one-line errors and non-zero exits for bad input, nothing half-written,
a JSON report that says where the engine's inputs and outputs came from."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest

pytest.importorskip("tritonclient.grpc", reason="needs tritonclient[grpc] (flashnorm[serve])")

from flashnorm import cli  # noqa: E402
from flashnorm.serve.config import parse_model_config  # noqa: E402

HAS_TENSORRT = importlib.util.find_spec("tensorrt") is not None


@pytest.fixture
def projection_model(tmp_path, rng):
    """Writes `x [batch, k] → y = x·W`, `ids [batch] → ids_out` with a fresh random W; returns (path, W)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    def write():
        weight = rng.standard_normal((int(rng.integers(2, 9)), int(rng.integers(2, 9)))).astype(np.float32)
        k, n = weight.shape
        graph = helper.make_graph(
            [helper.make_node("MatMul", ["x", "W"], ["y"]), helper.make_node("Identity", ["ids"], ["ids_out"])],
            "projection",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", k]),
             helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch"])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", n]),
             helper.make_tensor_value_info("ids_out", TensorProto.INT64, ["batch"])],
            [numpy_helper.from_array(weight, "W")],
        )
        path = tmp_path / "projection.onnx"
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
        return path, weight

    return write


@pytest.fixture
def engine_files(tmp_path, rng):
    engine, plugin = tmp_path / "smol.plan", tmp_path / "libflashnorm_plugin.so"
    engine.write_bytes(rng.bytes(256))
    plugin.write_bytes(rng.bytes(256))
    return engine, plugin


def _error(capsys) -> str:
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err, captured.err
    return captured.err


@pytest.mark.parametrize("arguments, message", [
    (["--triton-backend", "python"], "--triton-backend python needs --onnx"),
    ([], "needs --engine MODEL.plan and --plugin"),
    (["--engine", "{engine}"], "--plugin LIB.so is missing"),
    (["--engine", "{rtx_engine}", "--plugin", "{plugin}"], "is a TensorRT-RTX plan, which Triton's TensorRT backend cannot load"),
    (["--engine", "{tmp}/absent.plan", "--plugin", "{plugin}", "--io", "in:x:fp32:-1", "--io", "out:y:fp32:-1"],
     "engine .*absent.plan does not exist"),
    (["--engine", "{engine}", "--plugin", "{tmp}/absent.so", "--io", "in:x:fp32:-1", "--io", "out:y:fp32:-1"],
     "plugin library .*absent.so does not exist"),
    (["--engine", "{engine}", "--plugin", "{plugin}", "--io", "in:x:fp32:-1"], "at least one input"),
    (["--engine", "{engine}", "--plugin", "{plugin}", "--io", "in:x:fp32:-1", "--io", "out:y:fp32:-1",
      "--outputs", "y"], "--outputs applies to --triton-backend python"),
    (["--onnx", "{onnx}", "--triton-backend", "python", "--outputs", "logits"], r"unknown output name\(s\) \['logits'\]"),
    (["--onnx", "{onnx}", "--triton-backend", "python", "--engine", "{engine}"], "--engine applies to --triton-backend tensorrt"),
    (["--onnx", "{tmp}/absent.onnx", "--triton-backend", "python"], "model .*absent.onnx does not exist or is not a file"),
    (["--onnx", "{onnx}", "--triton-backend", "python", "--instances", "0"], "argument --instances: must be at least 1"),
    (["--onnx", "{onnx}", "--triton-backend", "python", "--shapes", "x:1x2,1x2,1x2"], "--shapes applies to --triton-backend tensorrt"),
    (["--onnx", "{onnx}", "--triton-backend", "python", "--check-requests"], "--check-requests applies to --triton-backend tensorrt"),
    (["--engine", "{engine}", "--plugin", "{plugin}", "--io", "in:x:fp32:-1,4", "--io", "out:y:fp64:-1,4"],
     "output 'y' is TYPE_FP64, which no TensorRT engine takes or returns"),
    (["--engine", "{engine}", "--plugin", "{plugin}", "--io", "in:ids:int64:-1,-1", "--io", "out:y:fp16:-1,-1,9",
      "--shapes", "ids:1x1,2x16,4x64"], "takes batch 1..4, but with --max-batch-size 8 .* pass --max-batch-size 4"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(arguments, message, tmp_path, engine_files,
                                                         projection_model, capsys):
    engine, plugin = engine_files
    onnx_path, _ = projection_model()
    rtx_engine = tmp_path / "rtx.plan"
    rtx_engine.write_bytes(b"vtrt" + engine.read_bytes())  # how a TensorRT-RTX plan starts
    values = {"engine": engine, "rtx_engine": rtx_engine, "plugin": plugin, "onnx": onnx_path, "tmp": tmp_path}
    argv = ["triton", *(a.format(**values) for a in arguments), "-o", str(tmp_path / "repo")]
    assert cli.main(argv) == 2
    assert re.search(message, _error(capsys))
    assert not (tmp_path / "repo").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.skipif(HAS_TENSORRT, reason="tensorrt is importable: the engine's I/O is read from it")
def test_engine_without_tensorrt_asks_for_onnx_or_io(tmp_path, engine_files, capsys):
    engine, plugin = engine_files
    assert cli.main(["triton", "--engine", str(engine), "--plugin", str(plugin), "-o", str(tmp_path / "repo")]) == 2
    assert "needs TensorRT" in _error(capsys)
    assert not (tmp_path / "repo").exists()


def test_engine_repository_from_onnx_io_reports_its_source(tmp_path, engine_files, projection_model, capsys):
    engine, plugin = engine_files
    onnx_path, weight = projection_model()
    repo = tmp_path / "repo"
    assert cli.main(["triton", "--engine", str(engine), "--plugin", str(plugin), "--onnx", str(onnx_path),
                     "-o", str(repo), "--max-batch-size", "32", "--instances", "3", "--cuda-graphs",
                     "--report", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and report["io_source"] == "onnx" and "not read from the engine" in report["note"]
    assert report["model"] == "smol" and "smol/plugins/libflashnorm_plugin.so" in report["files"]
    config = parse_model_config((repo / "smol/config.pbtxt").read_text())
    assert [list(t.dims) for t in config.input] == [[weight.shape[0]], []]
    assert config.max_batch_size == 32 and config.instance_group[0].count == 3 and config.optimization.cuda.graphs


def test_existing_repository_needs_force(tmp_path, projection_model, capsys):
    onnx_path, _ = projection_model()
    argv = ["triton", "--onnx", str(onnx_path), "--triton-backend", "python", "-o", str(tmp_path / "repo"), "-q"]
    assert cli.main(argv) == 0
    before = (tmp_path / "repo/projection/config.pbtxt").read_text()
    assert cli.main([*argv, "--max-batch-size", "2"]) == 2
    assert "not empty" in _error(capsys)
    assert (tmp_path / "repo/projection/config.pbtxt").read_text() == before
    assert cli.main([*argv, "--max-batch-size", "2", "--force"]) == 0
    assert parse_model_config((tmp_path / "repo/projection/config.pbtxt").read_text()).max_batch_size == 2


def test_engine_repository_checks_the_build_profile_and_says_what_the_config_cannot(tmp_path, engine_files, capsys):
    engine, plugin = engine_files
    repo = tmp_path / "repo"
    assert cli.main(["triton", "--engine", str(engine), "--plugin", str(plugin), "-o", str(repo),
                     "--io", "in:input_ids:int64:-1,-1", "--io", "in:attention_mask:int64:-1,-1",
                     "--io", "out:logits:fp16:-1,-1,49152", "--max-batch-size", "4",
                     "--shapes", "input_ids:1x1,2x64,4x512", "attention_mask:1x1,2x64,4x512", "--report", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["profile"] == {"input_ids": "1x1,2x64,4x512", "attention_mask": "1x1,2x64,4x512"}
    assert report["unchecked_by_config"] == [
        "input_ids dimension 1: 1..512 (the config says -1)",
        "attention_mask dimension 1: 1..512 (the config says -1)",
        "token ids in [0, vocabulary): a config states types and shapes, never values",
        "lengths that must agree between inputs (attention_mask as long as past + input_ids)",
    ]
    readme = (repo / "README.md").read_text()
    assert all(f"- {item}" in readme for item in report["unchecked_by_config"])
    config = parse_model_config((repo / "smol/config.pbtxt").read_text())
    assert [list(t.dims) for t in config.input] == [[-1], [-1]] and config.max_batch_size == 4


def test_engine_repository_without_a_profile_says_it_is_unchecked(tmp_path, engine_files, projection_model, capsys):
    engine, plugin = engine_files
    onnx_path, _ = projection_model()
    assert cli.main(["triton", "--engine", str(engine), "--plugin", str(plugin), "--onnx", str(onnx_path),
                     "-o", str(tmp_path / "repo"), "--report", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["profile"] == {}
    assert [item.split(" (")[0] for item in report["unchecked_by_config"]] == ["the engine's optimization profile",
                                                                             "finite values of x"]
