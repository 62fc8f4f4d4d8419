"""The inputs and outputs a Triton model declares, read from the model itself.

A `TritonTensor` holds the model's full shape (batch dimension included, -1 for a variable
dimension) and Triton's data-type name. Three sources: an ONNX file (only the graph's
signature is read, never the weights), a TensorRT engine (read by `flashnorm.engine.read_interface`:
needs `tensorrt` and the plugin library loaded so the engine deserializes), or explicit `--io` strings.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

from flashnorm.errors import FlashNormError

if TYPE_CHECKING:
    from flashnorm.engine import ShapeRange

# ONNX TensorProto.DataType number → Triton ModelConfig DataType name.
_ONNX_TO_TRITON = {
    1: "TYPE_FP32", 2: "TYPE_UINT8", 3: "TYPE_INT8", 4: "TYPE_UINT16", 5: "TYPE_INT16",
    6: "TYPE_INT32", 7: "TYPE_INT64", 8: "TYPE_STRING", 9: "TYPE_BOOL", 10: "TYPE_FP16",
    11: "TYPE_FP64", 12: "TYPE_UINT32", 13: "TYPE_UINT64", 16: "TYPE_BF16",
}
# TensorRT DataType name → Triton DataType name (FP8/INT4/FP4 have no Triton type).
_TRT_TO_TRITON = {
    "FLOAT": "TYPE_FP32", "HALF": "TYPE_FP16", "BF16": "TYPE_BF16", "INT8": "TYPE_INT8",
    "INT32": "TYPE_INT32", "INT64": "TYPE_INT64", "BOOL": "TYPE_BOOL", "UINT8": "TYPE_UINT8",
}
# Short names accepted in --io strings.
_SHORT_TYPES = {
    "fp32": "TYPE_FP32", "float32": "TYPE_FP32", "fp16": "TYPE_FP16", "float16": "TYPE_FP16",
    "bf16": "TYPE_BF16", "fp64": "TYPE_FP64", "float64": "TYPE_FP64", "int8": "TYPE_INT8",
    "int16": "TYPE_INT16", "int32": "TYPE_INT32", "int64": "TYPE_INT64", "uint8": "TYPE_UINT8",
    "uint16": "TYPE_UINT16", "uint32": "TYPE_UINT32", "uint64": "TYPE_UINT64",
    "bool": "TYPE_BOOL", "string": "TYPE_STRING",
}


@dataclasses.dataclass(frozen=True)
class TritonTensor:
    """One model input or output: its name, Triton data type and full shape (-1 = variable)."""

    name: str
    data_type: str
    shape: tuple[int, ...]
    is_input: bool

    def triton_dims(self, max_batch_size: int) -> tuple[int, ...]:
        """The dims Triton's config wants: without the batch dimension when batching is on."""
        if max_batch_size <= 0:
            return self.shape
        if not self.shape or self.shape[0] != -1:
            kind = "input" if self.is_input else "output"
            raise FlashNormError(
                f"{kind} {self.name!r} has shape {list(self.shape)}: batching "
                f"(--max-batch-size {max_batch_size}) needs a variable first dimension; "
                "pass --max-batch-size 0 to serve it unbatched"
            )
        return self.shape[1:]


@dataclasses.dataclass(frozen=True)
class TritonSignature:
    """All inputs and outputs of a model, where they were read from and, for an engine read
    with TensorRT, the ranges of its first optimization profile (input name → range)."""

    inputs: tuple[TritonTensor, ...]
    outputs: tuple[TritonTensor, ...]
    source: str  # "tensorrt", "onnx" or "io"
    profile: Mapping[str, "ShapeRange"] = dataclasses.field(default_factory=dict)
    vocabulary: int = 0
    """Token ids must lie in [0, vocabulary) (0: not known): a `logits` output's fixed last
    dimension, else the rows of the embedding table `input_ids` index in an ONNX graph."""

    def select_outputs(self, names: Sequence[str] | None) -> "TritonSignature":
        """Keep only the named outputs, in the order given; unknown names are an error."""
        if not names:
            return self
        by_name = {spec.name: spec for spec in self.outputs}
        unknown = [name for name in names if name not in by_name]
        if unknown:
            raise FlashNormError(
                f"unknown output name(s) {unknown}; the model has {sorted(by_name)}"
            )
        return dataclasses.replace(self, outputs=tuple(by_name[name] for name in names))


def _dims_from_onnx(value_info) -> tuple[int, ...]:
    tensor_type = value_info.type.tensor_type
    if not tensor_type.HasField("shape"):
        raise FlashNormError(f"ONNX tensor {value_info.name!r} has no shape; Triton needs its rank")
    return tuple(
        dim.dim_value if dim.HasField("dim_value") and dim.dim_value > 0 else -1
        for dim in tensor_type.shape.dim
    )


def _triton_type_from_onnx(value_info) -> str:
    element_type = value_info.type.tensor_type.elem_type
    if element_type not in _ONNX_TO_TRITON:
        raise FlashNormError(
            f"ONNX tensor {value_info.name!r} has element type {element_type}, which Triton has no type for"
        )
    return _ONNX_TO_TRITON[element_type]


