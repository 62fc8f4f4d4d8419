"""Save a graph as an ONNX model: each tensor written once, straight to its destination.

Unchanged external tensors are copied file-to-file in chunks, changed tensors are written from
the NumPy arrays they already are (or, as `DerivedValues`, computed while being written and
freed right after), and an inline model file is written as a stream. No tensor is held in
memory twice. Both files are staged (`flashnorm.files`): written under temporary names,
fsynced, and renamed into place data first.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import onnx
import onnx.numpy_helper
import onnx_graphsurgeon as gs
from onnx.external_data_helper import _get_all_tensors, uses_external_data
from onnx_graphsurgeon.exporters.onnx_exporter import constant_to_onnx_tensor, dtype_to_onnx
from onnx_graphsurgeon.ir.tensor import LazyValues, SparseValues

from flashnorm.errors import FlashNormError
from flashnorm.files import StagedFile, commit_with_data, discard_all
from flashnorm.modelio import wire
from flashnorm.modelio.graphwalk import all_constants, initializers
from flashnorm.modelio.loading import read_header
from flashnorm.modelio.modelgraph import ModelGraph
from flashnorm.modelio.values import PACKED_BITS, DerivedValues, ExternalValues, stored_values, tensor_nbytes
from flashnorm.progress import ByteProgress
from flashnorm.untrusted import InputFile, confined

# Above this many initializer bytes a model is saved with external data unless told otherwise:
# a margin below protobuf's 2 GiB message limit, left for the graph structure itself.
EXTERNAL_DATA_THRESHOLD = int(1.8e9)
# Tensors smaller than this stay inside the model file even when saving with external data.
INLINE_TENSOR_BYTES = 1024
# Large external tensors start on a 64 KiB boundary so that a runtime can memory-map them on
# any operating system; small ones on a 64-byte boundary.
_ALIGN_LARGE, _ALIGN_SMALL, _LARGE_TENSOR_BYTES = 65536, 64, 1 << 20
_CHUNK_BYTES = 64 << 20


# --------------------------------------------------------------------------------------------
# Save: where each tensor's bytes come from


@dataclasses.dataclass
class _Stream:
    """One initializer written as a `header` TensorProto (name, shape, type; no data) plus
    `nbytes` raw bytes taken from a range of `file`, or from `buffer()`, called only when the
    bytes are written."""

    constant: gs.Constant
    header: onnx.TensorProto
    nbytes: int
    file: InputFile | None = None
    offset: int = 0
    buffer: Callable[[], memoryview | bytes] | None = None

    def write(self, fd: int, progress: ByteProgress) -> None:
        if self.file is not None:
            _copy_range(self.file, self.offset, self.nbytes, fd, progress)
        else:
            _write_all(fd, self.buffer(), progress)


def _header(name: str, dims: Iterable[int], data_type: int) -> onnx.TensorProto:
    return onnx.TensorProto(name=name, dims=[int(d) for d in dims], data_type=data_type)


def _array_buffer(array: np.ndarray) -> Callable[[], memoryview]:
    def buffer() -> memoryview:
        little = array if array.dtype.byteorder != ">" else array.astype(array.dtype.newbyteorder("<"))
        return memoryview(np.ascontiguousarray(little).reshape(-1).view(np.uint8))

    return buffer


def _stream(constant: gs.Constant) -> _Stream | None:
    """How `constant`'s raw bytes can be streamed, or None where it has to be written as a
    whole TensorProto (strings, protos with typed data fields, export dtype conversions)."""
    values = stored_values(constant)
    if isinstance(values, ExternalValues):
        header = _header(constant.name, values.tensor.dims, values.tensor.data_type)
        return _Stream(constant, header, values.length, file=values.data, offset=values.offset)
    if isinstance(values, DerivedValues):
        try:
            data_type = dtype_to_onnx(values.dtype)
        except Exception:  # a NumPy dtype ONNX has no name for: let the exporter decide
            return None
        header = _header(constant.name, values.shape, data_type)
        if data_type in PACKED_BITS:  # int4/uint4 (a requantized weight): ONNX packs two codes a byte
            return _Stream(constant, header, tensor_nbytes(data_type, values.shape),
                           buffer=lambda: onnx.numpy_helper.from_array(values.load()).raw_data)
        return _Stream(constant, header, values.nbytes, buffer=lambda: _array_buffer(values.load())())
    if isinstance(values, SparseValues):
        return None
    if isinstance(values, LazyValues):
        source = values.tensor
        nbytes = tensor_nbytes(source.data_type, source.dims)
        if nbytes is None or not source.HasField("raw_data"):
            return None
        return _Stream(constant, _header(constant.name, source.dims, source.data_type), nbytes,
                       buffer=lambda: source.raw_data)
    if not isinstance(values, np.ndarray) or values.dtype.kind in "OSUa":
        return None
    try:
        data_type = dtype_to_onnx(values.dtype)
    except Exception:  # a NumPy dtype ONNX has no name for: let the exporter decide
        return None
    if dtype_to_onnx(constant.export_dtype) != data_type or data_type in PACKED_BITS:
        return None
    return _Stream(constant, _header(constant.name, values.shape, data_type), int(values.nbytes),
                   buffer=_array_buffer(values))


def _whole_proto(constant: gs.Constant) -> onnx.TensorProto:
    """The constant as a self-contained TensorProto with its data inside."""
    values = stored_values(constant)
    if isinstance(values, ExternalValues):
        tensor = values.inline_proto()
    elif isinstance(values, DerivedValues):
        tensor = onnx.numpy_helper.from_array(values.load())
    elif isinstance(values, LazyValues):
        tensor = values.tensor
    else:
        tensor = constant_to_onnx_tensor(constant)
    tensor.name = constant.name
    return tensor


class _ExportAs(LazyValues):
    """Stands in for a constant's values while exporting: the exporter emits `tensor` as it is
    (a header pointing at external data, a header the stream writer fills, or a whole proto)."""


# --------------------------------------------------------------------------------------------
# Byte movers


def _write_all(fd: int, data: memoryview | bytes, progress: ByteProgress | None = None) -> None:
    view = memoryview(data).cast("B")
    for start in range(0, len(view), _CHUNK_BYTES):
        chunk = view[start:start + _CHUNK_BYTES]
        while chunk:
            chunk = chunk[os.write(fd, chunk):]
        if progress is not None:
            progress.step(min(_CHUNK_BYTES, len(view) - start))


def _copy_range(source: InputFile, offset: int, length: int, fd: int, progress: ByteProgress) -> None:
    """Copy `length` bytes at `offset` of `source` (through the descriptor `load` opened) to the
    current position of `fd` in chunks, inside the kernel where the platform allows (no
    user-space copy at all)."""
    src = source.fd
    remaining, position = length, offset
    kernel_copy = hasattr(os, "copy_file_range")
    while remaining:
        count = min(remaining, _CHUNK_BYTES)
        copied = 0
        if kernel_copy:
            try:
                copied = os.copy_file_range(src, fd, count, position)
            except OSError:  # e.g. across file systems on older kernels
                copied = 0
            # 0 bytes can also mean "not supported here": let pread tell what the file holds.
            kernel_copy = copied > 0
        if not kernel_copy:
            data = source.read_at(position, count)
            _write_all(fd, data)
            copied = len(data)
        remaining -= copied
        position += copied
        progress.step(copied)


# --------------------------------------------------------------------------------------------
# Save


def save(graph: gs.Graph, path: str | os.PathLike[str], *, external_data: bool | None = None) -> None:
    """Save `graph` to `path` atomically.

    With external data the weights go to `<file name>.data` beside the model.
    `external_data=None` chooses it when the loaded model used external data or the
    initializers exceed ~1.8 GB. Unchanged external tensors are copied file-to-file; changed
    tensors are written from their arrays. Both files are written under temporary names and
    put in place by `files.commit_with_data`: replacing an existing model and its data, at
    every instant the destination holds the old pair or the new pair, complete. Before
    anything is put in place, every model and data file the weights were read from is checked
    to be the file `load` opened, unchanged (else one line, nothing written): an output never
    mixes two versions of an input. The input model and its data are never modified; saving
    over the input itself works. Afterwards, lazily loaded constants that were written to
    external data read from the saved data file."""
    destination = Path(path)
    constants = all_constants(graph)
    if external_data is None:
        external_data = any(isinstance(_origin(stored_values(c)), ExternalValues) for c in constants) or (
            sum(_nbytes(c) for c in constants) > EXTERNAL_DATA_THRESHOLD
        )
    data_path = destination.with_name(destination.name + ".data")
    if external_data:
        _refuse_replacing_input_data(constants, destination, data_path)

    # External data: every initializer of the graph or a subgraph may go to the data file.
    # Inline: the main graph's initializers are streamed into the model file. Everything else
    # (attribute and function constants, small tensors) is written whole, inside the model.
    if external_data:
        streamable = {id(c) for sub in [graph, *graph.subgraphs(recursive=True)] for c in initializers(sub)}
    else:
        streamable = {id(c) for c in initializers(graph)}
        for sub in graph.subgraphs(recursive=True):
            streamable -= {id(c) for c in initializers(sub)}

    originals = {id(c): stored_values(c) for c in constants}
    streams: list[_Stream] = []
    staged: list[StagedFile] = []
    try:
        for constant in constants:
            stream = _stream(constant) if id(constant) in streamable else None
            if stream is not None and external_data and stream.nbytes < INLINE_TENSOR_BYTES:
                stream = None
            if stream is not None:
                streams.append(stream)
                constant.values = _ExportAs(stream.header)
            elif _needs_whole_proto(stored_values(constant)):
                constant.values = _ExportAs(_whole_proto(constant))

        label = f"saving {destination.name}"
        if external_data:
            data_file = StagedFile(data_path)
            staged.append(data_file)
            progress = ByteProgress(label, sum(s.nbytes for s in streams))
            _write_data_file(streams, data_file.fd, data_path.name, progress)
            model = _export(graph)
            _check_sources_unchanged(originals.values())
            data_path = commit_model_with_data(model, data_file, destination,
                                               keep=_input_data(originals.values(), destination))
        else:
            model = _export(graph)
            model_file = StagedFile(destination)
            staged.append(model_file)
            _write_inline_model(model, streams, model_file.fd, destination, label)
            _check_sources_unchanged(originals.values())
            model_file.commit()
    except BaseException:
        discard_all(staged)
        for constant in constants:
            constant.values = originals[id(constant)]
        raise
    if external_data:
        _rebind(constants, originals, streams, data_path.resolve(), destination.resolve())
    else:
        for constant in constants:
            constant.values = originals[id(constant)]


def _check_sources_unchanged(values: Iterable[object]) -> None:
    """Refuse (one line) if any model or data file lazily read weights come from was replaced
    or rewritten since `load` opened it."""
    checked: set[int] = set()
    for stored in values:
        origin = _origin(stored)
        if isinstance(origin, ExternalValues) and id(origin.data) not in checked:
            checked.add(id(origin.data))
            origin.check_unchanged()


def commit_model_with_data(model: onnx.ModelProto, data: StagedFile, destination: Path, *,
                           keep: Iterable[Path] = ()) -> Path:
    """Put `model` at `destination` with its staged data file (`data`, written for the name
    `data.path.name` that `model`'s external tensors give) through `files.commit_with_data`:
    replacing an earlier output, at every instant the old pair or the new pair is complete,
    and the earlier output's data file goes once the new model is in place (never a file in
    `keep`). Returns where the data file went."""
    written = data.path.name
    return commit_with_data(data, destination, lambda location: _relocated(model, written, location),
                            old_data=_named_data(destination), keep=list(keep))


def _named_data(model: Path) -> list[Path]:
    """The data files the model now at `model` names (none if it is not an ONNX model)."""
    if not model.is_file():
        return []
    try:
        header = read_header(model)
        folder = Path(os.path.realpath(model)).parent
        return [confined(entry.value, folder, "location")
                for tensor in _get_all_tensors(header) if uses_external_data(tensor)
                for entry in tensor.external_data if entry.key == "location"]
    except FlashNormError:
        return []


def _input_data(values: Iterable[object], destination: Path) -> set[Path]:
    """The data files of the input models other than the one at `destination`."""
    model = destination.resolve()
    return {origin.path for origin in map(_origin, values)
            if isinstance(origin, ExternalValues) and origin.model.resolve() != model}


def _relocated(model: onnx.ModelProto, written: str, location: str) -> bytes:
    """`model` serialized with its external tensors written to `written` naming `location`."""
    for tensor in _get_all_tensors(model):
        for entry in tensor.external_data:
            if entry.key == "location" and entry.value == written:
                entry.value = location
    try:
        return model.SerializeToString()
    finally:
        for tensor in _get_all_tensors(model):
            for entry in tensor.external_data:
                if entry.key == "location" and entry.value == location:
                    entry.value = written


def _needs_whole_proto(values: object) -> bool:
    """Whether the exporter must be handed a complete TensorProto for these values: it
    exports an inline LazyValues' own proto as it is, anything else needs building."""
    return not isinstance(values, LazyValues) or isinstance(values, (ExternalValues, DerivedValues))


