"""Load an ONNX model as an onnx-graphsurgeon Graph without reading its external data, and read
a model file's interface without reading its weights."""

from __future__ import annotations

import dataclasses
import os
import re
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
from flashnorm.untrusted import InputFile, Unchanged, confined

_DIGITS = re.compile(r"[0-9]+")


class _DataFiles:
    """The external-data files of one model, each opened once (`InputFile`) the first time a
    tensor names it and read through that descriptor for as long as the graph lives."""

    def __init__(self, model: InputFile) -> None:
        self.model, self.folder = model, Path(os.path.realpath(model.path)).parent
        self.opened: dict[Path, InputFile] = {}

    def range(self, tensor: onnx.TensorProto) -> tuple[InputFile, int, int]:
        """One external tensor's data file, offset and length, checked against the file: its
        location confined to the model's folder, the file regular, the range inside it."""
        entry = {e.key: e.value for e in tensor.external_data}
        named = f"tensor {tensor.name!r}"
        location = entry.get("location", "")
        path = confined(location, self.folder, f"{named}: external data location")
        if not path.exists():
            raise FlashNormError(f"external data file {location!r} of {named} not found in {self.folder}")
        if not os.access(path, os.R_OK):
            raise FlashNormError(f"external data file {path} ({named}) is not readable")
        if any(d < 0 for d in tensor.dims):
            raise FlashNormError(f"{named} has a negative dimension {list(tensor.dims)}")
        expected = tensor_nbytes(tensor.data_type, tensor.dims)
        if expected is None:
            raise FlashNormError(f"{named} of type {type_name(tensor)} cannot be stored as external data")
        offset_text, length_text = entry.get("offset", "0"), entry.get("length", str(expected))
        if not _DIGITS.fullmatch(offset_text) or not _DIGITS.fullmatch(length_text):
            raise FlashNormError(f"{named}: malformed external data offset {offset_text!r} or length {length_text!r}")
        offset, length = int(offset_text), int(length_text)
        if length != expected:
            raise FlashNormError(
                f"{named}: external data length {length} does not match its shape and type ({expected} bytes)"
            )
        data = self.opened.get(path)
        if data is None:
            data = self.opened[path] = InputFile(path, "external data file", within=self.folder)
        if offset + length > data.size:
            raise FlashNormError(
                f"external data file {path} is truncated: {named} needs bytes "
                f"{offset}..{offset + length}, the file has {data.size}"
            )
        return data, offset, length


def _parse_model(source: InputFile, initializer_headers_only: bool = False) -> onnx.ModelProto:
    """The model in `source`, refused cheaply before any parse where its size cannot be a
    model's, and parsed with every length bounded by the file (`wire.read_model`)."""
    path, size = source.path, source.size
    if size == 0:
        raise FlashNormError(f"{path} is not an ONNX model: the file is empty")
    if size >= wire.PROTOBUF_LIMIT:
        raise FlashNormError(f"{path} is not an ONNX model: {size / 1e9:.2f} GB is over protobuf's 2 GiB limit "
                             "for one model file (weights that large live in external data)")
    try:
        progress = ByteProgress(f"loading {path.name}", size)
        os.lseek(source.fd, 0, os.SEEK_SET)
        with open(source.fd, "rb", closefd=False) as handle:
            model = wire.read_model(handle, size, progress.step, initializer_headers_only)
        progress.finish()
    except wire.Truncated:
        raise FlashNormError(f"{path} is not an ONNX model: protobuf parse failed (a field runs past its "
                             "message or the end of the file)") from None
    except DecodeError as exc:
        raise FlashNormError(f"{path} is not an ONNX model: protobuf parse failed ({exc})") from None
    except OSError as exc:
        raise FlashNormError(f"cannot read {path}: {exc.strerror}") from None
    if model.ir_version == 0 and not model.HasField("graph"):
        raise FlashNormError(f"{path} is not an ONNX model (no ir_version, no graph)")
    return model


def load(path: str | os.PathLike[str]) -> ModelGraph:
    """Load an ONNX model as an onnx-graphsurgeon Graph without reading its external data.

    External initializers stay on disk until a pass reads `constant.values`, each data file
    read through one descriptor opened here (`ExternalValues`), so a file replaced while the
    command runs is never mixed in (`save` refuses it). Opset imports, model-local functions,
    ir_version, producer and model metadata are kept for `save`, in copies (`graph.copy()`) too.
    Raises FlashNormError (one line) for a missing or unreadable file, a file that is not a
    regular file or not ONNX, a model the ONNX checker rejects, and external data that is
    missing, truncated, not a regular file or outside the model's folder."""
    source = _open_model(path)
    model = _parse_model(source)
    check(source.path, model)

    data_files = _DataFiles(source)
    for tensor in _get_all_tensors(model):
        if uses_external_data(tensor):
            data_files.range(tensor)  # every location checked, whether or not the graph keeps it
    graph = gs.import_onnx(model)
    if data_files.opened:
        for constant in all_constants(graph):
            values = stored_values(constant)
            if isinstance(values, LazyValues) and not isinstance(values, SparseValues):
                if uses_external_data(values.tensor):
                    data, offset, length = data_files.range(values.tensor)
                    constant.values = ExternalValues(values.tensor, data, offset, length, source)

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
    (one line) for a missing or unreadable file, one that is not a regular file, or not ONNX."""
    source = _open_model(path)
    try:
        return _parse_model(source, initializer_headers_only=True)
    finally:
        source.close()


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


def _open_model(path: str | os.PathLike[str]) -> InputFile:
    """The model file, opened once: never a wait on a FIFO, never a device."""
    source = Path(path)
    if not source.exists() or source.is_dir():
        raise missing_file("model", source)
    if not os.access(source, os.R_OK):
        raise FlashNormError(f"model file {source} is not readable")
    return InputFile(source, "model")


def external_data_files(path: str | os.PathLike[str]) -> list[Path]:
    """The external-data files an ONNX model names, resolved, each checked as `load` checks
    it (confined to the model's folder after resolving symlinks, a regular file, every tensor's
    range inside it), without reading any weight. Raises FlashNormError (one line) for a file
    that is not ONNX and for any location `load` would refuse: the path guard calls it before
    a command starts, so every command refuses them at once."""
    source = _open_model(path)
    try:
        model = _parse_model(source, initializer_headers_only=True)
        data_files = _DataFiles(source)
        for tensor in _get_all_tensors(model):
            if uses_external_data(tensor):
                data_files.range(tensor)
        for data in data_files.opened.values():
            data.close()
        return sorted(data_files.opened)
    finally:
        source.close()


def unchanged_model(path: str | os.PathLike[str]) -> Unchanged:
    """The identities of the model and of every external-data file it names (checked as
    `external_data_files` checks them), taken now, for a reader that opens them by name itself
    (TensorRT's parser, ONNX Runtime): its `check()` refuses any that changed since."""
    return Unchanged([(path, "model"), *((data, "external data file") for data in external_data_files(path))])
