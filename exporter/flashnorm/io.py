"""Load and save ONNX models: external data, atomic writes, clear errors.

Every file FlashNorm writes goes to a temporary name beside the destination and is renamed
into place only once complete, so a failure never leaves half a file behind.

Large models keep their weights out of memory. `load` parses the model without its external
data; every externally stored initializer becomes an `ExternalValues` that knows its file,
offset and length and reads its values only when a pass asks for `constant.values`. `save`
writes each tensor once, straight to its destination: unchanged external tensors are copied
file-to-file in chunks, changed tensors are written from the NumPy arrays they already are
(or, as `DerivedValues`, computed while being written and freed right after), and an inline
model file is written as a stream. No tensor is held in memory twice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import tempfile
import time
from pathlib import Path
from typing import IO, Callable, Iterable, Iterator

import numpy as np
import onnx
import onnx.checker
import onnx.numpy_helper
import onnx_graphsurgeon as gs
from google.protobuf.message import DecodeError, Message
from onnx.external_data_helper import _get_all_tensors, uses_external_data
from onnx_graphsurgeon.exporters.onnx_exporter import constant_to_onnx_tensor, dtype_to_onnx
from onnx_graphsurgeon.ir.tensor import LazyValues, SparseValues

from flashnorm.errors import FlashNormError
from flashnorm.progress import Progress

_TWO_GIB = 2**31
# Above this many initializer bytes a model is saved with external data unless told otherwise:
# a margin below protobuf's 2 GiB message limit, left for the graph structure itself.
EXTERNAL_DATA_THRESHOLD = int(1.8e9)
# Tensors smaller than this stay inside the model file even when saving with external data.
INLINE_TENSOR_BYTES = 1024
# Large external tensors start on a 64 KiB boundary so that a runtime can memory-map them on
# any operating system; small ones on a 64-byte boundary.
_ALIGN_LARGE, _ALIGN_SMALL, _LARGE_TENSOR_BYTES = 65536, 64, 1 << 20
_CHUNK_BYTES = 64 << 20
_MIB = 1 << 20

# Model-level fields onnx-graphsurgeon's Graph does not carry; `load` keeps them on the graph
# (`Graph.copy()` does not copy them: a copied graph saves without them).
_MODEL_FIELDS_ATTRIBUTE = "_flashnorm_model_fields"

# Bits per element of the sub-byte types, whose raw_data is packed.
_PACKED_BITS = {
    getattr(onnx.TensorProto, name): bits
    for name, bits in {"INT4": 4, "UINT4": 4, "FLOAT4E2M1": 4, "INT2": 2, "UINT2": 2}.items()
    if hasattr(onnx.TensorProto, name)
}


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str], mode: str = "wb") -> Iterator[IO]:
    """Open a temporary file beside `path`; rename it to `path` only if the block succeeds."""
    destination = Path(path)
    directory = destination.parent if str(destination.parent) else Path(".")
    if not directory.is_dir():
        raise FlashNormError(f"cannot write {destination}: directory {directory} does not exist")
    try:
        fd, temporary = tempfile.mkstemp(prefix=f".{destination.name}.", suffix=".tmp", dir=directory)
    except OSError as exc:
        raise FlashNormError(f"cannot write {destination}: {exc.strerror}") from None
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp's 0600 is for the temporary, not the result
        with os.fdopen(fd, mode) as handle:
            yield handle
        os.replace(temporary, destination)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


class _ByteProgress:
    """Progress of a byte count, shown in MiB; the final line only for work long enough to
    have shown progress."""

    def __init__(self, label: str, total_bytes: int) -> None:
        self.progress = Progress(f"{label} (MiB)", total=-(-total_bytes // _MIB))
        self.bytes = 0

    def step(self, nbytes: int) -> None:
        self.bytes += nbytes
        self.progress.step(self.bytes // _MIB - self.progress.done)

    def finish(self) -> None:
        if time.monotonic() - self.progress.start >= self.progress.interval:
            self.progress.finish()


# --------------------------------------------------------------------------------------------
# Lazily loaded external tensors


def tensor_nbytes(data_type: int, dims: Iterable[int]) -> int | None:
    """Bytes of `raw_data` for a tensor of this ONNX type and shape; None for strings."""
    if data_type == onnx.TensorProto.STRING:
        return None
    volume = math.prod(int(d) for d in dims)
    if data_type in _PACKED_BITS:
        return (volume * _PACKED_BITS[data_type] + 7) // 8
    try:
        return volume * onnx.helper.tensor_dtype_to_np_dtype(data_type).itemsize
    except (KeyError, ValueError):  # UNDEFINED or a type this onnx does not know
        return None


def _read_bytes(path: Path, offset: int, length: int) -> bytes:
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            data = handle.read(length)
    except OSError as exc:
        raise FlashNormError(f"cannot read external data {path}: {exc.strerror}") from None
    if len(data) != length:
        raise FlashNormError(f"external data file {path} ends before byte {offset + length}")
    return data


def _inline_copy(tensor: onnx.TensorProto, raw: bytes) -> onnx.TensorProto:
    inline = onnx.TensorProto()
    inline.CopyFrom(tensor)
    del inline.external_data[:]
    inline.data_location = onnx.TensorProto.DEFAULT
    inline.raw_data = raw
    return inline


class ExternalValues(LazyValues):
    """A tensor stored in an external data file. `tensor` is its TensorProto (location,
    offset, length; no data), `path` the resolved data file, `model` the model file that
    refers to it. `load()` reads exactly that byte range into one NumPy array; the TensorProto
    is never filled in, so reading a weight never leaves a second copy behind."""

    def __init__(self, tensor: onnx.TensorProto, path: Path, offset: int, length: int, model: Path) -> None:
        super().__init__(tensor)
        self.path, self.offset, self.length, self.model = path, offset, length, model
        self.nbytes = length

    def load(self) -> np.ndarray:
        data_type = self.tensor.data_type
        dims = tuple(int(d) for d in self.tensor.dims)
        if data_type in _PACKED_BITS:
            raw = _read_bytes(self.path, self.offset, self.length)
            return np.array(onnx.numpy_helper.to_array(_inline_copy(self.tensor, raw)))
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(data_type))
        count = math.prod(dims)
        try:
            values = np.fromfile(self.path, dtype=dtype.newbyteorder("<"), count=count, offset=self.offset)
        except OSError as exc:
            raise FlashNormError(f"cannot read external data {self.path}: {exc.strerror}") from None
        if values.size != count:
            raise FlashNormError(f"external data file {self.path} ends before byte {self.offset + self.length}")
        return values.astype(dtype, copy=False).reshape(dims)

    def inline_proto(self) -> onnx.TensorProto:
        """The tensor with its data inside (for writing it into a model file)."""
        return _inline_copy(self.tensor, _read_bytes(self.path, self.offset, self.length))

    def __str__(self) -> str:
        return f"ExternalValues (shape={self.shape}, dtype={self.dtype}, {self.path.name}@{self.offset})"


class DerivedValues(LazyValues):
    """Values computed from another constant's values only when they are needed.

    `DerivedValues(weight, lambda w: w * gain[:, None])` describes a changed weight without
    computing it: `save` computes it while writing it and frees it right after, so a pass that
    changes many large weights (fold) never holds more than one of them in memory. `load()`
    (what `constant.values` calls) computes it too. `function` receives a fresh array of the
    source's values, which it may modify in place, and must return an array of `shape` and
    `dtype` (by default the source's)."""

    def __init__(
        self,
        source: gs.Constant,
        function: Callable[[np.ndarray], np.ndarray],
        *,
        shape: Iterable[int] | None = None,
        dtype: np.dtype | None = None,
    ) -> None:
        # The source's current values object, not the Constant: later edits of the source
        # (or its `.values` being loaded) do not change what this derives from.
        self.source, self.function = source._values, function
        self.shape = list(source.shape if shape is None else shape)
        self.dtype = np.dtype(source.dtype if dtype is None else dtype)
        self.nbytes = math.prod(int(d) for d in self.shape) * self.dtype.itemsize

    def load(self) -> np.ndarray:
        # LazyValues.load() reads a new array every time; an in-memory source is copied so
        # that `function` may work in place without changing it.
        source = self.source.load() if isinstance(self.source, LazyValues) else np.array(self.source)
        values = np.asarray(self.function(source))
        if list(values.shape) != self.shape or values.dtype != self.dtype:
            raise ValueError(
                f"derived values are {values.dtype}{list(values.shape)}, declared {self.dtype}{self.shape}"
            )
        return values

    @property
    def tensor(self) -> onnx.TensorProto:
        """The computed tensor, for code that exports the graph without `save`."""
        return onnx.numpy_helper.from_array(self.load())

    def __str__(self) -> str:
        return f"DerivedValues (shape={self.shape}, dtype={self.dtype}, from {self.source})"


# --------------------------------------------------------------------------------------------
# Load


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
        raise FlashNormError(f"tensor {tensor.name!r} of type {_type_name(tensor)} cannot be stored as external data")
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


def _type_name(tensor: onnx.TensorProto) -> str:
    if tensor.data_type in onnx.TensorProto.DataType.values():
        return onnx.TensorProto.DataType.Name(tensor.data_type)
    return str(tensor.data_type)


class _Truncated(Exception):
    """The file ends inside a protobuf field."""


def _read_exact(handle: IO[bytes], size: int) -> bytes:
    data = handle.read(size)
    if len(data) != size:
        raise _Truncated
    return data


def _read_key_and_length(handle: IO[bytes]) -> tuple[int, int, bytes] | None:
    """The next field's number and wire type, and its key bytes; None at the end of the file."""
    raw = bytearray()
    while True:
        byte = handle.read(1)
        if not byte:
            if raw:
                raise _Truncated
            return None
        raw += byte
        if not byte[0] & 0x80:
            break
        if len(raw) > 10:
            raise DecodeError("varint too long")
    key = _decode_varint(raw)
    return key >> 3, key & 7, bytes(raw)


def _decode_varint(raw: bytes | bytearray) -> int:
    return sum((byte & 0x7F) << (7 * i) for i, byte in enumerate(raw))


def _read_varint(handle: IO[bytes]) -> tuple[int, bytes]:
    raw = bytearray()
    while True:
        byte = _read_exact(handle, 1)
        raw += byte
        if not byte[0] & 0x80:
            return _decode_varint(raw), bytes(raw)
        if len(raw) > 10:
            raise DecodeError("varint too long")


def _read_field(handle: IO[bytes], wire_type: int) -> tuple[bytes, int]:
    """The rest of a field after its key: (its bytes up to the payload, payload length), with
    the payload itself still unread for length-delimited fields, read for the others."""
    if wire_type == 0:
        return _read_varint(handle)[1], 0
    if wire_type in (1, 5):
        return _read_exact(handle, 8 if wire_type == 1 else 4), 0
    if wire_type == 2:
        length, raw = _read_varint(handle)
        return raw, length
    raise DecodeError(f"unsupported wire type {wire_type}")


def _read_model(
    handle: IO[bytes], end: int, progress: _ByteProgress, initializer_names_only: bool = False
) -> onnx.ModelProto:
    """Parse a ModelProto from a file, one initializer at a time.

    `ParseFromString` needs the whole file in memory next to the parsed model: an inline model
    held twice. Here every field except the graph's initializers is gathered as bytes (small)
    and merged at the end; each initializer is read and parsed on its own, straight into the
    model, so the peak is the model plus its largest tensor. With `initializer_names_only` an
    initializer keeps only its name and its payload is skipped unread."""
    model = onnx.ModelProto()
    model_rest, graph_rest = bytearray(), bytearray()
    while (field := _read_key_and_length(handle)) is not None:
        number, wire_type, key = field
        head, length = _read_field(handle, wire_type)
        if number != 7 or wire_type != 2:  # anything but ModelProto.graph
            model_rest += key + head + _read_exact(handle, length)
            continue
        graph_end = handle.tell() + length
        if graph_end > end:
            raise _Truncated
        for inner_number, inner_type, inner_key, inner_head, inner_length in _embedded_fields(
            handle, graph_end, "graph field"
        ):
            if inner_number == 5 and inner_type == 2 and initializer_names_only:
                model.graph.initializer.add().name = _read_tensor_name(handle, handle.tell() + inner_length, graph_end)
            elif inner_number == 5 and inner_type == 2:  # GraphProto.initializer
                model.graph.initializer.add().ParseFromString(_read_exact(handle, inner_length))
                progress.step(inner_length)
            else:
                graph_rest += inner_key + inner_head + _read_exact(handle, inner_length)
    if graph_rest:
        model.graph.MergeFromString(bytes(graph_rest))
    model.MergeFromString(bytes(model_rest))
    return model


def _read_tensor_name(handle: IO[bytes], tensor_end: int, limit: int) -> str:
    """A serialized TensorProto's name (field 8), its other fields skipped; leaves `handle` at
    `tensor_end`."""
    if tensor_end > limit:
        raise _Truncated
    name = ""
    for number, wire_type, _, _, length in _embedded_fields(handle, tensor_end, "initializer"):
        if number == 8 and wire_type == 2:
            name = _read_exact(handle, length).decode("utf-8")
        else:
            handle.seek(length, os.SEEK_CUR)
    return name


def _embedded_fields(handle: IO[bytes], field_end: int, what: str) -> Iterator[tuple[int, int, bytes, bytes, int]]:
    """The fields of an embedded message ending at `field_end`: (number, wire type, key bytes,
    bytes up to the payload, payload length). The caller reads or skips each payload before
    asking for the next field."""
    while handle.tell() < field_end:
        field = _read_key_and_length(handle)
        if field is None:
            raise _Truncated
        number, wire_type, key = field
        head, length = _read_field(handle, wire_type)
        yield number, wire_type, key, head, length
    if handle.tell() != field_end:
        raise DecodeError(f"{what} length does not match its content")


def _parse_model(path: Path, initializer_names_only: bool = False) -> onnx.ModelProto:
    try:
        size = path.stat().st_size
        progress = _ByteProgress(f"loading {path.name}", size)
        with open(path, "rb") as handle:
            model = _read_model(handle, size, progress, initializer_names_only)
        progress.finish()
    except (DecodeError, _Truncated):
        too_large = " (over protobuf's 2 GiB limit)" if path.stat().st_size >= _TWO_GIB else ""
        raise FlashNormError(f"{path} is not an ONNX model: protobuf parse failed{too_large}") from None
    except OSError as exc:
        raise FlashNormError(f"cannot read {path}: {exc.strerror}") from None
    if model.ir_version == 0 and not model.HasField("graph"):
        raise FlashNormError(f"{path} is not an ONNX model (no ir_version, no graph)")
    return model


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


def _check(source: Path, model: onnx.ModelProto) -> None:
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
            f"its shape {list(tensor.dims)} and type {_type_name(tensor)} need {expected}"
        )


