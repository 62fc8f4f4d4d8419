"""ONNX Runtime sessions and runner factories: clear one-line errors for bad requests."""

from __future__ import annotations

import pytest

from flashnorm.errors import FlashNormError
from flashnorm.validate import make_session, onnxrt_runner_factory


def test_unknown_provider_names_what_exists(tiny_llama_onnx):
    with pytest.raises(FlashNormError, match=r"NoSuchExecutionProvider.*available: \[.*CPUExecutionProvider"):
        make_session(tiny_llama_onnx, providers=("NoSuchExecutionProvider",))


def test_unknown_optimization_level(tiny_llama_onnx):
    with pytest.raises(FlashNormError, match="optimization level"):
        make_session(tiny_llama_onnx, optimization_level="max")


def test_unloadable_model_is_one_line(tmp_path):
    path = tmp_path / "broken.onnx"
    path.write_bytes(b"definitely not protobuf")
    with pytest.raises(FlashNormError) as caught:
        make_session(path)
    assert "\n" not in str(caught.value) and str(path) in str(caught.value)


def test_factory_builds_a_named_polygraphy_runner(tiny_llama_onnx, rng):
    from flashnorm.validate import language_model_feeds, random_token_ids, read_signature

    runner = onnxrt_runner_factory(optimization_level="basic")(str(tiny_llama_onnx), "probe")
    assert runner.name == "probe"
    feeds = language_model_feeds(read_signature(tiny_llama_onnx), random_token_ids(128, 1, 4, rng))
    with runner:
        outputs = runner.infer(feeds)
    assert list(outputs.keys()) == ["logits"] and outputs["logits"].shape == (1, 4, 128)


def test_a_data_file_replaced_while_onnx_runtime_reads_it_is_refused(tmp_path, monkeypatch, rng):
    # ONNX Runtime opens the model and its data by name; a writer replacing the data meanwhile
    # would give a session of the old graph with the new weights.
    import os

    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import helper, numpy_helper

    weight = numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), "W")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 64])], [weight])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path),
              save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    assert make_session(path).run(None, {"x": np.ones((1, 64), np.float32)})[0].shape == (1, 64)

    real = ort.InferenceSession

    def replacing_the_data_first(*args, **kwargs):
        data = tmp_path / "m.onnx.data"
        fresh = tmp_path / "fresh.data"
        fresh.write_bytes(os.urandom(data.stat().st_size))
        os.replace(fresh, data)
        return real(*args, **kwargs)

    monkeypatch.setattr(ort, "InferenceSession", replacing_the_data_first)
    with pytest.raises(FlashNormError, match=r"external data file .*m\.onnx\.data changed while flashnorm was reading it"):
        make_session(path)
