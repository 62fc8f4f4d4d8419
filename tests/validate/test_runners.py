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
