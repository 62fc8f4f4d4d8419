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


# How many fields one message of the file may hold before it is refused. A hostile file of tiny
# fields (valid protobuf: the same field again and again) is walked at about 1.3 µs a field, so
# these bound the walk to about 1.4 s (2026-12-07, a 2-core Intel Xeon, shared). Real
# models stay far below: a model's own fields are a dozen plus its functions and metadata; a
# graph's are its nodes, inputs, outputs, value infos and initializers (SmolLM2-135M's export:
# 15 373; a 126-layer model of the same spelling would have about 65 000).
MAX_MODEL_FIELDS = 1 << 16
MAX_GRAPH_FIELDS = 1 << 20

_MODEL_FIELDS = frozenset(f.number for f in onnx.ModelProto.DESCRIPTOR.fields)
_GRAPH_FIELDS = frozenset(f.number for f in onnx.GraphProto.DESCRIPTOR.fields)


def _read_exact(handle: IO[bytes], size: int) -> bytes:
    data = handle.read(size)
    if len(data) != size:
        raise Truncated
    return data


def _varint(handle: IO[bytes]) -> tuple[int, bytes] | None:
    """The next varint's value and bytes; None at the end of the file."""
    raw = handle.read(1)
    if not raw:
        return None
    value = raw[0]
    if value < 0x80:  # the usual case: keys and small lengths
        return value, raw
    value &= 0x7F
    collected = bytearray(raw)
    while True:
        byte = handle.read(1)
        if not byte:
            raise Truncated
        collected += byte
        value |= (byte[0] & 0x7F) << (7 * (len(collected) - 1))
        if byte[0] < 0x80:
            return value, bytes(collected)
        if len(collected) >= 10:
            raise DecodeError("varint too long")


def _fields(handle: IO[bytes], start: int, end: int, what: str, limit: int) -> Iterator[tuple[int, int, bytes, int]]:
    """The fields of the message in bytes `start`..`end` of the file (`handle` at `start`):
    (number, wire type, its bytes up to the payload, payload length), each checked to end
    inside the message before it is yielded. The caller reads or skips each payload (exactly
    its length) before asking for the next field; positions are counted, not asked of the file."""
    position, count = start, 0
    while position < end:
        count += 1
        if count > limit:
            raise DecodeError(f"more than {limit} fields in the {what}")
        key = _varint(handle)
        if key is None:
            raise Truncated
        value, head = key
        number, wire_type = value >> 3, value & 7
        if number == 0:
            raise DecodeError("field number 0")
        length = 0
        if wire_type in (0, 2):
            second = _varint(handle)
            if second is None:
                raise Truncated
            head += second[1]
            length = second[0] if wire_type == 2 else 0
        elif wire_type in (1, 5):
            head += _read_exact(handle, 8 if wire_type == 1 else 4)
        else:
            raise DecodeError(f"unsupported wire type {wire_type}")
        position += len(head)
        if position + length > end:
            raise Truncated
        yield number, wire_type, head, length
        position += length
    if position != end:
        raise DecodeError(f"{what} length does not match its content")


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
    for number, wire_type, head, length in _fields(handle, handle.tell(), end, "model", MAX_MODEL_FIELDS):
        if number not in _MODEL_FIELDS:
            handle.seek(length, os.SEEK_CUR)
        elif number != 7 or wire_type != 2:  # anything but ModelProto.graph
            model_rest += head + _read_exact(handle, length)
        else:
            graph_start = handle.tell()
            for inner_number, inner_type, inner_head, inner_length in _fields(
                    handle, graph_start, graph_start + length, "graph", MAX_GRAPH_FIELDS):
                if inner_number not in _GRAPH_FIELDS:
                    handle.seek(inner_length, os.SEEK_CUR)
                elif inner_number == 5 and inner_type == 2 and initializer_headers_only:
                    model.graph.initializer.add().ParseFromString(_read_tensor_header(handle, inner_length))
                elif inner_number == 5 and inner_type == 2:  # GraphProto.initializer
                    model.graph.initializer.add().ParseFromString(_read_exact(handle, inner_length))
                    on_bytes(inner_length)
                else:
                    graph_rest += inner_head + _read_exact(handle, inner_length)
    if graph_rest:
        model.graph.MergeFromString(bytes(graph_rest))
    model.MergeFromString(bytes(model_rest))
    return model


# TensorProto fields that hold the values: float_data, int32_data, string_data, int64_data,
# raw_data, double_data, uint64_data.
_TENSOR_PAYLOAD_FIELDS = frozenset({4, 5, 6, 7, 9, 10, 11})


def _read_tensor_header(handle: IO[bytes], length: int) -> bytes:
    """A serialized TensorProto of `length` bytes without its values (name, data type, dims,
    external-data location kept); leaves `handle` after it."""
    header = bytearray()
    start = handle.tell()
    for number, _, head, payload in _fields(handle, start, start + length, "initializer", MAX_GRAPH_FIELDS):
        if number in _TENSOR_PAYLOAD_FIELDS:
            handle.seek(payload, os.SEEK_CUR)
        else:
            header += head + _read_exact(handle, payload)
    return bytes(header)


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
