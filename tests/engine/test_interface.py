"""flashnorm.engine.read_interface: an engine's I/O tensors and profile 0, read through the few
TensorRT runtime calls it makes (a stand-in answers them from a table; TensorRT is not
installed where these tests run)."""

from __future__ import annotations

import ctypes
import sys
import types

import pytest

from flashnorm.engine import EngineTensor, ShapeRange, TensorRTMissing, read_interface
from flashnorm.errors import FlashNormError


def _fake_tensorrt(bindings, plan: bytes, events: list) -> types.ModuleType:
    """`bindings`: (name, "INPUT" | "OUTPUT", dtype name, shape, profile 0's (min, opt, max) or None)."""
    by_name = {binding[0]: binding for binding in bindings}

    class Engine:
        num_io_tensors = len(bindings)
        num_optimization_profiles = 1

        def get_tensor_name(self, index):
            return bindings[index][0]

        def get_tensor_mode(self, name):
            return by_name[name][1]

        def get_tensor_dtype(self, name):
            return types.SimpleNamespace(name=by_name[name][2])

        def get_tensor_shape(self, name):
            return list(by_name[name][3])

        def get_tensor_profile_shape(self, name, profile):
            assert profile == 0 and by_name[name][4] is not None, name
            return [list(shape) for shape in by_name[name][4]]

    class Runtime:
        def __init__(self, logger):
            pass

        def deserialize_cuda_engine(self, data):
            events.append("deserialize")
            return Engine() if data == plan else None

    class Logger:
        ERROR = 0

        def __init__(self, level):
            pass

    trt = types.ModuleType("tensorrt")
    trt.Logger, trt.Runtime = Logger, Runtime
    trt.TensorIOMode = types.SimpleNamespace(INPUT="INPUT", OUTPUT="OUTPUT")
    return trt


def test_reads_tensors_in_engine_order_and_profile_zero_of_dynamic_inputs(tmp_path, monkeypatch, rng):
    width = int(rng.integers(64, 4096))
    ids_range = ((1, 1), (1, 64), (4, 512))
    bindings = [
        ("input_ids", "INPUT", "INT64", (-1, -1), ids_range),
        ("logits", "OUTPUT", "HALF", (-1, -1, width), None),
        ("scale", "INPUT", "FLOAT", (1, width), None),
    ]
    plan, events = rng.bytes(32), []
    (tmp_path / "m.plan").write_bytes(plan)
    monkeypatch.setitem(sys.modules, "tensorrt", _fake_tensorrt(bindings, plan, events))
    monkeypatch.setattr(ctypes, "CDLL", lambda path, mode=0: events.append(("dlopen", path, mode)))

    interface = read_interface(tmp_path / "m.plan", [tmp_path / "libflashnorm_plugin.so"])

    assert events == [("dlopen", str(tmp_path / "libflashnorm_plugin.so"), ctypes.RTLD_GLOBAL), "deserialize"]
    assert interface.tensors == (EngineTensor("input_ids", "INT64", (-1, -1), True),
                                 EngineTensor("logits", "HALF", (-1, -1, width), False),
                                 EngineTensor("scale", "FLOAT", (1, width), True))
    assert [t.name for t in interface.inputs] == ["input_ids", "scale"]
    assert [t.name for t in interface.outputs] == ["logits"]
    assert interface.profile == {"input_ids": ShapeRange(*ids_range)}


def test_an_engine_the_runtime_refuses_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "m.plan").write_bytes(b"corrupt")
    monkeypatch.setitem(sys.modules, "tensorrt", _fake_tensorrt([], b"valid", []))
    with pytest.raises(FlashNormError, match="could not deserialize .*m.plan"):
        read_interface(tmp_path / "m.plan")


def test_without_tensorrt_says_so(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # `import tensorrt` raises ImportError
    with pytest.raises(TensorRTMissing, match="needs TensorRT"):
        read_interface(tmp_path / "m.plan")