def load(path: str | os.PathLike[str]) -> gs.Graph:
    """Load an ONNX model as an onnx-graphsurgeon Graph without reading its external data.

    External initializers stay on disk until a pass reads `constant.values`; opset imports,
    model-local functions, ir_version, producer and model metadata are kept for `save`.
    Raises FlashNormError (one line) for a missing or unreadable file, a file that is not
    ONNX, a model the ONNX checker rejects, and missing or truncated external data."""
    source = _readable_model_file(path)
    model = _parse_model(source)
    _check(source, model)

    model_path = source.resolve()
    external = {
        tensor.name: _external_range(tensor, model_path.parent)
        for tensor in _get_all_tensors(model)
        if uses_external_data(tensor)
    }
    graph = gs.import_onnx(model)
    if external:
        for constant in _all_constants(graph):
            values = constant._values
            if isinstance(values, LazyValues) and not isinstance(values, SparseValues):
                if uses_external_data(values.tensor):
                    file, offset, length = external[values.tensor.name]
                    constant._values = ExternalValues(values.tensor, file, offset, length, model_path)

    fields = onnx.ModelProto()
    fields.doc_string, fields.domain, fields.model_version = model.doc_string, model.domain, model.model_version
    fields.metadata_props.extend(model.metadata_props)
    fields.training_info.extend(model.training_info)
    setattr(graph, _MODEL_FIELDS_ATTRIBUTE, fields)
    return graph


