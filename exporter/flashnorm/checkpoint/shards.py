"""Safetensors shards read and written one tensor (and one block of rows) at a time.

Both directions are our own code over the format (an 8-byte header size, a JSON header of
names, dtypes, shapes and byte offsets, then the little-endian data): a block of rows is read
with positioned reads, and written as produced, since the header is known before any data.

Every block lives in a `BlockBuffers` slot that is reused for the next block. A fresh tensor
per block is what glibc serves from heaps it seldom gives back once its mmap threshold has
risen (it grows to 32 MB as large blocks are freed): folding a 1056 MB checkpoint that way
grew the peak by the whole checkpoint in most runs on one machine and in 2 of 9 on another.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

from flashnorm.errors import FlashNormError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
BLOCK_BYTES = 64 << 20
"""Rows are read, folded (in float64) and written in blocks of about this many bytes."""

_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}


def torch_dtype(code: str):
    import torch

    if code not in _DTYPES:
        raise FlashNormError(f"safetensors dtype {code} is not supported")
    return getattr(torch, _DTYPES[code])


def dtype_code(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    for code, torch_name in _DTYPES.items():
        if torch_name == name:
            return code
    raise FlashNormError(f"dtype {name} cannot be stored in safetensors")


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: Any
    """torch dtype as stored."""
    shape: tuple[int, ...]


class BlockBuffers:
    """Named byte buffers reused from block to block; a buffer grows only when a block does
    not fit, so a fold allocates a few buffers, not one tensor per block."""

    def __init__(self) -> None:
        self._slots: dict[str, Any] = {}

    def take(self, slot: str, dtype: Any, shape: tuple[int, ...]):
        """An uninitialized tensor of `dtype` and `shape` in buffer `slot`; it is overwritten
        by the next `take` of the same slot."""
        import torch

        count = 1
        for d in shape:
            count *= d
        nbytes = count * dtype.itemsize
        buffer = self._slots.get(slot)
        if buffer is None or buffer.numel() < nbytes:
            self._slots.pop(slot, None)
            buffer = self._slots[slot] = torch.empty(max(nbytes, BLOCK_BYTES), dtype=torch.uint8)
        return buffer[:nbytes].view(dtype).view(shape)


class TensorSource:
    """Tensors by name, readable in blocks of rows, grouped into output shards."""

    shards: dict[str, list[TensorInfo]]
    """Shard file name → its tensors, in stored order."""

    def rows(self, name: str, start: int, stop: int):
        """Rows start:stop of tensor `name` (the whole tensor for a 0-d one). The result may
        live in a buffer that the next call overwrites: use it, or copy it, before then."""
        raise NotImplementedError

    def info(self, name: str) -> TensorInfo:
        for tensors in self.shards.values():
            for info in tensors:
                if info.name == name:
                    return info
        raise KeyError(name)

    def read(self, name: str):
        """All of tensor `name`, in memory of its own."""
        info = self.info(name)
        return self.rows(name, 0, info.shape[0] if info.shape else 0).clone()

    def close(self) -> None:
        pass


class SafetensorsSource(TensorSource):
    """The safetensors shards of a Hugging Face directory (single file or indexed), read a
    block of rows at a time into one reused buffer; one shard file is open at a time."""

    def __init__(self, directory: Path) -> None:
        if sys.byteorder != "little":
            raise FlashNormError("safetensors data is little-endian; this machine is not")
        self.directory = directory
        index = directory / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise FlashNormError(f"{index} is not a safetensors index: {exc}") from None
            files = list(dict.fromkeys(weight_map.values()))
        elif (directory / SINGLE_NAME).is_file():
            files = [SINGLE_NAME]
        else:
            found = sorted(p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".safetensors"))
            hint = f" (it holds {', '.join(found)})" if found else ""
            raise FlashNormError(f"{directory} has no {SINGLE_NAME} or {INDEX_NAME}{hint}")
        self._open: tuple[str, int] | None = None
        self._where: dict[str, tuple[str, int]] = {}  # name → (file, absolute offset of its data)
        self._buffers = BlockBuffers()
        self.shards = {}
        for file in files:
            path = directory / file
            if not path.is_file():
                raise FlashNormError(f"{path} is listed in the index but does not exist")
            self.shards[file] = self._index(path, file)

    def _index(self, path: Path, file: str) -> list[TensorInfo]:
        header, data_start = read_header(path, with_data_start=True)
        data_size = path.stat().st_size - data_start
        infos = []
        for name in sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0]):
            try:
                info = TensorInfo(name, torch_dtype(header[name]["dtype"]), tuple(int(d) for d in header[name]["shape"]))
                begin, end = (int(o) for o in header[name]["data_offsets"])
            except (KeyError, TypeError, ValueError) as exc:
                raise FlashNormError(f"{path} is not a safetensors file: bad entry for {name} ({exc})") from None
            count = 1
            for d in info.shape:
                count *= d
            if end - begin != count * info.dtype.itemsize or not 0 <= begin <= end <= data_size:
                raise FlashNormError(f"{path} is not a safetensors file: {name}'s data_offsets [{begin}, {end}] do not "
                                     f"fit its shape {list(info.shape)} and the file's {data_size} data bytes")
            infos.append(info)
            self._where[name] = (file, data_start + begin)
        return infos

    def _descriptor(self, file: str) -> int:
        if self._open is None or self._open[0] != file:
            self.close()
            self._open = (file, os.open(self.directory / file, os.O_RDONLY))
        return self._open[1]

    def rows(self, name: str, start: int, stop: int):
        file, offset = self._where[name]
        info = self.info(name)
        shape = info.shape if not info.shape else (stop - start, *info.shape[1:])
        block = self._buffers.take("read", info.dtype, shape)
        row_bytes = block[0].numel() * info.dtype.itemsize if info.shape and shape[0] else 0
        _read_exactly(self._descriptor(file), block, offset + start * row_bytes, self.directory / file)
        return block

    def info(self, name: str) -> TensorInfo:
        file, _ = self._where[name]
        return next(i for i in self.shards[file] if i.name == name)

    def close(self) -> None:
        if self._open is not None:
            descriptor, self._open = self._open[1], None
            os.close(descriptor)


def _read_exactly(descriptor: int, block: Any, offset: int, path: Path) -> None:
    view = memoryview(block.reshape(-1).view(_byte_dtype()).numpy())
    done = 0
    while done < len(view):
        count = os.preadv(descriptor, [view[done:]], offset + done)
        if count == 0:
            raise FlashNormError(f"{path} ended early: it was truncated while being read")
        done += count


def read_header(path: Path, *, with_data_start: bool = False) -> Any:
    """The JSON header of the safetensors file at `path`; with `with_data_start`, also the
    file offset where tensor data begins."""
    with open(path, "rb") as handle:
        raw = handle.read(8)
        if len(raw) != 8:
            raise FlashNormError(f"{path} is not a safetensors file: shorter than 8 bytes")
        (size,) = struct.unpack("<Q", raw)
        if size > 100 << 20:
            raise FlashNormError(f"{path} is not a safetensors file: header of {size} bytes")
        try:
            header = json.loads(handle.read(size))
        except ValueError as exc:
            raise FlashNormError(f"{path} is not a safetensors file: {exc}") from None
    if not isinstance(header, dict):
        raise FlashNormError(f"{path} is not a safetensors file: its header is not a JSON object")
    return (header, 8 + size) if with_data_start else header


class StateDictSource(TensorSource):
    """Tensors already in memory (a model loaded from GGUF), as one shard; a tensor that is
    another's storage (a tied LM head) is kept once, under its first name."""

    def __init__(self, state: dict[str, Any], shard_name: str = SINGLE_NAME) -> None:
        self._state: dict[str, Any] = {}
        seen: set[tuple[int, tuple[int, ...]]] = set()
        for name, tensor in state.items():
            key = (tensor.data_ptr(), tuple(tensor.shape))
            if tensor.numel() and key in seen:
                continue
            seen.add(key)
            self._state[name] = tensor.detach()
        self.shards = {shard_name: [TensorInfo(n, t.dtype, tuple(t.shape)) for n, t in self._state.items()]}

    def rows(self, name: str, start: int, stop: int):
        tensor = self._state[name]
        return tensor if tensor.ndim == 0 else tensor[start:stop]


