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
import struct
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

from flashnorm.errors import FlashNormError
from flashnorm.export.checks import (
    SAFETENSORS_INDEX, SAFETENSORS_SINGLE, check_model_directory, model_file, safetensors_shards,
)
from flashnorm.untrusted import InputFile, Unchanged

INDEX_NAME = SAFETENSORS_INDEX
SINGLE_NAME = SAFETENSORS_SINGLE
MAX_HEADER_BYTES = 100 << 20
"""safetensors' own limit on a header (its Rust reader refuses more)."""
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

    def check_unchanged(self) -> None:
        """Refuse (one line) if a file the tensors were read from changed since it was opened."""

    def close(self) -> None:
        pass


class SafetensorsSource(TensorSource):
    """The safetensors shards of a Hugging Face directory (single file or indexed), read a
    block of rows at a time into one reused buffer. Each shard is opened once, when the
    source is made (`flashnorm.untrusted.InputFile`: a regular file inside the directory),
    and read through that descriptor to the end; `check_unchanged()` refuses a shard, or any
    other file of the directory, that was replaced or rewritten since."""

    def __init__(self, directory: Path) -> None:
        if sys.byteorder != "little":
            raise FlashNormError("safetensors data is little-endian; this machine is not")
        self.directory = directory
        self._folder = Unchanged((path, "checkpoint file") for path in check_model_directory(directory))
        files = safetensors_shards(directory)
        if files is None:
            found = sorted(p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".safetensors"))
            hint = f" (it holds {', '.join(found)})" if found else ""
            raise FlashNormError(f"{directory} has no {SINGLE_NAME} or {INDEX_NAME}{hint}")
        self._files: dict[str, InputFile] = {}
        self._where: dict[str, tuple[str, int]] = {}  # name → (file, absolute offset of its data)
        self._buffers = BlockBuffers()
        self.shards = {}
        try:
            for file in files:
                self._files[file] = InputFile(model_file(directory, file, "safetensors shard"), "safetensors shard")
                self.shards[file] = self._index(self._files[file], file)
        except BaseException:
            self.close()
            raise

    def _index(self, shard: InputFile, file: str) -> list[TensorInfo]:
        header, data_start = _read_header(shard)
        data_size = shard.size - data_start
        infos = []
        for name, begin, end, info in sorted(_entries(header, shard.path), key=lambda entry: entry[1]):
            if name in self._where:
                raise FlashNormError(f"{shard.path}: tensor {name} is also stored in {self._where[name][0]}")
            count = 1
            for d in info.shape:
                count *= d
            if end - begin != count * info.dtype.itemsize or not 0 <= begin <= end <= data_size:
                raise FlashNormError(f"{shard.path} is not a safetensors file: {name}'s data_offsets [{begin}, {end}] "
                                     f"do not fit its shape {list(info.shape)} and the file's {data_size} data bytes")
            infos.append(info)
            self._where[name] = (file, data_start + begin)
        return infos

    def rows(self, name: str, start: int, stop: int):
        file, offset = self._where[name]
        info = self.info(name)
        shape = info.shape if not info.shape else (stop - start, *info.shape[1:])
        block = self._buffers.take("read", info.dtype, shape)
        row_bytes = block[0].numel() * info.dtype.itemsize if info.shape and shape[0] else 0
        view = memoryview(block.reshape(-1).view(_byte_dtype()).numpy())
        self._files[file].read_into(view, offset + start * row_bytes)
        return block

    def info(self, name: str) -> TensorInfo:
        file, _ = self._where[name]
        return next(i for i in self.shards[file] if i.name == name)

    def check_unchanged(self) -> None:
        """Refuse (one line) a shard, or any other file of the directory (config, tokenizer),
        replaced or rewritten since the source was made."""
        for shard in self._files.values():
            shard.check_unchanged()
        self._folder.check()

    def close(self) -> None:
        for shard in self._files.values():
            shard.close()


def _entries(header: dict[str, Any], path: Path) -> Iterator[tuple[str, int, int, TensorInfo]]:
    """(name, begin, end, info) of every tensor a safetensors header describes, each field
    checked: a dtype we read, a shape of non-negative integers, two integer data offsets."""
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            shape, offsets = entry["shape"], entry["data_offsets"]
            if not isinstance(entry["dtype"], str) or not isinstance(shape, list) or not isinstance(offsets, list):
                raise TypeError("dtype, shape and data_offsets must be a string and two lists")
            if len(offsets) != 2 or not all(type(v) is int and v >= 0 for v in [*shape, *offsets]):
                raise ValueError("shape and data_offsets must hold non-negative integers, data_offsets two")
            info = TensorInfo(name, torch_dtype(entry["dtype"]), tuple(shape))
        except (KeyError, TypeError, ValueError) as exc:
            raise FlashNormError(f"{path} is not a safetensors file: bad entry for {name} ({exc})") from None
        yield name, offsets[0], offsets[1], info


def _read_header(shard: InputFile) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file and the offset where its tensor data begins; its
    declared length checked against the file and a cap before anything is read."""
    path = shard.path
    if shard.size < 8:
        raise FlashNormError(f"{path} is not a safetensors file: shorter than 8 bytes")
    (size,) = struct.unpack("<Q", shard.read_at(0, 8))
    if size > MAX_HEADER_BYTES or 8 + size > shard.size:
        raise FlashNormError(f"{path} is not a safetensors file: a header of {size} bytes "
                             f"(the file has {shard.size}, the limit is {MAX_HEADER_BYTES})")
    try:
        header = json.loads(shard.read_at(8, size))
    except (ValueError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc).splitlines()[0]
        raise FlashNormError(f"{path} is not a safetensors file: {reason}") from None
    if not isinstance(header, dict) or not all(isinstance(v, dict) for v in header.values()):
        raise FlashNormError(f"{path} is not a safetensors file: its header is not a JSON object of objects")
    return header, 8 + size


def read_header(path: Path) -> dict[str, Any]:
    """The JSON header of the safetensors file at `path` (checked as the fold reads it)."""
    shard = InputFile(path, "safetensors file")
    try:
        return _read_header(shard)[0]
    finally:
        shard.close()


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