@dataclasses.dataclass(frozen=True)
class ModelInterface:
    """What a caller feeds and receives: an ONNX file's graph inputs (initializers excluded),
    its graph outputs, and its metadata_props."""

    inputs: tuple[onnx.ValueInfoProto, ...]
    outputs: tuple[onnx.ValueInfoProto, ...]
    metadata: dict[str, str]


def read_interface(path: str | os.PathLike[str]) -> ModelInterface:
    """The inputs, outputs and metadata of an ONNX file, without reading its weights (external
    data, and the payloads of inline initializers, are skipped unread). Raises FlashNormError
    (one line) for a missing or unreadable file or one that is not ONNX."""
    model = _parse_model(_readable_model_file(path), initializer_names_only=True)
    initializers = {tensor.name for tensor in model.graph.initializer}
    return ModelInterface(
        tuple(value for value in model.graph.input if value.name not in initializers),
        tuple(model.graph.output),
        {prop.key: prop.value for prop in model.metadata_props},
    )


def _readable_model_file(path: str | os.PathLike[str]) -> Path:
    source = Path(path)
    if not source.exists():
        raise FlashNormError(f"model file {source} does not exist")
    if not source.is_file():
        raise FlashNormError(f"model path {source} is not a file")
    if not os.access(source, os.R_OK):
        raise FlashNormError(f"model file {source} is not readable")
    return source