@dataclasses.dataclass
class Planned:
    """One tensor of an output shard: what it is called and stored as, and where its rows
    come from (`produce(start, stop)` gives rows already in `dtype`)."""

    name: str
    dtype: Any
    shape: tuple[int, ...]
    produce: Callable[[int, int], Any]

    @property
    def nbytes(self) -> int:
        count = 1
        for d in self.shape:
            count *= d
        return count * self.dtype.itemsize


def row_blocks(shape: tuple[int, ...], itemsize: int = 8) -> Iterator[tuple[int, int]]:
    """(start, stop) row ranges of about BLOCK_BYTES each (at `itemsize` bytes an element)."""
    if not shape:
        yield 0, 0
        return
    row = itemsize
    for d in shape[1:]:
        row *= d
    step = max(1, BLOCK_BYTES // max(row, 1))
    for start in range(0, shape[0], step):
        yield start, min(shape[0], start + step)


def write_shard(path: Path, tensors: list[Planned], progress: Callable[[int], None] = lambda n: None) -> int:
    """Write `tensors` to a new safetensors file at `path`, block by block; returns the bytes
    of tensor data written."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": dtype_code(t.dtype), "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "xb") as handle:
        handle.write(struct.pack("<Q", len(encoded)))
        handle.write(encoded)
        for t in tensors:
            written = 0
            for start, stop in row_blocks(t.shape):
                block = t.produce(start, stop)
                if block.dtype != t.dtype:
                    raise AssertionError(f"{t.name}: produced {block.dtype}, planned {t.dtype}")
                data = block.contiguous().reshape(-1).view(_byte_dtype()).numpy()
                handle.write(data)
                written += data.nbytes
                progress(data.nbytes)
            if written != t.nbytes:
                raise AssertionError(f"{t.name}: wrote {written} bytes, planned {t.nbytes}")
    return offset


def _byte_dtype():
    import torch

    return torch.uint8