def _origin(values: object) -> object:
    """What a derived tensor is ultimately computed from (other values: themselves)."""
    while isinstance(values, DerivedValues):
        values = values.source
    return values


def _nbytes(constant: gs.Constant) -> int:
    return int(getattr(stored_values(constant), "nbytes", 0) or 0)


def _refuse_replacing_input_data(constants: list[gs.Constant], destination: Path, data_path: Path) -> None:
    """Saving `b.onnx` must not replace `b.onnx.data` while that file holds the weights of
    a different model being saved from; replacing it when saving over that model is fine."""
    target, model = data_path.resolve(), destination.resolve()
    for constant in constants:
        values = _origin(stored_values(constant))
        if isinstance(values, ExternalValues) and values.path.resolve() == target and values.model != model:
            raise FlashNormError(
                f"saving {destination} would replace {data_path}, the external data of input model "
                f"{values.model}; choose another output name"
            )


def _write_data_file(streams: list[_Stream], fd: int, location: str, progress: ByteProgress) -> None:
    position = 0
    for stream in streams:
        align = _ALIGN_LARGE if stream.nbytes >= _LARGE_TENSOR_BYTES else _ALIGN_SMALL
        padding = -position % align
        if padding:
            _write_all(fd, bytes(padding))
            position += padding
        stream.write(fd, progress)
        header = stream.header
        for key, value in (("location", location), ("offset", str(position)), ("length", str(stream.nbytes))):
            entry = header.external_data.add()
            entry.key, entry.value = key, value
        header.data_location = onnx.TensorProto.EXTERNAL
        position += stream.nbytes
    progress.finish()