# --------------------------------------------------------------------------------------------
# Walking a graph's constants


def _graphs(graph: gs.Graph) -> list[gs.Graph]:
    """The graph, its functions, and every subgraph of either, each once."""
    found: dict[int, gs.Graph] = {}
    for root in [graph, *graph.functions]:
        for candidate in [root, *root.subgraphs(recursive=True)]:
            found.setdefault(id(candidate), candidate)
    return list(found.values())


def _all_constants(graph: gs.Graph) -> list[gs.Constant]:
    """Every Constant reachable from `graph` (node inputs and attributes, graph inputs and
    outputs, in all subgraphs and functions), each once."""
    found: dict[int, gs.Constant] = {}
    for sub in _graphs(graph):
        candidates = [*sub.inputs, *sub.outputs]
        for node in sub.nodes:
            candidates += [*node.inputs, *node.attrs.values()]
        for tensor in candidates:
            if isinstance(tensor, gs.Constant):
                found.setdefault(id(tensor), tensor)
    return list(found.values())


def _initializers(graph: gs.Graph) -> list[gs.Constant]:
    """The Constants the exporter writes as initializers of `graph` itself."""
    return [
        t for t in graph.tensors().values()
        if isinstance(t, gs.Constant) and not isinstance(t._values, SparseValues)
    ]


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
    file: Path | None = None
    offset: int = 0
    buffer: Callable[[], memoryview | bytes] | None = None

    def write(self, fd: int, progress: _ByteProgress) -> None:
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
    values = constant._values
    if isinstance(values, ExternalValues):
        header = _header(constant.name, values.tensor.dims, values.tensor.data_type)
        return _Stream(constant, header, values.length, file=values.path, offset=values.offset)
    if isinstance(values, DerivedValues):
        try:
            data_type = dtype_to_onnx(values.dtype)
        except Exception:  # a NumPy dtype ONNX has no name for: let the exporter decide
            return None
        return _Stream(constant, _header(constant.name, values.shape, data_type), values.nbytes,
                       buffer=lambda: _array_buffer(values.load())())
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
    if dtype_to_onnx(constant.export_dtype) != data_type or data_type in _PACKED_BITS:
        return None
    return _Stream(constant, _header(constant.name, values.shape, data_type), int(values.nbytes),
                   buffer=_array_buffer(values))


