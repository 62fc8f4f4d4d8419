"""Reading a model's inputs and outputs for Triton: from ONNX, from --io strings; batch dims."""

from __future__ import annotations

import pytest

from flashnorm.errors import FlashNormError
from flashnorm.serve.tensors import (
    TritonTensor,
    parse_io_spec,
    signature_from_engine,
    signature_from_io_specs,
    signature_from_onnx,
)


def test_onnx_signature_has_types_variable_dims_and_no_initializers(projection_model, tmp_path, rng):
    k, n = int(rng.integers(2, 9)), int(rng.integers(2, 9))
    projection_model(k, n, name="m.onnx")
    signature = signature_from_onnx(tmp_path / "m.onnx")
    assert signature.source == "onnx"
    assert [(s.name, s.data_type, s.shape) for s in signature.inputs] == [
        ("x", "TYPE_FP32", (-1, k)), ("ids", "TYPE_INT64", (-1,))]
    assert [(s.name, s.data_type, s.shape) for s in signature.outputs] == [
        ("y", "TYPE_FP32", (-1, n)), ("ids_out", "TYPE_INT64", (-1,))]


def test_missing_or_broken_onnx_is_an_error(tmp_path):
    with pytest.raises(FlashNormError, match="does not exist"):
        signature_from_onnx(tmp_path / "absent.onnx")
    (tmp_path / "junk.onnx").write_bytes(b"\x08\x07 not a protobuf \xff\xff")
    with pytest.raises(FlashNormError, match="is not an ONNX model"):
        signature_from_onnx(tmp_path / "junk.onnx")


def test_select_outputs_keeps_order_and_rejects_unknown_names(projection_model, tmp_path):
    projection_model(name="m.onnx")
    signature = signature_from_onnx(tmp_path / "m.onnx")
    assert [s.name for s in signature.select_outputs(["ids_out", "y"]).outputs] == ["ids_out", "y"]
    with pytest.raises(FlashNormError, match=r"unknown output name\(s\) \['logits'\]; the model has \['ids_out', 'y'\]"):
        signature.select_outputs(["logits"])


def test_io_specs_parse_and_reject_bad_strings():
    signature = signature_from_io_specs(["in:input_ids:int64:-1,-1", "out:logits:fp16:-1,-1,49152"])
    assert signature.source == "io"
    assert signature.inputs == (TritonTensor("input_ids", "TYPE_INT64", (-1, -1), True),)
    assert signature.outputs == (TritonTensor("logits", "TYPE_FP16", (-1, -1, 49152), False),)
    for bad, message in [
        ("input_ids:int64:-1", "expected in|out"),
        ("in:x:complex64:-1", "unknown type"),
        ("in:x:fp32:-1,a", "comma-separated integers"),
        ("in:x:fp32:-1,0", "positive or -1"),
    ]:
        with pytest.raises(FlashNormError, match=message):
            parse_io_spec(bad)
    with pytest.raises(FlashNormError, match="at least one input"):
        signature_from_io_specs(["out:y:fp32:-1"])
    with pytest.raises(FlashNormError, match="more than once"):
        signature_from_io_specs(["in:x:fp32:-1", "out:x:fp32:-1"])


def test_triton_dims_drop_the_batch_dimension_only_when_batching():
    spec = TritonTensor("logits", "TYPE_FP32", (-1, -1, 576), False)
    assert spec.triton_dims(8) == (-1, 576)
    assert spec.triton_dims(0) == (-1, -1, 576)
    with pytest.raises(FlashNormError, match="--max-batch-size 0"):
        TritonTensor("x", "TYPE_FP32", (1, 576), True).triton_dims(4)


def test_engine_signature_without_tensorrt_names_the_alternatives(tmp_path):
    try:
        import tensorrt  # noqa: F401
        pytest.skip("tensorrt is importable here; the no-TensorRT message does not apply")
    except ImportError:
        pass
    (tmp_path / "m.plan").write_bytes(b"plan")
    with pytest.raises(FlashNormError, match="needs TensorRT.*--onnx MODEL.onnx.*--io"):
        signature_from_engine(tmp_path / "m.plan")


class _FakeTensorRT:
    """The few TensorRT runtime calls `signature_from_engine` makes, answering from a table.

    TensorRT is not installed where these tests run; this checks how engine bindings become
    Triton tensors (dtypes, -1 dims, input/output split, plugin loaded first), not TensorRT."""

    class Logger:
        ERROR = 0

        def __init__(self, level):
            pass

    class TensorIOMode:
        INPUT, OUTPUT = "INPUT", "OUTPUT"

    def __init__(self, bindings, events):
        fake = self

        class DType:
            def __init__(self, name):
                self.name = name

        class Engine:
            num_io_tensors = len(bindings)
            num_optimization_profiles = 1

            def get_tensor_profile_shape(self, name, profile):
                assert profile == 0 and next(b[1] for b in bindings if b[0] == name) == "INPUT"
                return [[1, 1], [1, 64], [4, 512]]

            def get_tensor_name(self, index):
                return bindings[index][0]

            def get_tensor_mode(self, name):
                return next(b[1] for b in bindings if b[0] == name)

            def get_tensor_dtype(self, name):
                return DType(next(b[2] for b in bindings if b[0] == name))

            def get_tensor_shape(self, name):
                return next(b[3] for b in bindings if b[0] == name)

        class Runtime:
            def __init__(self, logger):
                pass

            def deserialize_cuda_engine(self, data):
                events.append(("deserialize", data))
                return Engine() if data == fake.valid_plan else None

        self.Runtime = Runtime
        self.valid_plan = b""


def test_engine_bindings_become_triton_tensors_after_the_plugin_is_loaded(tmp_path, monkeypatch, rng):
    import ctypes
    import sys

    vocab = int(rng.integers(100, 60000))
    bindings = [
        ("input_ids", "INPUT", "INT32", [-1, -1]),
        ("logits", "OUTPUT", "HALF", [-1, -1, vocab]),
        ("attention_mask", "INPUT", "INT64", [-1, -1]),
    ]
    events = []
    fake = _FakeTensorRT(bindings, events)
    plan = tmp_path / "m.plan"
    fake.valid_plan = rng.bytes(64)
    plan.write_bytes(fake.valid_plan)
    monkeypatch.setitem(sys.modules, "tensorrt", fake)
    monkeypatch.setattr(ctypes, "CDLL", lambda path, mode=0: events.append(("dlopen", path, mode)))

    signature = signature_from_engine(plan, [tmp_path / "libflashnorm_plugin.so"])
    assert events[0] == ("dlopen", str(tmp_path / "libflashnorm_plugin.so"), ctypes.RTLD_GLOBAL)
    assert events[1][0] == "deserialize"
    assert signature.source == "tensorrt"
    assert signature.inputs == (TritonTensor("input_ids", "TYPE_INT32", (-1, -1), True),
                                TritonTensor("attention_mask", "TYPE_INT64", (-1, -1), True))
    assert signature.outputs == (TritonTensor("logits", "TYPE_FP16", (-1, -1, vocab), False),)
    assert {name: r.describe() for name, r in signature.profile.items()} == {
        "input_ids": "1x1,1x64,4x512", "attention_mask": "1x1,1x64,4x512"}

    plan.write_bytes(b"corrupt")
    with pytest.raises(FlashNormError, match="could not deserialize"):
        signature_from_engine(plan)
    bindings[1] = ("logits", "OUTPUT", "FP8", [-1, vocab])
    plan.write_bytes(fake.valid_plan)
    with pytest.raises(FlashNormError, match="FP8"):
        signature_from_engine(plan)
