"""What a model source's files may name and hold, checked before transformers or our own
readers open them (docs/SECURITY.md): every file at the top of a Hugging Face directory a
regular file inside it, its config and index small well-formed JSON, every shard an index
names a plain file name of a regular file in the directory, a GGUF file's header counts and
lengths inside the file. Each refusal is one line (`FlashNormError`)."""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

from flashnorm.errors import FlashNormError
from flashnorm.untrusted import InputFile, confined, read_json, regular_identity

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"


def hub_blobs(directory: Path) -> list[Path]:
    """Where a Hugging Face cache snapshot's symlinks lead: `.../models--ORG--NAME/snapshots/REV`
    holds only symlinks into `.../models--ORG--NAME/blobs`, which is that same download."""
    folder = Path(os.path.realpath(directory))
    if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith(("models--", "datasets--")):
        return [folder.parent.parent / "blobs"]
    return []


def model_file(directory: Path, name: str, what: str, missing: str = "") -> Path:
    """The regular file `name` (found inside a file, or a fixed name) of a model directory:
    confined to it after resolving symlinks (a Hugging Face cache snapshot may lead into its
    blobs), a regular file (never a FIFO or device: one line, no wait). `missing`: the line
    for a file that does not exist."""
    path = confined(name, directory, what, also_within=hub_blobs(directory))
    if not path.exists():
        raise FlashNormError(missing or f"{what} {name!r} does not exist in {directory}")
    regular_identity(path, what)
    return path


def check_model_directory(directory: Path) -> list[Path]:
    """Every file at the top of a model directory, which transformers (and fold-checkpoint,
    which copies them) may read: a regular file inside it, or a symlink resolving inside it
    (or a Hugging Face cache snapshot's blobs). A FIFO, socket or device node, or a symlink
    out of the folder, is refused with one line naming it; subfolders are not read. Returns
    the files, resolved."""
    try:
        entries = sorted(os.scandir(directory), key=lambda entry: entry.name)
    except OSError as exc:
        raise FlashNormError(f"cannot list model directory {directory}: {exc.strerror}") from None
    files = []
    for entry in entries:
        path = Path(entry.path)
        if path.is_dir() or not path.exists():
            continue  # folders are not read; a dangling symlink is the reader's "missing file"
        files.append(model_file(directory, entry.name, "model file"))
    return files


def safetensors_shards(directory: Path) -> list[str] | None:
    """The safetensors files a Hugging Face directory's weights are in, in index order: the
    shards `model.safetensors.index.json` maps tensors to, else `model.safetensors`; None if
    it has neither. A shard name is data: it must be a plain file name of a regular file in
    the directory (never absolute, never `..`, no NUL, no symlink out); the index must be
    {"weight_map": {tensor name: file name}}. Each violation is one line."""
    index = directory / SAFETENSORS_INDEX
    if os.path.lexists(index):
        raw = read_json(model_file(directory, SAFETENSORS_INDEX, "safetensors index"), "safetensors index")
        weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(weight_map, dict) or not all(
                isinstance(name, str) and isinstance(file, str) for name, file in weight_map.items()):
            raise FlashNormError(f"{index} is not a safetensors index: its 'weight_map' must map tensor names "
                                 "to file names")
        files = list(dict.fromkeys(weight_map.values()))
        for file in files:
            if "/" in file or "\\" in file:
                confined(file, directory, f"shard {file!r} of {index}")  # the specific refusal first
                raise FlashNormError(f"{index} names shard {file!r}, not a file name in {directory}")
            model_file(directory, file, f"shard named by {index}",
                       missing=f"{directory / file} is listed in the index but does not exist")
        return files
    if os.path.lexists(directory / SAFETENSORS_SINGLE):
        model_file(directory, SAFETENSORS_SINGLE, "weights file")
        return [SAFETENSORS_SINGLE]
    return None


# GGUF value types (gguf's GGUFValueType) and the bytes of each fixed-size one.
_GGUF_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_MAX_DIMS = 8  # ggml has 4; a few to spare, never millions


class _Header:
    """A cursor over a GGUF file's bytes: each read checked against the end of the file."""

    def __init__(self, data: memoryview | mmap.mmap, path: Path, size_bytes: int) -> None:
        self.data, self.path, self.at, self.size, self.wide = data, path, 0, size_bytes, True

    def refuse(self, reason: str) -> FlashNormError:
        return FlashNormError(f"{self.path} is not a GGUF file flashnorm reads: {reason}")

    def take(self, count: int) -> int:
        start = self.at
        if count < 0 or start + count > self.size:
            raise self.refuse(f"a field at byte {start} runs past the end of the file ({self.size} bytes)")
        self.at += count
        return start

    def number(self, form: str) -> int:
        return struct.unpack_from(form, self.data, self.take(struct.calcsize(form)))[0]

    def count(self) -> int:
        return self.number("<Q" if self.wide else "<I")

    def skip_string(self) -> None:
        self.take(self.count())

    def skip_value(self, kind: int, depth: int = 0) -> None:
        if kind in _GGUF_FIXED:
            self.take(_GGUF_FIXED[kind])
        elif kind == _GGUF_STRING:
            self.skip_string()
        elif kind == _GGUF_ARRAY and depth < 2:
            item, items = self.number("<I"), self.count()
            if item in _GGUF_FIXED:
                self.take(items * _GGUF_FIXED[item])
            elif items > (self.size - self.at) // 8:  # every string or array item holds a length
                raise self.refuse(f"an array of {items} items at byte {self.at} cannot fit in the file")
            else:
                for _ in range(items):
                    self.skip_value(item, depth + 1)
        else:
            raise self.refuse(f"unknown value type {kind} at byte {self.at}")


def check_gguf(path: Path) -> None:
    """A GGUF file's header walked before the gguf package reads it: magic, version, and every
    key, value and tensor description inside the file (counts and lengths never trusted: a
    count of 2**63 items, or a string longer than the file, is one line, not a long loop or an
    allocation). The tensor data itself is read by transformers."""
    source = InputFile(path, "GGUF file")
    try:
        if source.size < 24:
            raise FlashNormError(f"{path} is not a GGUF file: {source.size} bytes")
        with mmap.mmap(source.fd, 0, access=mmap.ACCESS_READ) as data:
            header = _Header(data, path, source.size)
            if bytes(data[:4]) != b"GGUF":
                raise FlashNormError(f"{path} is not a GGUF file: it does not start with 'GGUF'")
            header.take(4)
            version = header.number("<I")
            if version not in (1, 2, 3):
                raise header.refuse(f"version {version} (flashnorm reads 1 to 3, little-endian)")
            header.wide = version >= 2
            tensors, values = header.count(), header.count()
            if values * 13 + tensors * 24 > source.size:  # the least a key-value pair and a tensor description take
                raise header.refuse(f"{tensors} tensors and {values} key-value pairs cannot fit "
                                    f"in {source.size} bytes")
            for _ in range(values):
                header.skip_string()
                header.skip_value(header.number("<I"))
            for _ in range(tensors):
                header.skip_string()
                dims = header.number("<I")
                if dims > _GGUF_MAX_DIMS:
                    raise header.refuse(f"a tensor of {dims} dimensions at byte {header.at}")
                header.take(dims * 8 + 4)
                if header.number("<Q") > source.size:
                    raise header.refuse("a tensor's data offset lies past the end of the file")
    finally:
        source.close()
