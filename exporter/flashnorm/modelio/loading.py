"""Load an ONNX model as an onnx-graphsurgeon Graph without reading its external data, and read
a model file's interface without reading its weights."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import onnx
import onnx_graphsurgeon as gs
from google.protobuf.message import DecodeError
from onnx.external_data_helper import _get_all_tensors, uses_external_data
from onnx_graphsurgeon.ir.tensor import LazyValues, SparseValues

from flashnorm.errors import FlashNormError, missing_file
from flashnorm.modelio import wire
from flashnorm.modelio.checker import check
from flashnorm.modelio.graphwalk import all_constants
from flashnorm.modelio.modelgraph import ModelGraph
from flashnorm.modelio.values import ExternalValues, stored_values, tensor_nbytes, type_name
from flashnorm.progress import ByteProgress

def _external_range(tensor: onnx.TensorProto, base_dir: Path) -> tuple[Path, int, int]:
    """Resolve one external tensor's data range and check that it can be read."""
    entry = {e.key: e.value for e in tensor.external_data}
    location = entry.get("location", "")
    if Path(location).is_absolute() or ".." in Path(location).parts:
        raise FlashNormError(
            f"tensor {tensor.name!r}: external data location {location!r} must be a relative path inside {base_dir}"
        )
    path = base_dir / location
    if not location or not path.is_file():
        raise FlashNormError(f"external data file {location!r} of tensor {tensor.name!r} not found in {base_dir}")
    if not os.access(path, os.R_OK):
        raise FlashNormError(f"external data file {path} (tensor {tensor.name!r}) is not readable")
    expected = tensor_nbytes(tensor.data_type, tensor.dims)
    if expected is None:
        raise FlashNormError(f"tensor {tensor.name!r} of type {type_name(tensor)} cannot be stored as external data")
    try:
        offset = int(entry.get("offset", "0"))
        length = int(entry.get("length", expected))
    except ValueError:
        raise FlashNormError(f"tensor {tensor.name!r}: malformed external data offset or length") from None
    if length != expected:
        raise FlashNormError(
            f"tensor {tensor.name!r}: external data length {length} does not match "
            f"its shape and type ({expected} bytes)"
        )
    size = path.stat().st_size
    if offset < 0 or offset + length > size:
        raise FlashNormError(
            f"external data file {path} is truncated: tensor {tensor.name!r} needs bytes "
            f"{offset}..{offset + length}, the file has {size}"
        )
    return path, offset, length


def _parse_model(path: Path, initializer_headers_only: bool = False) -> onnx.ModelProto:
    try:
        size = path.stat().st_size
        progress = ByteProgress(f"loading {path.name}", size)
        with open(path, "rb") as handle:
            model = wire.read_model(handle, size, progress.step, initializer_headers_only)
        progress.finish()
    except (DecodeError, wire.Truncated):
        too_large = " (over protobuf's 2 GiB limit)" if path.stat().st_size >= wire.PROTOBUF_LIMIT else ""
        raise FlashNormError(f"{path} is not an ONNX model: protobuf parse failed{too_large}") from None
    except OSError as exc:
        raise FlashNormError(f"cannot read {path}: {exc.strerror}") from None
    if model.ir_version == 0 and not model.HasField("graph"):
        raise FlashNormError(f"{path} is not an ONNX model (no ir_version, no graph)")
    return model


def load(path: str | os.PathLike[str]) -> ModelGraph:
    """Load an ONNX model as an onnx-graphsurgeon Graph without reading its external data.

    External initializers stay on disk until a pass reads `constant.values`; opset imports,
    model-local functions, ir_version, producer and model metadata are kept for `save`, in copies
    (`graph.copy()`) too.
    Raises FlashNormError (one line) for a missing or unreadable file, a file that is not
    ONNX, a model the ONNX checker rejects, and missing or truncated external data."""
    source = _readable_model_file(path)
    model = _parse_model(source)
    check(source, model)

    model_path = source.resolve()
    external = {
        tensor.name: _external_range(tensor, model_path.parent)
        for tensor in _get_all_tensors(model)
        if uses_external_data(tensor)
    }
    graph = gs.import_onnx(model)
    if external:
        for constant in all_constants(graph):
            values = stored_values(constant)
            if isinstance(values, LazyValues) and not isinstance(values, SparseValues):
                if uses_external_data(values.tensor):
                    file, offset, length = external[values.tensor.name]
                    constant.values = ExternalValues(values.tensor, file, offset, length, model_path)

    fields = onnx.ModelProto()
    fields.doc_string, fields.domain, fields.model_version = model.doc_string, model.domain, model.model_version
    fields.metadata_props.extend(model.metadata_props)
    fields.training_info.extend(model.training_info)
    return ModelGraph.adopt(graph, fields)


@dataclasses.dataclass(frozen=True)
class ModelInterface:
    """What a caller feeds and receives: an ONNX file's graph inputs (initializers excluded),
    its graph outputs, and its metadata_props."""

    inputs: tuple[onnx.ValueInfoProto, ...]
    outputs: tuple[onnx.ValueInfoProto, ...]
    metadata: dict[str, str]


def read_header(path: str | os.PathLike[str]) -> onnx.ModelProto:
    """An ONNX file's model without the values of its initializers: their names, data types and
    shapes are kept, the payloads (inline or external) are skipped unread. Raises FlashNormError
    (one line) for a missing or unreadable file or one that is not ONNX."""
    return _parse_model(_readable_model_file(path), initializer_headers_only=True)


def read_interface(path: str | os.PathLike[str]) -> ModelInterface:
    """The inputs, outputs and metadata of an ONNX file, without reading its weights (external
    data, and the payloads of inline initializers, are skipped unread). Raises FlashNormError
    (one line) for a missing or unreadable file or one that is not ONNX."""
    model = read_header(path)
    initializers = {tensor.name for tensor in model.graph.initializer}
    return ModelInterface(
        tuple(value for value in model.graph.input if value.name not in initializers),
        tuple(model.graph.output),
        {prop.key: prop.value for prop in model.metadata_props},
    )


def _readable_model_file(path: str | os.PathLike[str]) -> Path:
    source = Path(path)
    if not source.is_file():
        raise missing_file("model", source)
    if not os.access(source, os.R_OK):
        raise FlashNormError(f"model file {source} is not readable")
    return source


def external_data_files(path: str | os.PathLike[str]) -> list[Path]:
    """The external-data files an ONNX model names (resolved beside it), read without its
    weights. Raises FlashNormError (one line) for a file that is not ONNX."""
    model = read_header(path)
    base = Path(os.path.realpath(path)).parent
    locations = {entry.value for tensor in _get_all_tensors(model) if uses_external_data(tensor)
                 for entry in tensor.external_data if entry.key == "location"}
    return sorted(base / location for location in locations if location)
