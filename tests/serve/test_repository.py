"""Model repositories on disk: layout, README start command, atomic replacement, bad input."""

from __future__ import annotations

import shlex
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tritonclient.grpc", reason="needs tritonclient[grpc] (flashnorm[serve])")

from tritonclient.grpc import model_config_pb2  # noqa: E402

from flashnorm.errors import FlashNormError  # noqa: E402
from flashnorm.serve.config import parse_model_config  # noqa: E402
from flashnorm.serve.repository import (  # noqa: E402
    write_engine_repository,
    write_onnx_python_repository,
)
from flashnorm.serve.tensors import signature_from_io_specs, signature_from_onnx  # noqa: E402


@pytest.fixture
def engine_files(tmp_path, rng):
    """An engine and a plugin library with random bytes: the writer copies them, never reads them."""
    engine, plugin = tmp_path / "model.plan", tmp_path / "libflashnorm_plugin.so"
    engine.write_bytes(rng.bytes(int(rng.integers(100, 5000))))
    plugin.write_bytes(rng.bytes(int(rng.integers(100, 5000))))
    return engine, plugin


def _signature():
    return signature_from_io_specs(["in:input_ids:int32:-1,-1", "out:logits:fp16:-1,-1,576"])


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def test_engine_repository_layout_config_and_readme_command(tmp_path, engine_files):
    engine, plugin = engine_files
    result = write_engine_repository(engine, plugin, _signature(), tmp_path / "repo", name="smol",
                                     max_batch_size=16, instances=2, cuda_graphs=True)
    repo = tmp_path / "repo"
    assert result.files == ["README.md", "smol/1/model.plan", "smol/config.pbtxt",
                            "smol/plugins/libflashnorm_plugin.so"]
    assert (repo / "smol/1/model.plan").read_bytes() == engine.read_bytes()
    assert (repo / "smol/plugins/libflashnorm_plugin.so").read_bytes() == plugin.read_bytes()
    config = parse_model_config((repo / "smol/config.pbtxt").read_text())
    assert config.platform == "tensorrt_plan" and config.max_batch_size == 16
    assert [list(t.dims) for t in config.input] == [[-1]] and [list(t.dims) for t in config.output] == [[-1, 576]]
    assert config.input[0].data_type == model_config_pb2.TYPE_INT32
    assert config.HasField("dynamic_batching") and config.optimization.cuda.graphs
    assert [(g.count, g.kind) for g in config.instance_group] == [(2, model_config_pb2.ModelInstanceGroup.KIND_GPU)]

    readme = (repo / "README.md").read_text()
    commands = [line for line in readme.splitlines() if "tritonserver " in line]
    assert len(commands) == 2, readme
    backend_config, preload = (shlex.split(line) for line in commands)
    assert backend_config[0] == "tritonserver"
    flags = dict(arg.split("=", 1) for arg in backend_config[1:])
    assert Path(flags["--model-repository"]) == repo
    backend, plugins = flags["--backend-config"].split(",", 1)
    assert backend == "tensorrt" and plugins.startswith("plugins=")
    plugin_path = Path(plugins.removeprefix("plugins="))
    assert plugin_path.is_file() and plugin_path.is_relative_to(repo)
    # The plugin must not be a top-level folder of the repository: Triton would load it as a model.
    assert plugin_path.parent.parent.parent == repo
    assert preload[0] == f"LD_PRELOAD={plugin_path}" and preload[1:] == ["tritonserver", f"--model-repository={repo}"]
    assert result.start_command == commands[0]


def test_python_repository_copies_model_external_data_and_server_code(tmp_path, projection_model):
    onnx_path, _ = projection_model(external_data=True)
    signature = signature_from_onnx(onnx_path).select_outputs(["y"])
    result = write_onnx_python_repository(onnx_path, signature, tmp_path / "repo", name="proj", intra_op_threads=1)
    version = tmp_path / "repo/proj/1"
    assert result.files == ["README.md", "proj/1/model.onnx", "proj/1/model.py",
                            "proj/1/projection.onnx.weights", "proj/config.pbtxt"]
    assert (version / "projection.onnx.weights").read_bytes() == (onnx_path.parent / "projection.onnx.weights").read_bytes()
    assert "triton_python_backend_utils" in (version / "model.py").read_text()
    config = parse_model_config((tmp_path / "repo/proj/config.pbtxt").read_text())
    assert config.backend == "python" and [t.name for t in config.output] == ["y"]
    assert config.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_CPU
    assert config.parameters["intra_op_num_threads"].string_value == "1"


def test_copied_onnx_runs_the_same(tmp_path, projection_model, rng):
    import onnxruntime as ort

    onnx_path, weight = projection_model(external_data=True)
    write_onnx_python_repository(onnx_path, signature_from_onnx(onnx_path), tmp_path / "repo", name="p")
    x = rng.standard_normal((3, weight.shape[0])).astype(np.float32)
    ids = rng.integers(0, 100, 3)
    session = ort.InferenceSession(str(tmp_path / "repo/p/1/model.onnx"), providers=["CPUExecutionProvider"])
    y, _ = session.run(None, {"x": x, "ids": ids})
    np.testing.assert_allclose(y, x.astype(np.float64) @ weight, rtol=1e-5, atol=1e-5)


