"""What a tensorrt_plan config can state about an engine: TensorRT data types, the profile's
ranges against max_batch_size and the dims, profile-fixed dims written as numbers, and the
list of what the config cannot state. Configs are parsed with Triton's own ModelConfig."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("tritonclient.grpc", reason="needs tritonclient[grpc] (flashnorm[serve])")

from tritonclient.grpc import model_config_pb2  # noqa: E402

from flashnorm.engine.shapes import parse_shape_specs  # noqa: E402
from flashnorm.errors import FlashNormError  # noqa: E402
from flashnorm.serve.config import ModelConfigOptions, parse_model_config, validated_model_config  # noqa: E402
from flashnorm.serve.engine_profile import check_engine_signature  # noqa: E402
from flashnorm.serve.tensors import signature_from_io_specs  # noqa: E402


def _token_signature(vocab: int, logits_type: str = "fp16"):
    return signature_from_io_specs([
        "in:input_ids:int64:-1,-1", "in:attention_mask:int64:-1,-1", f"out:logits:{logits_type}:-1,-1,{vocab}",
    ])


def _profile(batch: tuple[int, int, int], sequence: tuple[int, int, int]):
    shapes = ",".join(f"{b}x{s}" for b, s in zip(batch, sequence))
    return parse_shape_specs([f"input_ids:{shapes}", f"attention_mask:{shapes}"])


def _config(checked, max_batch_size: int):
    options = ModelConfigOptions(name="m", platform="tensorrt_plan", max_batch_size=max_batch_size)
    return parse_model_config(validated_model_config(checked.signature, options))


def test_profile_covering_every_batch_passes_and_lists_the_ranges_the_config_cannot_state(rng):
    max_batch, longest = int(rng.integers(1, 33)), int(rng.integers(2, 4097))
    checked = check_engine_signature(
        _token_signature(49152), _profile((1, max_batch, max_batch + int(rng.integers(0, 8))), (1, 1, longest)),
        max_batch,
    )
    config = _config(checked, max_batch)
    assert [list(t.dims) for t in config.input] == [[-1], [-1]]
    assert [(t.data_type, list(t.dims)) for t in config.output] == [(model_config_pb2.TYPE_FP16, [-1, 49152])]
    assert checked.profile_checked
    assert checked.unexpressed_ranges == (f"input_ids dimension 1: 1..{longest}",
                                          f"attention_mask dimension 1: 1..{longest}")


def test_dims_the_profile_fixes_are_written_as_numbers(rng):
    length = int(rng.integers(1, 513))
    checked = check_engine_signature(_token_signature(100), _profile((1, 4, 8), (length, length, length)), 8)
    assert [list(t.dims) for t in _config(checked, 8).input] == [[length], [length]]
    assert checked.unexpressed_ranges == ()
    unbatched = check_engine_signature(_token_signature(100), _profile((2, 2, 2), (1, 16, 64)), 0)
    assert [list(t.dims) for t in _config(unbatched, 0).input] == [[2, -1], [2, -1]]
    assert unbatched.unexpressed_ranges == ("input_ids dimension 1: 1..64", "attention_mask dimension 1: 1..64")


def test_max_batch_size_above_the_profile_is_refused_with_the_fix(rng):
    high = int(rng.integers(1, 16))
    with pytest.raises(FlashNormError, match=rf"takes batch 1..{high}, .*pass --max-batch-size {high}"):
        check_engine_signature(_token_signature(100), _profile((1, 1, high), (1, 8, 64)), high + 1)


def test_profile_without_batch_one_is_refused():
    with pytest.raises(FlashNormError, match="needs batch >= 2, but Triton sends batches of 1"):
        check_engine_signature(_token_signature(100), _profile((2, 4, 8), (1, 8, 64)), 8)


@pytest.mark.parametrize("shapes, message", [
    (["input_ids:1x1,4x8,8x64"], r"dynamic input\(s\) \['attention_mask'\] have no --shapes range"),
    (["input_ids:1x1,4x8,8x64", "attention_mask:1x1,4x8,8x64", "position_ids:1x1,4x8,8x64"],
     r"unknown input\(s\) \['position_ids'\]"),
    (["input_ids:1x1x1,4x8x1,8x64x1", "attention_mask:1x1,4x8,8x64"], "has rank 2 .* rank 3"),
])
def test_a_profile_that_does_not_fit_the_inputs_is_refused(shapes, message):
    with pytest.raises(FlashNormError, match=message):
        check_engine_signature(_token_signature(100), parse_shape_specs(shapes), 8)


def test_fixed_dimension_outside_its_profile_is_refused():
    signature = signature_from_io_specs(["in:x:fp16:-1,576", "out:y:fp16:-1,1536"])
    with pytest.raises(FlashNormError, match="dimension 1 is fixed at 576, its profile says 512..512"):
        check_engine_signature(signature, parse_shape_specs(["x:1x512,4x512,8x512"]), 8)
    checked = check_engine_signature(signature, parse_shape_specs(["x:1x576,4x576,8x576"]), 8)
    assert checked.signature == signature and checked.unexpressed_ranges == ()


@pytest.mark.parametrize("data_type", ["fp64", "uint16", "int16", "uint32", "uint64", "string"])
def test_types_no_engine_has_are_refused(data_type):
    signature = signature_from_io_specs(["in:x:fp16:-1,4", f"out:y:{data_type}:-1,4"])
    with pytest.raises(FlashNormError, match=f"output 'y' is TYPE_{data_type.upper()}, which no TensorRT engine"):
        check_engine_signature(signature, {}, 8)


@pytest.mark.parametrize("data_type", ["fp32", "fp16", "bf16", "int8", "int32", "int64", "bool", "uint8"])
def test_engine_types_pass_without_a_profile(data_type):
    signature = signature_from_io_specs([f"in:x:{data_type}:-1,4", "out:y:fp16:-1,4"])
    checked = check_engine_signature(signature, {}, 8)
    assert checked.signature == signature and not checked.profile_checked
    assert dataclasses.asdict(checked.signature) == dataclasses.asdict(signature)