def _export(graph: gs.Graph) -> onnx.ModelProto:
    model = gs.export_onnx(graph, do_type_check=False)
    if isinstance(graph, ModelGraph):
        model.MergeFrom(graph.model_fields)
    return model


def _write_inline_model(model: onnx.ModelProto, streams: list[_Stream], fd: int, destination: Path, label: str) -> None:
    """Write `model` as one ModelProto whose main-graph initializers' raw bytes are streamed
    in from their sources one at a time (all lengths are known up front)."""
    by_name = {stream.header.name: stream for stream in streams}
    graph = onnx.GraphProto()
    graph.CopyFrom(model.graph)
    initializers = list(graph.initializer)
    del graph.initializer[:]
    model.ClearField("graph")

    pieces: list[tuple[bytes, _Stream | None]] = []  # (bytes before the raw data, raw data)
    for tensor in initializers:
        stream = by_name.get(tensor.name)
        if stream is None:
            body = tensor.SerializeToString()
            pieces.append((wire.GRAPH_INITIALIZER_KEY + wire.varint(len(body)) + body, None))
        else:
            head = stream.header.SerializeToString() + wire.TENSOR_RAW_DATA_KEY + wire.varint(stream.nbytes)
            pieces.append((wire.GRAPH_INITIALIZER_KEY + wire.varint(len(head) + stream.nbytes) + head, stream))
    graph_bytes = graph.SerializeToString()
    graph_size = len(graph_bytes) + sum(len(prefix) + (s.nbytes if s else 0) for prefix, s in pieces)
    model_bytes = model.SerializeToString() + wire.MODEL_GRAPH_KEY + wire.varint(graph_size)
    total = len(model_bytes) + graph_size
    if total >= wire.PROTOBUF_LIMIT:
        raise FlashNormError(
            f"{destination} would be {total / 1e9:.2f} GB, over protobuf's 2 GiB limit; save it with external data"
        )
    progress = ByteProgress(label, total)
    _write_all(fd, model_bytes + graph_bytes, progress)
    for prefix, stream in pieces:
        _write_all(fd, prefix, progress)
        if stream is not None:
            stream.write(fd, progress)
    progress.finish()


def _rebind(
    constants: list[gs.Constant], originals: dict[int, object], streams: list[_Stream], data_path: Path, model: Path
) -> None:
    """Give each constant its values back. Lazy constants just written to external data now
    read from the saved data file (the input's may have been replaced); lazy ones written
    inside the model keep that inline copy, which depends on no data file."""
    written = {id(stream.constant): stream for stream in streams}
    saved: tuple[InputFile, InputFile] | None = None
    for constant in constants:
        original = originals[id(constant)]
        stream = written.get(id(constant))
        if stream is not None and isinstance(original, LazyValues):
            if saved is None:
                saved = InputFile(data_path, "saved data file"), InputFile(model, "saved model")
            entries = {e.key: e for e in stream.header.external_data}
            entries["location"].value = data_path.name
            constant.values = ExternalValues(stream.header, saved[0], int(entries["offset"].value), stream.nbytes, saved[1])
        elif isinstance(original, (ExternalValues, DerivedValues)):
            constant.values = LazyValues(stored_values(constant).tensor)
        else:
            constant.values = original