def _whole_proto(constant: gs.Constant) -> onnx.TensorProto:
    """The constant as a self-contained TensorProto with its data inside."""
    values = constant._values
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


def _write_all(fd: int, data: memoryview | bytes, progress: _ByteProgress | None = None) -> None:
    view = memoryview(data).cast("B")
    for start in range(0, len(view), _CHUNK_BYTES):
        chunk = view[start:start + _CHUNK_BYTES]
        while chunk:
            chunk = chunk[os.write(fd, chunk):]
        if progress is not None:
            progress.step(min(_CHUNK_BYTES, len(view) - start))


def _copy_range(source: Path, offset: int, length: int, fd: int, progress: _ByteProgress) -> None:
    """Copy `length` bytes at `offset` of `source` to the current position of `fd` in chunks,
    inside the kernel where the platform allows (no user-space copy at all)."""
    try:
        handle = open(source, "rb", buffering=0)
    except OSError as exc:
        raise FlashNormError(f"cannot read external data {source}: {exc.strerror}") from None
    with handle:
        src = handle.fileno()
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
                data = os.pread(src, count, position)
                _write_all(fd, data)
                copied = len(data)
            if copied == 0:
                raise FlashNormError(f"external data file {source} ends before byte {offset + length}")
            remaining -= copied
            position += copied
            progress.step(copied)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


