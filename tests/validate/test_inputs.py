"""Inputs for language-model graphs: signature reading, feeds, token-id parsing."""

from __future__ import annotations

import numpy as np
import pytest

from flashnorm.errors import FlashNormError
from flashnorm.validate import (
    language_model_feeds, make_session, parse_input_ids, prefill_past, random_token_ids, read_signature,
)
from models import cache


def test_signature_of_an_exported_model(tiny_llama_onnx):
    signature = read_signature(tiny_llama_onnx)
    assert signature.input_names == ["input_ids", "attention_mask", "position_ids"]
    assert signature.vocab_size == cache.TINY_LLAMA["vocab_size"]
    assert signature.past_inputs == []
    assert signature.metadata["flashnorm.exporter"] == "legacy"


def test_feeds_without_cache(tiny_llama_onnx, rng):
    ids = random_token_ids(128, 3, 7, rng)
    assert ids.min() >= 0 and ids.max() < 128 and ids.shape == (3, 7)
    feeds = language_model_feeds(read_signature(tiny_llama_onnx), ids)
    assert feeds["attention_mask"].shape == (3, 7) and feeds["attention_mask"].all()
    np.testing.assert_array_equal(feeds["position_ids"], np.tile(np.arange(7), (3, 1)))


def test_feeds_with_past(session_tmp, rng):
    signature = read_signature(cache.tiny_llama_export(session_tmp, kv_cache=True))
    feeds = language_model_feeds(signature, random_token_ids(128, 2, 3, rng), past_length=5, rng=rng)
    assert feeds["attention_mask"].shape == (2, 8)
    np.testing.assert_array_equal(feeds["position_ids"][0], [5, 6, 7])
    assert feeds["past_key_values.1.value"].shape == (2, 2, 5, 16)
    assert np.abs(feeds["past_key_values.0.key"]).max() > 0


def test_prefilled_past_continues_the_prefix(session_tmp, rng):
    """Prefix then continuation through the cache = the whole sequence at once."""
    path = cache.tiny_llama_export(session_tmp, kv_cache=True)
    session, signature = make_session(path), read_signature(path)
    prefix, continuation = random_token_ids(128, 2, 6, rng), random_token_ids(128, 2, 3, rng)
    past = prefill_past(session, prefix)
    assert past["past_key_values.0.key"].shape == (2, 2, 6, 16)
    feeds = language_model_feeds(signature, continuation, past=past)
    np.testing.assert_array_equal(feeds["position_ids"][1], [6, 7, 8])
    stepped = session.run(["logits"], feeds)[0]
    empty = {spec.name: np.zeros((2, 2, 0, 16), np.float32) for spec in signature.past_inputs}
    whole = language_model_feeds(signature, np.concatenate([prefix, continuation], axis=1), past=empty)
    at_once = session.run(["logits"], whole)[0][:, 6:]
    assert np.abs(stepped - at_once).max() / np.abs(at_once).max() < 1e-5


def test_out_of_vocabulary_ids_are_refused(tiny_llama_onnx):
    with pytest.raises(FlashNormError, match=r"\[0, 128\)"):
        language_model_feeds(read_signature(tiny_llama_onnx), np.array([[1, 128]]))


def test_past_length_needs_a_cache(tiny_llama_onnx, rng):
    with pytest.raises(FlashNormError, match="no KV-cache"):
        language_model_feeds(read_signature(tiny_llama_onnx), random_token_ids(128, 1, 2, rng), past_length=3)


def test_parse_input_ids():
    np.testing.assert_array_equal(parse_input_ids("1, 2 3"), [[1, 2, 3]])
    with pytest.raises(FlashNormError, match="integers"):
        parse_input_ids("1,x")
    with pytest.raises(FlashNormError, match="empty"):
        parse_input_ids(" , ")


def test_signature_of_a_missing_or_bad_file(tmp_path):
    with pytest.raises(FlashNormError, match="does not exist"):
        read_signature(tmp_path / "none.onnx")
    (tmp_path / "bad.onnx").write_bytes(b"\x00not a model\xff" * 10)
    with pytest.raises(FlashNormError, match="not an ONNX model"):
        read_signature(tmp_path / "bad.onnx")
