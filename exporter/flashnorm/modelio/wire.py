"""A protobuf wire-format reader for ONNX model files, one initializer at a time, and the
few keys the streaming writer emits.

`ParseFromString` needs the whole file in memory next to the parsed model; these functions
read a model file field by field instead, so that loading an inline model peaks at the model
plus its largest tensor.
"""

from __future__ import annotations

import os
from typing import IO, Callable, Iterator

import onnx
from google.protobuf.message import DecodeError

# Protobuf's limit on one serialized message: an inline model file must stay below it.
PROTOBUF_LIMIT = 2**31


class Truncated(Exception):
    """The file ends inside a protobuf field."""


# How many fields one message of the file may hold before it is refused: a hostile file of tiny
# fields (a sparse file of zeros is one long run of them) is walked at about 1.4 µs a field, so
# these bound the walk to a few seconds. Real models stay far below: a model's own fields are a
# dozen plus its functions and metadata; a graph's are its nodes, inputs, outputs, value infos
# and initializers (SmolLM2-135M: about 2 300).
MAX_MODEL_FIELDS = 1 << 16
MAX_GRAPH_FIELDS = 1 << 21

_MODEL_FIELDS = frozenset(f.number for f in onnx.ModelProto.DESCRIPTOR.fields)
_GRAPH_FIELDS = frozenset(f.number for f in onnx.GraphProto.DESCRIPTOR.fields)


def _read_exact(handle: IO[bytes], size: int, end: int) -> bytes:
    """`size` bytes, refused without reading them if they would run past `end`."""
    if handle.tell() + size > end:
        raise Truncated
    data = handle.read(size)
    if len(data) != size:
        raise Truncated
    return data


def _skip(handle: IO[bytes], size: int, end: int) -> None:
    if handle.tell() + size > end:
        raise Truncated
    handle.seek(size, os.SEEK_CUR)


def _read_key_and_length(handle: IO[bytes]) -> tuple[int, int, bytes] | None:
    """The next field's number and wire type, and its key bytes; None at the end of the file."""
    raw = bytearray()
    while True:
        byte = handle.read(1)
        if not byte:
            if raw:
                raise Truncated
            return None
        raw += byte
        if not byte[0] & 0x80:
            break
        if len(raw) > 10:
            raise DecodeError("varint too long")
    key = _decode_varint(raw)
    if key >> 3 == 0:
        raise DecodeError("field number 0")
    return key >> 3, key & 7, bytes(raw)


def _decode_varint(raw: bytes | bytearray) -> int:
    return sum((byte & 0x7F) << (7 * i) for i, byte in enumerate(raw))


def _read_varint(handle: IO[bytes]) -> tuple[int, bytes]:
    raw = bytearray()
    while True:
        byte = handle.read(1)
        if not byte:
            raise Truncated
        raw += byte
        if not byte[0] & 0x80:
            return _decode_varint(raw), bytes(raw)
        if len(raw) > 10:
            raise DecodeError("varint too long")


def _read_field(handle: IO[bytes], wire_type: int, end: int) -> tuple[bytes, int]:
    """The rest of a field after its key: (its bytes up to the payload, payload length), with
    the payload itself still unread for length-delimited fields, read for the others."""
    if wire_type == 0:
        return _read_varint(handle)[1], 0
    if wire_type in (1, 5):
        return _read_exact(handle, 8 if wire_type == 1 else 4, end), 0
    if wire_type == 2:
        length, raw = _read_varint(handle)
        if handle.tell() + length > end:
            raise Truncated
        return raw, length
    raise DecodeError(f"unsupported wire type {wire_type}")