# Protobuf keys (field number << 3 | wire type 2, length-delimited) the stream writer emits.
_MODEL_GRAPH_KEY = _varint(7 << 3 | 2)  # ModelProto.graph
_GRAPH_INITIALIZER_KEY = _varint(5 << 3 | 2)  # GraphProto.initializer
_TENSOR_RAW_DATA_KEY = _varint(9 << 3 | 2)  # TensorProto.raw_data


class _Staged:
    """A file written under a temporary name beside `path`; `commit()` renames it into place,
    `discard()` removes it."""

    def __init__(self, path: Path) -> None:
        directory = path.parent if str(path.parent) else Path(".")
        if not directory.is_dir():
            raise FlashNormError(f"cannot write {path}: directory {directory} does not exist")
        try:
            self.fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
        except OSError as exc:
            raise FlashNormError(f"cannot write {path}: {exc.strerror}") from None
        self.path, self.temporary = path, Path(temporary)
        self.committed = False
        os.fchmod(self.fd, 0o666 & ~_umask())

    def commit(self) -> None:
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = -1
        os.replace(self.temporary, self.path)
        self.committed = True

    def discard(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.temporary)


class _SetAside:
    """An existing file moved to a temporary name beside it; `restore()` moves it back, `drop()`
    removes it."""

    def __init__(self, path: Path) -> None:
        fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".old.tmp", dir=path.parent)
        os.close(fd)
        try:
            os.replace(path, temporary)
        except BaseException:
            os.unlink(temporary)
            raise
        self.path, self.temporary = path, Path(temporary)

    def restore(self) -> None:
        os.replace(self.temporary, self.path)

    def drop(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.temporary)


