"""The Python-backend model's request check (flashnorm/serve/onnxruntime_model.py), without a
server: what a token model refuses before ONNX Runtime runs, and the one-line reason. The
module is loaded with a stand-in for Triton's `triton_python_backend_utils`, which exists only
inside the server's stub."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import flashnorm.serve

MODEL = Path(flashnorm.serve.__file__).parent / "onnxruntime_model.py"
VOCAB = 100


@pytest.fixture(scope="module")
def served_model():
    stub = types.ModuleType("triton_python_backend_utils")
    sys.modules.setdefault("triton_python_backend_utils", stub)
    spec = importlib.util.spec_from_file_location("flashnorm_served_model", MODEL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def request_error(served_model):
    return served_model.request_error


def _feed(batch=2, sequence=5, past=0, layers=2):
    ids = np.arange(batch * sequence, dtype=np.int64).reshape(batch, sequence) % VOCAB
    feed = {"input_ids": ids, "attention_mask": np.ones((batch, past + sequence), np.int64),
            "position_ids": np.tile(np.arange(past, past + sequence), (batch, 1))}
    for layer in range(layers):
        for kind in ("key", "value"):
            feed[f"past_key_values.{layer}.{kind}"] = np.zeros((batch, 3, past, 8), np.float16)
    return feed


def test_good_requests_pass(request_error):
    assert request_error(_feed(), VOCAB) is None
    assert request_error(_feed(past=4), VOCAB) is None
    assert request_error({"x": np.zeros((2, 3), np.float32)}, VOCAB) is None  # not a token model


@pytest.mark.parametrize("bad", [-1, VOCAB, 10 * VOCAB])
def test_token_id_outside_the_vocabulary(request_error, bad):
    feed = _feed()
    feed["input_ids"][1, 3] = bad
    assert request_error(feed, VOCAB) == f"input_ids: token id {bad} is outside the vocabulary [0, {VOCAB})"


def test_negative_id_refused_without_a_known_vocabulary(request_error):
    feed = _feed()
    feed["input_ids"][0, 0] = -5
    assert "token id -5" in request_error(feed, None)


@pytest.mark.parametrize("change,expected", [
    (lambda f: f.update(input_ids=f["input_ids"].astype(np.float32)), "input_ids must be integers"),
    (lambda f: f.update(input_ids=f["input_ids"][:, :0]), "at least one token"),
    (lambda f: f.update(input_ids=f["input_ids"][0]), "input_ids must be [batch, sequence]"),
    (lambda f: f.update(attention_mask=f["attention_mask"][:, :-1]), "attention_mask must be [batch, past + sequence]"),
    (lambda f: f.update(position_ids=f["position_ids"][:1]), "position_ids must have input_ids' shape"),
    (lambda f: f["position_ids"].__setitem__((0, 0), -2), "negative position -2"),
    (lambda f: f["attention_mask"].__setitem__((1, 2), 2), "attention_mask: value 2 is not 0 or 1"),
    (lambda f: f["attention_mask"].__setitem__((0, 0), -1), "attention_mask: value -1 is not 0 or 1"),
    (lambda f: f.update({"past_key_values.1.value": np.zeros((2, 3, 2, 8), np.float16)}), "holds 2 past tokens"),
    (lambda f: f.update({"past_key_values.0.key": np.zeros((1, 3, 0, 8), np.float16)}), "must be [batch=2"),
])
def test_malformed_requests_name_the_problem(request_error, change, expected):
    feed = _feed()
    change(feed)
    error = request_error(feed, VOCAB)
    assert error is not None and expected in error and "\n" not in error


def test_shapes_outside_the_engine_profile(served_model):
    ranges = {"input_ids": [[1, 1], [4, 16]]}
    assert served_model.range_error(_feed(batch=4, sequence=16), ranges) is None
    assert served_model.range_error(_feed(batch=2, sequence=17), ranges) == (
        "input_ids has shape [2, 17], outside the engine's profile [1, 1]..[4, 16]")
    assert "shape [5, 3]" in served_model.range_error(_feed(batch=5, sequence=3), ranges)


def test_the_checked_prefix_is_the_repository_writer_s(served_model):
    from flashnorm.serve.repository import CHECKED_PREFIX

    assert served_model.CHECKED_PREFIX == CHECKED_PREFIX
