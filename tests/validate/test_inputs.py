"""Inputs: signature reading, language-model feeds, token-id parsing, and seeded random
tensors for any other graph (shape resolution, dtypes, value ranges)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from flashnorm.errors import FlashNormError
from flashnorm.validate import (
    language_model_feeds, make_session, parse_input_ids, prefill_past, random_token_ids, read_signature,
)
from flashnorm.validate.inputs import (
    DEFAULT_DYNAMIC_DIM, DEFAULT_INT_RANGE, DEFAULT_LEADING_DIM, TensorSpec, describe_random_feeds,
    parse_input_shapes, parse_value_ranges, random_feeds, resolve_input_shapes,
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


# ── any other graph ────────────────────────────────────────────────────────────────────────

def _identity_model(path, inputs: list[onnx.ValueInfoProto]) -> str:
    """Every input copied to an output: a graph whose signature is exactly `inputs`."""
    nodes = [helper.make_node("Identity", [v.name], [f"{v.name}_out"]) for v in inputs]
    outputs = [helper.make_value_info(f"{v.name}_out", v.type) for v in inputs]
    model = helper.make_model(helper.make_graph(nodes, "identity", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(path))
    return str(path)


def test_signature_of_a_generic_model(tmp_path):
    path = _identity_model(tmp_path / "m.onnx", [
        helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["batch", None, 8]),
        helper.make_tensor_value_info("codes", TensorProto.UINT8, [4]),
        helper.make_tensor_value_info("h", TensorProto.BFLOAT16, [2]),
        helper.make_tensor_value_info("free", TensorProto.FLOAT, None),
    ])
    x, codes, h, free = read_signature(path).inputs
    assert (x.dtype, x.shape, x.has_shape) == (np.float16, ("batch", None, 8), True)
    assert codes.dtype == np.uint8 and h.dtype == ml_dtypes.bfloat16
    assert free.shape == () and not free.has_shape


def test_default_sizes_of_dynamic_axes():
    inputs = [TensorSpec("x", np.float32, ("batch", None, 32)), TensorSpec("lengths", np.int64, ("n",)),
              TensorSpec("scale", np.float32, ())]
    shapes = resolve_input_shapes(inputs)
    assert shapes == {"x": (DEFAULT_LEADING_DIM, DEFAULT_DYNAMIC_DIM, 32), "lengths": (DEFAULT_DYNAMIC_DIM,),
                      "scale": ()}


def test_a_given_shape_sizes_the_axes_other_inputs_share():
    inputs = [TensorSpec("x", np.float32, ("batch", "seq", 32)), TensorSpec("skip", np.float32, ("batch", "seq", 32)),
              TensorSpec("mask", np.bool_, ("batch", None))]
    shapes = resolve_input_shapes(inputs, parse_input_shapes(["skip:3x7x32"]))
    assert shapes == {"x": (3, 7, 32), "skip": (3, 7, 32), "mask": (3, DEFAULT_DYNAMIC_DIM)}
    # An axis first met in an input without a given shape takes the default, then is shared.
    shapes = resolve_input_shapes(inputs[:2])
    assert shapes["x"] == shapes["skip"] == (DEFAULT_LEADING_DIM, DEFAULT_DYNAMIC_DIM, 32)


@pytest.mark.parametrize("given, message", [
    (["x:2x5"], "x: [2, 5] has rank 2, but x is declared [batch, seq, 32]"),
    (["x:2x5x31"], "does not fit the declared [batch, seq, 32]"),
    (["x:2x5x32", "skip:3x5x32"], "axis 'batch' is 2 in x but 3 in skip"),
    (["y:2x5x32"], "--input-shapes names ['y'], not inputs of the model; inputs: ['x', 'skip']"),
    (["free:4"], "input(s) ['free'] declare no shape, not even a rank, so they cannot be fed"),
])
def test_shapes_that_cannot_be_resolved(given, message):
    inputs = [TensorSpec("x", np.float32, ("batch", "seq", 32)), TensorSpec("skip", np.float32, ("batch", "seq", 32)),
              TensorSpec("free", np.float32, (), has_shape=False)]
    if "free" not in given[0]:
        inputs = inputs[:2]
    with pytest.raises(FlashNormError) as error:
        resolve_input_shapes(inputs, parse_input_shapes(given))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_parse_input_shapes():
    assert parse_input_shapes(["a:b:1x2", "s:"]) == {"a:b": (1, 2), "s": ()}
    for bad, message in (("x", "NAME:D1xD2"), ("x:1xq", "integers joined by 'x'"), ("x:1x-2", "negative")):
        with pytest.raises(FlashNormError, match=message):
            parse_input_shapes([bad])
    with pytest.raises(FlashNormError, match="twice"):
        parse_input_shapes(["x:1", "x:2"])


def test_parse_value_ranges():
    assert parse_value_ranges(["ids:0,100", "[-1.5,2]"]) == {"ids": (0, 100), None: (-1.5, 2)}
    for bad, message in (("ids:0", "NAME:LO,HI"), ("ids:a,b", "NAME:LO,HI"), ("ids:5,5", "LO < HI"),
                         ("ids:0,inf", "finite")):
        with pytest.raises(FlashNormError, match=message):
            parse_value_ranges([bad])


def test_random_feeds_follow_dtypes_and_shapes(rng):
    inputs = [TensorSpec("x", np.float32, ("batch", "seq", 64)), TensorSpec("h", np.float16, (64, 32)),
              TensorSpec("ids", np.int64, ("batch", "seq")), TensorSpec("codes", np.uint8, (256,)),
              TensorSpec("mask", np.bool_, (512,))]
    shapes = resolve_input_shapes(inputs, {"x": (8, 64, 64)})
    feeds = random_feeds(inputs, shapes, rng, parse_value_ranges(["codes:200,256"]))
    assert {name: (value.dtype, value.shape) for name, value in feeds.items()} == {
        "x": (np.float32, (8, 64, 64)), "h": (np.float16, (64, 32)), "ids": (np.int64, (8, 64)),
        "codes": (np.uint8, (256,)), "mask": (np.bool_, (512,)),
    }
    x = feeds["x"].astype(np.float64)
    assert np.all(x != 0) and abs(x.mean()) < 0.03 and abs(x.std() - 1) < 0.03  # 32768 samples of N(0, 1)
    assert np.all(feeds["h"] != 0) and 0.9 < feeds["h"].astype(np.float64).std() < 1.1
    low, high = DEFAULT_INT_RANGE
    assert feeds["ids"].min() >= low and feeds["ids"].max() < high and len(np.unique(feeds["ids"])) == high - low
    assert feeds["codes"].min() >= 200 and feeds["codes"].max() <= 255 and len(np.unique(feeds["codes"])) > 40
    assert 150 < feeds["mask"].sum() < 362


def test_random_feeds_are_seeded(rng):
    inputs = [TensorSpec("x", np.float32, (3, 5)), TensorSpec("ids", np.int32, (7,))]
    shapes = resolve_input_shapes(inputs)
    seed = int(rng.integers(2**31))
    first = random_feeds(inputs, shapes, np.random.default_rng(seed))
    again = random_feeds(inputs, shapes, np.random.default_rng(seed))
    other = random_feeds(inputs, shapes, np.random.default_rng(seed + 1))
    for name in first:
        np.testing.assert_array_equal(first[name], again[name])
    assert not np.array_equal(first["x"], other["x"])


def test_bfloat16_feeds_are_rounded_normals(rng):
    inputs = [TensorSpec("h", ml_dtypes.bfloat16, (2048,))]
    seed = int(rng.integers(2**31))
    h = random_feeds(inputs, resolve_input_shapes(inputs), np.random.default_rng(seed))["h"]
    expected = np.random.default_rng(seed).standard_normal(2048)
    assert h.dtype == ml_dtypes.bfloat16 and np.all(h.astype(np.float64) != 0)
    # bfloat16 keeps 8 significant bits: every value within half an ulp (2^-8 relative) of the draw
    # (plus the float32 step ml_dtypes may round through).
    assert np.all(np.abs(h.astype(np.float64) - expected) <= np.abs(expected) * (2.0**-8 + 2.0**-24))


def test_value_ranges_for_floats_and_their_limits(rng):
    inputs = [TensorSpec("x", np.float32, (4096,)), TensorSpec("ids", np.int8, (16,)),
              TensorSpec("mask", np.bool_, (4,))]
    shapes = resolve_input_shapes(inputs)
    feeds = random_feeds(inputs, shapes, rng, parse_value_ranges(["x:2,3", "[-4,4]"]))
    assert feeds["x"].min() >= 2 and feeds["x"].max() <= 3 and abs(feeds["x"].mean() - 2.5) < 0.05
    assert feeds["ids"].min() >= -4 and feeds["ids"].max() < 4  # the unnamed range; mask keeps True/False
    described = describe_random_feeds(inputs, shapes, parse_value_ranges(["x:2,3", "[-4,4]"]))
    assert described == {"x": "float32 [4096] uniform in [2, 3)", "ids": "int8 [16] integers in [-4, 4)",
                         "mask": "bool [4] True/False"}
    for ranges, message in ((["ids:0,200"], "[0, 200) does not fit input ids (int8)"),
                            (["ids:0.5,3"], "must be integers"), (["mask:0,2"], "bool input takes no range"),
                            (["nope:0,2"], "names ['nope'], not inputs")):
        with pytest.raises(FlashNormError) as error:
            random_feeds(inputs, shapes, rng, parse_value_ranges(ranges))
        assert message in str(error.value)


def test_inputs_of_types_that_cannot_be_drawn(rng):
    inputs = [TensorSpec("names", np.dtype(object), (2,))]
    with pytest.raises(FlashNormError, match="input names has element type object"):
        random_feeds(inputs, resolve_input_shapes(inputs), rng)