def signature_from_onnx(path: str | os.PathLike[str]) -> TritonSignature:
    """Read the graph inputs (initializers excluded) and outputs of an ONNX file, without its weights."""
    from flashnorm.modelio import read_interface  # onnx and onnx-graphsurgeon load only when an ONNX file is read

    interface = read_interface(path)
    inputs = tuple(
        TritonTensor(vi.name, _triton_type_from_onnx(vi), _dims_from_onnx(vi), True) for vi in interface.inputs
    )
    outputs = tuple(
        TritonTensor(vi.name, _triton_type_from_onnx(vi), _dims_from_onnx(vi), False) for vi in interface.outputs
    )
    if not inputs or not outputs:
        raise FlashNormError(f"ONNX model {path} has no graph inputs or no graph outputs")
    logits = _logits_vocabulary(outputs)
    vocabulary = logits or (vocabulary_from_onnx(path) if any(t.name == "input_ids" for t in inputs) else 0)
    return TritonSignature(inputs, outputs, "onnx", vocabulary=vocabulary)


def _logits_vocabulary(outputs: Sequence[TritonTensor]) -> int:
    logits = next((spec for spec in outputs if spec.name == "logits"), None)
    return logits.shape[-1] if logits is not None and logits.shape and logits.shape[-1] > 0 else 0


# Ops that carry token ids unchanged on their way to the embedding Gather (an encoder's
# legacy export flattens input_ids with a Reshape first).
_ID_PASSTHROUGH = frozenset({"Reshape", "Cast", "Unsqueeze", "Squeeze", "Flatten", "Identity"})


def vocabulary_from_onnx(path: str | os.PathLike[str]) -> int:
    """The rows of the embedding table that `input_ids` index (a Gather of a rank-2
    initializer reached through ops that pass ids on unchanged); 0 where there is none. The
    weights are not read."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    tables = {t.name: t.dims for t in graph.initializer if len(t.dims) == 2}
    ids, frontier = {"input_ids"}, ["input_ids"]
    while frontier:
        name = frontier.pop()
        for node in graph.node:
            if node.op_type == "Gather" and len(node.input) == 2 and node.input[1] == name and node.input[0] in tables:
                return int(tables[node.input[0]][0])
            if node.op_type in _ID_PASSTHROUGH and node.input and node.input[0] == name:
                for output in node.output:
                    if output not in ids:
                        ids.add(output)
                        frontier.append(output)
    return 0


def signature_from_engine(
    engine_path: str | os.PathLike[str], plugin_paths: Iterable[str | os.PathLike[str]] = ()
) -> TritonSignature:
    """A TensorRT engine's I/O tensors and the shape ranges of its optimization profile 0, the one
    Triton uses unless told otherwise, as `flashnorm.engine.read_interface` reads them (plugins
    loaded first)."""
    from flashnorm.engine import TensorRTMissing, read_interface  # onnx and TensorRT load only when an engine is read

    try:
        interface = read_interface(engine_path, plugin_paths)
    except TensorRTMissing as missing:
        raise FlashNormError(
            f"{missing}; pass --onnx MODEL.onnx (the ONNX the engine was built from) or --io specs instead"
        ) from None
    inputs: list[TritonTensor] = []
    outputs: list[TritonTensor] = []
    for tensor in interface.tensors:
        if tensor.dtype not in _TRT_TO_TRITON:
            raise FlashNormError(f"engine tensor {tensor.name!r} has type {tensor.dtype}, which Triton has no type for")
        spec = TritonTensor(tensor.name, _TRT_TO_TRITON[tensor.dtype], tensor.shape, tensor.is_input)
        (inputs if tensor.is_input else outputs).append(spec)
    return TritonSignature(tuple(inputs), tuple(outputs), "tensorrt", dict(interface.profile),
                           vocabulary=_logits_vocabulary(outputs))


def parse_io_spec(text: str) -> TritonTensor:
    """Parse `in:NAME:TYPE:DIMS` or `out:NAME:TYPE:DIMS`, DIMS the full shape, e.g. `in:input_ids:int64:-1,-1`."""
    parts = text.split(":")
    if len(parts) != 4 or parts[0] not in ("in", "out"):
        raise FlashNormError(f"--io {text!r}: expected in|out:NAME:TYPE:DIMS, e.g. in:input_ids:int64:-1,-1")
    direction, name, type_name, dims_text = parts
    data_type = _SHORT_TYPES.get(type_name.lower())
    if data_type is None:
        raise FlashNormError(f"--io {text!r}: unknown type {type_name!r}; known: {sorted(_SHORT_TYPES)}")
    try:
        shape = tuple(int(d) for d in dims_text.split(","))
    except ValueError:
        raise FlashNormError(f"--io {text!r}: DIMS must be comma-separated integers (-1 = variable)") from None
    if not name or any(d == 0 or d < -1 for d in shape):
        raise FlashNormError(f"--io {text!r}: needs a name and dims that are positive or -1")
    return TritonTensor(name, data_type, shape, direction == "in")


def signature_from_io_specs(texts: Sequence[str]) -> TritonSignature:
    """Build a signature from `--io` strings; needs at least one input and one output, unique names."""
    specs = [parse_io_spec(text) for text in texts]
    names = [spec.name for spec in specs]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise FlashNormError(f"--io names tensors more than once: {duplicates}")
    inputs = tuple(spec for spec in specs if spec.is_input)
    outputs = tuple(spec for spec in specs if not spec.is_input)
    if not inputs or not outputs:
        raise FlashNormError("--io must describe at least one input (in:...) and one output (out:...)")
    return TritonSignature(inputs, outputs, "io", vocabulary=_logits_vocabulary(outputs))
