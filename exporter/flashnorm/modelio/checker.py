"""The ONNX checker on a loaded model, without its weights, and accepting the ops ONNX Runtime
writes in the default domain."""

from __future__ import annotations

from pathlib import Path

import onnx
import onnx.checker
from google.protobuf.message import Message
from onnx.external_data_helper import _get_all_tensors

from flashnorm.errors import FlashNormError
from flashnorm.modelio.values import tensor_nbytes, type_name


def _copy_fields(source: Message, target: Message, skip: str = "") -> None:
    """Copy every set field of a protobuf message except `skip` (no deep copy of `skip`)."""
    for field, value in source.ListFields():
        if field.name == skip:
            continue
        repeated = field.is_repeated if hasattr(field, "is_repeated") else field.label == field.LABEL_REPEATED
        if repeated:
            getattr(target, field.name).extend(value)
        elif field.type == field.TYPE_MESSAGE:
            getattr(target, field.name).CopyFrom(value)
        else:
            setattr(target, field.name, value)


def _without_payload(tensor: onnx.TensorProto, raw: bool = False) -> None:
    """Empty a raw-data or external tensor in place (type and name kept, shape [0]); `raw`:
    the tensor's raw data was left out when it was copied."""
    if raw or tensor.HasField("raw_data") or tensor.data_location == onnx.TensorProto.EXTERNAL:
        del tensor.external_data[:]
        tensor.ClearField("data_location")
        del tensor.dims[:]
        tensor.dims.append(0)
        tensor.raw_data = b""


def check(source: Path, model: onnx.ModelProto) -> None:
    """The ONNX checker on `model`, shown without its weights.

    `check_model(path)` would parse the file a second time (for an inline model: a second
    in-memory copy, and longer than the load itself). The checker sees a copy of the model
    whose raw-data tensors are empty; the one thing it would have checked about them, the
    payload size against shape and type, is checked here (external data: `_external_range`)."""
    skeleton = onnx.ModelProto()
    _copy_fields(model, skeleton, skip="graph")
    _copy_fields(model.graph, skeleton.graph, skip="initializer")
    for tensor in model.graph.initializer:
        if tensor.HasField("raw_data"):
            _check_raw_size(source, tensor, len(tensor.raw_data))
            placeholder = skeleton.graph.initializer.add()
            _copy_fields(tensor, placeholder, skip="raw_data")
            _without_payload(placeholder, raw=True)
        else:
            skeleton.graph.initializer.add().CopyFrom(tensor)
    for tensor in _get_all_tensors(skeleton):  # subgraphs, attributes, external tensors
        if tensor.HasField("raw_data"):
            _check_raw_size(source, tensor, len(tensor.raw_data))
        _without_payload(tensor)
    _as_contrib_ops(skeleton)
    try:
        onnx.checker.check_model(skeleton)
    except onnx.checker.ValidationError as exc:
        message = " ".join(str(exc).split())
        raise FlashNormError(f"{source} is not a valid ONNX model: {message[:300]}") from None


# Ops ONNX Runtime registers in the default ONNX domain although ONNX defines no schema for
# them: its graph optimizer saves models with these nodes (e.g. `optimized_model_filepath`).
_ORT_DEFAULT_DOMAIN_OPS = frozenset({"SimplifiedLayerNormalization"})


def _as_contrib_ops(skeleton: onnx.ModelProto) -> None:
    """Let the checker accept ORT's default-domain contrib ops by checking them as the
    `com.microsoft` ops they are (the checker skips schemas of that domain). Only the
    checker's copy changes; the loaded model keeps its nodes as they were."""
    renamed = False
    for node in skeleton.graph.node:
        if node.domain in ("", "ai.onnx") and node.op_type in _ORT_DEFAULT_DOMAIN_OPS:
            node.domain = "com.microsoft"
            renamed = True
    if renamed and not any(o.domain == "com.microsoft" for o in skeleton.opset_import):
        skeleton.opset_import.add(domain="com.microsoft", version=1)


def _check_raw_size(source: Path, tensor: onnx.TensorProto, size: int) -> None:
    expected = tensor_nbytes(tensor.data_type, tensor.dims)
    if expected is not None and size != expected:
        raise FlashNormError(
            f"{source} is not a valid ONNX model: tensor {tensor.name!r} has {size} bytes of raw data, "
            f"its shape {list(tensor.dims)} and type {type_name(tensor)} need {expected}"
        )

