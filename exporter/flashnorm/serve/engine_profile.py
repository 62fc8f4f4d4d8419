"""What a `tensorrt_plan` config.pbtxt can say about an engine, checked before it is written.

Triton's ModelConfig states, per tensor, a data type and dims where a variable dimension is
-1; per model, `max_batch_size`. It cannot state a range (an optimization profile's min..max
for a dimension), a relation between inputs (attention_mask as long as input_ids), or the
values a tensor may hold (token ids in [0, vocabulary)). So the checks here are:

- every tensor's data type is one a TensorRT engine can take or return;
- with the engine's optimization profile (read from the engine, or the `--shapes` it was
  built with): every dynamic input has a range; fixed dimensions agree; with batching on,
  every batch size Triton may send (1..max_batch_size) lies inside the profile's batch range;
- a dimension that is -1 in the model but fixed by the profile (min = max) is written as that
  number, so Triton itself refuses other sizes before the engine sees them;
- what is left, the ranges the config can only call -1, is returned as a list for the report
  and the repository README: those requests are not stopped by Triton's config.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Mapping

from flashnorm.errors import FlashNormError
from flashnorm.serve.tensors import TritonSignature, TritonTensor

if TYPE_CHECKING:  # the ranges are only read; importing flashnorm.engine would load onnx
    from flashnorm.engine import ShapeRange

# Triton data types a TensorRT engine's I/O tensor can have (TensorRT's FLOAT, HALF, BF16,
# INT8, INT32, INT64, BOOL, UINT8; FP8, INT4 and FP4 have no Triton type).
TENSORRT_DATA_TYPES = frozenset({
    "TYPE_FP32", "TYPE_FP16", "TYPE_BF16", "TYPE_INT8", "TYPE_INT32", "TYPE_INT64", "TYPE_BOOL", "TYPE_UINT8",
})


@dataclasses.dataclass(frozen=True)
class CheckedEngineSignature:
    """The signature to write (dims pinned where the profile fixes them) and, per input, the
    ranges Triton's config cannot express (empty when no profile was given)."""

    signature: TritonSignature
    profile_checked: bool
    unexpressed_ranges: tuple[str, ...]


def _check_data_types(signature: TritonSignature) -> None:
    for spec in signature.inputs + signature.outputs:
        if spec.data_type not in TENSORRT_DATA_TYPES:
            kind = "input" if spec.is_input else "output"
            raise FlashNormError(
                f"{kind} {spec.name!r} is {spec.data_type}, which no TensorRT engine takes or returns "
                f"(TensorRT I/O types: {', '.join(sorted(TENSORRT_DATA_TYPES))})"
            )


def _batch_range_error(spec: TritonTensor, shape_range: ShapeRange, max_batch_size: int) -> str | None:
    low, high = shape_range.minimum[0], shape_range.maximum[0]
    if low <= 1 and high >= max_batch_size:
        return None
    return (
        f"input {spec.name!r}: the engine's profile takes batch {low}..{high}, but with --max-batch-size "
        f"{max_batch_size} Triton sends any batch from 1 to {max_batch_size}; pass --max-batch-size {high} "
        f"or build the engine with a batch range 1..{max_batch_size}"
        if low <= 1 else
        f"input {spec.name!r}: the engine's profile needs batch >= {low}, but Triton sends batches of 1; "
        "build the engine with a minimum batch of 1"
    )


def _checked_input(spec: TritonTensor, shape_range: ShapeRange, max_batch_size: int) -> tuple[TritonTensor, list[str]]:
    """The input with its profile-fixed dims pinned, and the ranges left as -1."""
    if len(shape_range.minimum) != len(spec.shape):
        raise FlashNormError(
            f"input {spec.name!r} has rank {len(spec.shape)} {list(spec.shape)}, its profile "
            f"{shape_range.describe()} rank {len(shape_range.minimum)}"
        )
    pinned, ranges = [], []
    for axis, (declared, low, high) in enumerate(zip(spec.shape, shape_range.minimum, shape_range.maximum)):
        if declared != -1:
            if not low == declared == high:
                raise FlashNormError(
                    f"input {spec.name!r} dimension {axis} is fixed at {declared}, its profile says {low}..{high}"
                )
            pinned.append(declared)
        elif max_batch_size > 0 and axis == 0:
            error = _batch_range_error(spec, shape_range, max_batch_size)
            if error:
                raise FlashNormError(error)
            pinned.append(-1)
        elif low == high:
            pinned.append(low)
        else:
            pinned.append(-1)
            ranges.append(f"{spec.name} dimension {axis}: {low}..{high}")
    return dataclasses.replace(spec, shape=tuple(pinned)), ranges


def check_engine_signature(
    signature: TritonSignature, profile: Mapping[str, ShapeRange], max_batch_size: int
) -> CheckedEngineSignature:
    """Check `signature` and the engine's optimization `profile` (input name → range; empty when
    unknown) against what a tensorrt_plan config with `max_batch_size` can state."""
    _check_data_types(signature)
    if not profile:
        return CheckedEngineSignature(signature, False, ())
    names = {spec.name for spec in signature.inputs}
    unknown = sorted(set(profile) - names)
    if unknown:
        raise FlashNormError(f"--shapes names unknown input(s) {unknown}; the inputs are {sorted(names)}")
    uncovered = [spec.name for spec in signature.inputs if -1 in spec.shape and spec.name not in profile]
    if uncovered:
        raise FlashNormError(
            f"dynamic input(s) {uncovered} have no --shapes range; "
            "give every dynamic input the range the engine was built with"
        )
    inputs, unexpressed = [], []
    for spec in signature.inputs:
        if spec.name in profile:
            spec, ranges = _checked_input(spec, profile[spec.name], max_batch_size)
            unexpressed += ranges
        inputs.append(spec)
    return CheckedEngineSignature(dataclasses.replace(signature, inputs=tuple(inputs)), True, tuple(unexpressed))