def read_model(
    handle: IO[bytes], end: int, on_bytes: Callable[[int], None], initializer_headers_only: bool = False
) -> onnx.ModelProto:
    """Parse a ModelProto from a file of `end` bytes, one initializer at a time.

    `ParseFromString` needs the whole file in memory next to the parsed model: an inline model
    held twice. Here every field except the graph's initializers is gathered as bytes (small)
    and merged at the end; each initializer is read and parsed on its own, straight into the
    model, so the peak is the model plus its largest tensor. With `initializer_headers_only` an
    initializer keeps its name, type and shape and its payload is skipped unread. `on_bytes` is
    told the size of each initializer read.

    The file is untrusted: a length is checked against what is left of its message and of the
    file before anything is read or allocated, fields ONNX does not define are skipped unread,
    and a message with more than MAX_MODEL_FIELDS / MAX_GRAPH_FIELDS fields is refused
    (DecodeError), so the work is bounded by the file's size and those counts."""
    model = onnx.ModelProto()
    model_rest, graph_rest = bytearray(), bytearray()
    fields = 0
    while (field := _read_key_and_length(handle)) is not None:
        fields += 1
        if fields > MAX_MODEL_FIELDS:
            raise DecodeError(f"more than {MAX_MODEL_FIELDS} fields in the model")
        number, wire_type, key = field
        head, length = _read_field(handle, wire_type, end)
        if number not in _MODEL_FIELDS:
            _skip(handle, length, end)
            continue
        if number != 7 or wire_type != 2:  # anything but ModelProto.graph
            model_rest += key + head + _read_exact(handle, length, end)
            continue
        graph_end = handle.tell() + length
        graph_fields = 0
        for inner_number, inner_type, inner_key, inner_head, inner_length in _embedded_fields(
            handle, graph_end, "graph field"
        ):
            graph_fields += 1
            if graph_fields > MAX_GRAPH_FIELDS:
                raise DecodeError(f"more than {MAX_GRAPH_FIELDS} fields in the graph")
            if inner_number not in _GRAPH_FIELDS:
                _skip(handle, inner_length, graph_end)
            elif inner_number == 5 and inner_type == 2 and initializer_headers_only:
                model.graph.initializer.add().ParseFromString(
                    _read_tensor_header(handle, handle.tell() + inner_length, graph_end))
            elif inner_number == 5 and inner_type == 2:  # GraphProto.initializer
                model.graph.initializer.add().ParseFromString(_read_exact(handle, inner_length, graph_end))
                on_bytes(inner_length)
            else:
                graph_rest += inner_key + inner_head + _read_exact(handle, inner_length, graph_end)
    if graph_rest:
        model.graph.MergeFromString(bytes(graph_rest))
    model.MergeFromString(bytes(model_rest))
    return model


# TensorProto fields that hold the values: float_data, int32_data, string_data, int64_data,
# raw_data, double_data, uint64_data.
_TENSOR_PAYLOAD_FIELDS = frozenset({4, 5, 6, 7, 9, 10, 11})


def _read_tensor_header(handle: IO[bytes], tensor_end: int, limit: int) -> bytes:
    """A serialized TensorProto without its values (name, data type, dims, external-data
    location kept); leaves `handle` at `tensor_end`."""
    if tensor_end > limit:
        raise Truncated
    header = bytearray()
    for number, _, key, head, length in _embedded_fields(handle, tensor_end, "initializer"):
        if number in _TENSOR_PAYLOAD_FIELDS:
            _skip(handle, length, tensor_end)
        else:
            header += key + head + _read_exact(handle, length, tensor_end)
    return bytes(header)


def _embedded_fields(handle: IO[bytes], field_end: int, what: str) -> Iterator[tuple[int, int, bytes, bytes, int]]:
    """The fields of an embedded message ending at `field_end`: (number, wire type, key bytes,
    bytes up to the payload, payload length). The caller reads or skips each payload before
    asking for the next field."""
    while handle.tell() < field_end:
        field = _read_key_and_length(handle)
        if field is None:
            raise Truncated
        number, wire_type, key = field
        head, length = _read_field(handle, wire_type, field_end)
        yield number, wire_type, key, head, length
    if handle.tell() != field_end:
        raise DecodeError(f"{what} length does not match its content")


def varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


# Protobuf keys (field number << 3 | wire type 2, length-delimited) the stream writer emits.
MODEL_GRAPH_KEY = varint(7 << 3 | 2)  # ModelProto.graph
GRAPH_INITIALIZER_KEY = varint(5 << 3 | 2)  # GraphProto.initializer
TENSOR_RAW_DATA_KEY = varint(9 << 3 | 2)  # TensorProto.raw_data