def test_non_empty_output_needs_force_and_force_replaces(tmp_path, engine_files):
    engine, plugin = engine_files
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "keep.txt").write_text("user data")
    with pytest.raises(FlashNormError, match="not empty.*--force"):
        write_engine_repository(engine, plugin, _signature(), repo)
    with pytest.raises(FlashNormError, match="not written by flashnorm"):
        write_engine_repository(engine, plugin, _signature(), repo, force=True)
    assert sorted(p.name for p in repo.iterdir()) == ["keep.txt"]
    (repo / "keep.txt").unlink()
    write_engine_repository(engine, plugin, _signature(), repo, name="old")
    write_engine_repository(engine, plugin, _signature(), repo, name="m", force=True)
    assert not (repo / "old").exists() and (repo / "m/config.pbtxt").is_file()
    assert _leftovers(tmp_path) == []


def test_empty_existing_output_is_used(tmp_path, engine_files):
    (tmp_path / "repo").mkdir()
    write_engine_repository(*engine_files, _signature(), tmp_path / "repo", name="m")
    assert (tmp_path / "repo/m/1/model.plan").is_file()


def test_failures_leave_nothing_behind(tmp_path, engine_files, projection_model):
    engine, plugin = engine_files
    with pytest.raises(FlashNormError, match="engine .* does not exist"):
        write_engine_repository(tmp_path / "absent.plan", plugin, _signature(), tmp_path / "repo")
    with pytest.raises(FlashNormError, match="plugin library .* does not exist"):
        write_engine_repository(engine, tmp_path / "absent.so", _signature(), tmp_path / "repo")
    with pytest.raises(FlashNormError, match="batching"):
        write_engine_repository(engine, plugin, signature_from_io_specs(["in:x:fp32:1,4", "out:y:fp32:1,4"]),
                                tmp_path / "repo")
    with pytest.raises(FlashNormError, match="model name"):
        write_engine_repository(engine, plugin, _signature(), tmp_path / "repo", name="../escape")
    # External data that vanished after the signature was read: the copy fails half-way.
    onnx_path, _ = projection_model(external_data=True)
    signature = signature_from_onnx(onnx_path)
    (onnx_path.parent / "projection.onnx.weights").unlink()
    with pytest.raises(FlashNormError, match="external data file"):
        write_onnx_python_repository(onnx_path, signature, tmp_path / "repo")
    assert not (tmp_path / "repo").exists()
    assert _leftovers(tmp_path) == []


def test_bf16_tensors_are_refused_for_the_python_backend(tmp_path, projection_model):
    onnx_path, _ = projection_model()
    with pytest.raises(FlashNormError, match="bf16"):
        write_onnx_python_repository(onnx_path, signature_from_io_specs(["in:x:bf16:-1,6", "out:y:fp32:-1,5"]),
                                     tmp_path / "repo")


def test_engine_repository_with_request_checks_is_an_ensemble(tmp_path, engine_files, rng):
    import dataclasses
    import json

    from flashnorm.engine.shapes import parse_shape_specs

    engine, plugin = engine_files
    vocab, longest = int(rng.integers(100, 60000)), int(rng.integers(2, 1025))
    typical = int(rng.integers(1, longest + 1))  # a profile's opt lies within [min, max]
    signature = dataclasses.replace(
        signature_from_io_specs(["in:input_ids:int64:-1,-1", "in:attention_mask:int64:-1,-1",
                                 f"out:logits:fp16:-1,-1,{vocab}"]),
        profile=parse_shape_specs([f"input_ids:1x1,2x{typical},4x{longest}",
                                   f"attention_mask:1x1,2x{typical},4x{longest}"]),
    )
    result = write_engine_repository(engine, plugin, signature, tmp_path / "repo", name="smol", max_batch_size=4,
                                     check_requests=True)
    repo = tmp_path / "repo"
    assert result.files == ["README.md", "smol/config.pbtxt", "smol_checks/1/model.py", "smol_checks/config.pbtxt",
                            "smol_engine/1/model.plan", "smol_engine/config.pbtxt",
                            "smol_engine/plugins/libflashnorm_plugin.so"]
    assert (repo / "smol/1").is_dir() and result.unchecked_by_config == []
    ensemble = parse_model_config((repo / "smol/config.pbtxt").read_text())
    assert ensemble.platform == "ensemble" and ensemble.max_batch_size == 4 and not ensemble.instance_group
    assert not ensemble.HasField("dynamic_batching")
    steps = ensemble.ensemble_scheduling.step
    assert [(step.model_name, dict(step.input_map), dict(step.output_map)) for step in steps] == [
        ("smol_checks", {"input_ids": "input_ids", "attention_mask": "attention_mask"},
         {"checked_input_ids": "checked_input_ids", "checked_attention_mask": "checked_attention_mask"}),
        ("smol_engine", {"input_ids": "checked_input_ids", "attention_mask": "checked_attention_mask"},
         {"logits": "logits"}),
    ]
    checks = parse_model_config((repo / "smol_checks/config.pbtxt").read_text())
    assert checks.backend == "python" and checks.parameters["role"].string_value == "check"
    assert checks.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_CPU
    assert int(checks.parameters["vocabulary"].string_value) == vocab
    assert json.loads(checks.parameters["input_ranges"].string_value) == {
        "input_ids": [[1, 1], [4, longest]], "attention_mask": [[1, 1], [4, longest]]}
    assert [(t.name, t.data_type) for t in checks.output] == [
        ("checked_input_ids", model_config_pb2.TYPE_INT64), ("checked_attention_mask", model_config_pb2.TYPE_INT64)]
    assert parse_model_config((repo / "smol_engine/config.pbtxt").read_text()).platform == "tensorrt_plan"
    readme = (repo / "README.md").read_text()
    assert "smol_engine/plugins/libflashnorm_plugin.so" in result.start_command and "`smol_checks`" in readme