def _umask() -> int:
    """The process umask, read without changing it where Linux allows (no race with threads)."""
    with contextlib.suppress(OSError, StopIteration, ValueError):
        with open("/proc/self/status") as status:
            return int(next(line.split()[1] for line in status if line.startswith("Umask:")), 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# --------------------------------------------------------------------------------------------
# Save


def save(graph: gs.Graph, path: str | os.PathLike[str], *, external_data: bool | None = None) -> None:
    """Save `graph` to `path` atomically.

    With external data the weights go to `<file name>.data` beside the model.
    `external_data=None` chooses it when the loaded model used external data or the
    initializers exceed ~1.8 GB. Unchanged external tensors are copied file-to-file; changed
    tensors are written from their arrays. Both files are written under temporary names and
    renamed into place (data first) only when complete; a model already at the destination is
    moved aside before, so a crash between the two renames leaves no model there rather than
    one that reads the new data at its old offsets. The input model and its data are never
    modified; saving over the input itself works. Afterwards, lazily loaded constants that
    were written to external data read from the saved data file."""
    destination = Path(path)
    constants = _all_constants(graph)
    if external_data is None:
        external_data = any(isinstance(_origin(c._values), ExternalValues) for c in constants) or (
            sum(_nbytes(c) for c in constants) > EXTERNAL_DATA_THRESHOLD
        )
    data_path = destination.with_name(destination.name + ".data")
    if external_data:
        _refuse_replacing_input_data(constants, destination, data_path)

    # External data: every initializer of the graph or a subgraph may go to the data file.
    # Inline: the main graph's initializers are streamed into the model file. Everything else
    # (attribute and function constants, small tensors) is written whole, inside the model.
    if external_data:
        streamable = {id(c) for sub in [graph, *graph.subgraphs(recursive=True)] for c in _initializers(sub)}
    else:
        streamable = {id(c) for c in _initializers(graph)}
        for sub in graph.subgraphs(recursive=True):
            streamable -= {id(c) for c in _initializers(sub)}

    originals = {id(c): c._values for c in constants}
    streams: list[_Stream] = []
    staged: list[_Staged] = []
    previous: _SetAside | None = None
    try:
        for constant in constants:
            stream = _stream(constant) if id(constant) in streamable else None
            if stream is not None and external_data and stream.nbytes < INLINE_TENSOR_BYTES:
                stream = None
            if stream is not None:
                streams.append(stream)
                constant._values = _ExportAs(stream.header)
            elif _needs_whole_proto(constant._values):
                constant._values = _ExportAs(_whole_proto(constant))

        label = f"saving {destination.name}"
        if external_data:
            data_file = _Staged(data_path)
            staged.append(data_file)
            progress = _ByteProgress(label, sum(s.nbytes for s in streams))
            _write_data_file(streams, data_file.fd, data_path.name, progress)
            model = _export(graph)
            model_file = _Staged(destination)
            staged.append(model_file)
            _write_all(model_file.fd, model.SerializeToString())
        else:
            model = _export(graph)
            model_file = _Staged(destination)
            staged.append(model_file)
            _write_inline_model(model, streams, model_file.fd, destination, label)
        if external_data and os.path.lexists(destination):
            # Between the two renames below an old model at the destination would name the new
            # data file with its own offsets, a model that silently computes something else: it
            # is moved aside first, so for that moment there is no model there instead.
            previous = _SetAside(destination)
        for file in staged:  # data first: a committed model file never names missing data
            file.commit()
        if previous is not None:
            previous.drop()
    except BaseException:
        for file in staged:
            file.discard()
        if previous is not None:
            # The old model goes back only to the data it was written with.
            if staged[0].committed:
                previous.drop()
            else:
                previous.restore()
        for constant in constants:
            constant._values = originals[id(constant)]
        raise
    if external_data:
        _rebind(constants, originals, streams, data_path.resolve(), destination.resolve())
    else:
        for constant in constants:
            constant._values = originals[id(constant)]


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
    return int(getattr(constant._values, "nbytes", 0) or 0)


def _refuse_replacing_input_data(constants: list[gs.Constant], destination: Path, data_path: Path) -> None:
    """Saving `b.onnx` must not replace `b.onnx.data` while that file holds the weights of
    a different model being saved from; replacing it when saving over that model is fine."""
    target, model = data_path.resolve(), destination.resolve()
    for constant in constants:
        values = _origin(constant._values)
        if isinstance(values, ExternalValues) and values.path.resolve() == target and values.model != model:
            raise FlashNormError(
                f"saving {destination} would replace {data_path}, the external data of input model "
                f"{values.model}; choose another output name"
            )


def _write_data_file(streams: list[_Stream], fd: int, location: str, progress: _ByteProgress) -> None:
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
    # vars(): a Graph answers unknown attributes by looking up (and logging) a function of that name.
    fields = vars(graph).get(_MODEL_FIELDS_ATTRIBUTE)
    if fields is not None:
        model.MergeFrom(fields)
    # FlashNormMatMul nodes need their reference functions as ONNX overloads, which
    # onnx-graphsurgeon cannot represent; a no-op for models without such nodes.
    from flashnorm.passes.defer import add_reference_functions

    add_reference_functions(model)
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
            pieces.append((_GRAPH_INITIALIZER_KEY + _varint(len(body)) + body, None))
        else:
            head = stream.header.SerializeToString() + _TENSOR_RAW_DATA_KEY + _varint(stream.nbytes)
            pieces.append((_GRAPH_INITIALIZER_KEY + _varint(len(head) + stream.nbytes) + head, stream))
    graph_bytes = graph.SerializeToString()
    graph_size = len(graph_bytes) + sum(len(prefix) + (s.nbytes if s else 0) for prefix, s in pieces)
    model_bytes = model.SerializeToString() + _MODEL_GRAPH_KEY + _varint(graph_size)
    total = len(model_bytes) + graph_size
    if total >= _TWO_GIB:
        raise FlashNormError(
            f"{destination} would be {total / 1e9:.2f} GB, over protobuf's 2 GiB limit; save it with external data"
        )
    progress = _ByteProgress(label, total)
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
    for constant in constants:
        original = originals[id(constant)]
        stream = written.get(id(constant))
        if stream is not None and isinstance(original, LazyValues):
            offset = int({e.key: e.value for e in stream.header.external_data}["offset"])
            constant._values = ExternalValues(stream.header, data_path, offset, stream.nbytes, model)
        elif isinstance(original, (ExternalValues, DerivedValues)):
            constant._values = LazyValues(constant._values.tensor)
        else:
            constant._values = original
