"""Reading files FlashNorm does not trust: every model, data file, checkpoint and report it reads.

Three rules, kept here once for every reader (docs/SECURITY.md says which reader uses which):

- **Regular files only, never a wait.** `InputFile` opens with `O_NONBLOCK` (a FIFO with no
  writer does not block the open) and checks `S_ISREG` on the opened descriptor, so a FIFO,
  socket, device node or folder is refused at once, whatever name it was reached through.
- **A path read from inside a file is data.** `confined` turns a name found inside a file (an
  external-data location, a shard name) into a path only if it is relative, holds no NUL byte
  and no `..`, and still lies inside its folder once every symlink is resolved (ONNX Runtime's
  rule for external data; `tar --no-absolute-names`).
- **One version of each input.** An `InputFile` records its identity (device, inode, size,
  mtime) when opened and reads through that one descriptor; `check_unchanged` (and `Unchanged`
  for files read by others, such as TensorRT's parser) refuses an input that was replaced or
  rewritten since, before any output is committed.

Standard library only; every refusal is a one-line `FlashNormError`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import stat
import weakref
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, Iterable

from flashnorm.errors import FlashNormError

MAX_JSON_BYTES = 64 << 20
"""A JSON file of a model (config, index) larger than this is refused unread (a config is a few
kB; an index holds one short line per tensor)."""


@dataclasses.dataclass(frozen=True)
class Identity:
    """What says a file is still the one that was read: a rename or a rewrite changes it."""

    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, status: os.stat_result) -> Identity:
        return cls(status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns)

    def difference(self, now: Identity) -> str:
        """How `now` differs from this identity, in words ("" if it does not)."""
        if (now.device, now.inode) != (self.device, self.inode):
            return "it was replaced by another file"
        if now.size != self.size:
            return f"its size went from {self.size} to {now.size} bytes"
        if now.mtime_ns != self.mtime_ns:
            return "it was rewritten"
        return ""


def kind(mode: int) -> str:
    """A file type in words, for refusals ("a FIFO"); "" for a regular file."""
    for test, words in ((stat.S_ISREG, ""), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                        (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                        (stat.S_ISBLK, "a block device"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return words
    return "not a regular file"


def _refuse(what: str, path: str | os.PathLike[str], reason: str) -> FlashNormError:
    return FlashNormError(f"{what} {os.fspath(path)} {reason}")


def regular_identity(path: str | os.PathLike[str], what: str) -> Identity:
    """The identity of the regular file at `path` (symlinks followed), without opening it;
    FlashNormError (one line) for a missing file or one that is not regular."""
    try:
        status = os.stat(path)
    except ValueError:  # a NUL byte in the name
        raise _refuse(what, repr(os.fspath(path)), "is not a usable file name (it holds a NUL byte)") from None
    except OSError as exc:
        raise _refuse(what, path, f"cannot be read: {exc.strerror}") from None
    if not stat.S_ISREG(status.st_mode):
        raise _refuse(what, path, f"is {kind(status.st_mode)}, not a regular file")
    return Identity.of(status)


class InputFile:
    """A regular file opened once for reading; every read goes through this one descriptor.

    The open never blocks (`O_NONBLOCK`: a FIFO without a writer would wait forever) and the
    opened descriptor must be a regular file. `identity` is recorded at the open;
    `check_unchanged()` refuses the file if its path now leads to another file, or the file
    was rewritten in place. With `within`, the file actually opened must lie inside that
    folder (checked on the descriptor, so a symlink swapped in after `confined` is caught).
    The descriptor is closed by `close()` or when the object is collected."""

    def __init__(self, path: str | os.PathLike[str], what: str, *, within: Path | None = None) -> None:
        self.path, self.what = Path(path), what
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)
        try:
            fd = os.open(self.path, flags)
        except ValueError:
            raise _refuse(what, repr(os.fspath(path)), "is not a usable file name (it holds a NUL byte)") from None
        except OSError as exc:
            with contextlib.suppress(OSError):  # a socket cannot be opened at all: say what it is
                mode = os.stat(self.path).st_mode
                if not stat.S_ISREG(mode):
                    raise _refuse(what, path, f"is {kind(mode)}, not a regular file") from None
            raise _refuse(what, path, f"cannot be read: {exc.strerror}") from None
        self.fd = fd
        self._closer = weakref.finalize(self, os.close, fd)
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            self.close()
            raise _refuse(what, path, f"is {kind(status.st_mode)}, not a regular file")
        if within is not None:
            opened = _opened_path(fd)
            if opened is not None and not _inside(opened, Path(os.path.realpath(within))):
                self.close()
                raise _refuse(what, path, f"leads to {opened}, outside {within}")
        self.identity = Identity.of(status)

    @property
    def size(self) -> int:
        return self.identity.size

    def read_at(self, offset: int, length: int) -> bytes:
        """Exactly `length` bytes at `offset`; one line if the file ends before."""
        data = bytearray(length)
        self.read_into(memoryview(data), offset)
        return bytes(data)

    def read_into(self, buffer: memoryview, offset: int) -> None:
        """Fill `buffer` (bytes) from `offset`; one line if the file ends before it is full."""
        view = buffer.cast("B") if buffer.format != "B" or buffer.ndim != 1 else buffer
        done = 0
        while done < len(view):
            try:
                count = os.preadv(self.fd, [view[done:]], offset + done)
            except OSError as exc:
                raise _refuse(self.what, self.path, f"cannot be read: {exc.strerror}") from None
            if count == 0:
                raise _refuse(self.what, self.path, f"ends before byte {offset + len(view)} "
                                                    f"(it has {os.fstat(self.fd).st_size}; was it truncated?)")
            done += count

    def changed(self) -> str:
        """How the file differs from when it was opened ("" if it does not): another file at
        its path, or this one rewritten."""
        try:
            at_path = Identity.of(os.stat(self.path))
        except OSError:
            return "it was removed"
        return self.identity.difference(at_path) or self.identity.difference(Identity.of(os.fstat(self.fd)))

    def check_unchanged(self) -> None:
        how = self.changed()
        if how:
            raise _refuse(self.what, self.path, f"changed while flashnorm was reading it ({how}); nothing was written")

    def close(self) -> None:
        self._closer()


def read_json(path: str | os.PathLike[str], what: str) -> Any:
    """A small JSON file of a model (config, index, genai_config.json), read once through an
    `InputFile`, bounded by `MAX_JSON_BYTES`; any failure one line."""
    source = InputFile(path, what)
    try:
        if source.size > MAX_JSON_BYTES:
            raise FlashNormError(f"{what} {path} is {source.size} bytes; "
                                 f"a {what} over {MAX_JSON_BYTES} bytes is refused")
        return json.loads(source.read_at(0, source.size))
    except (ValueError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc).splitlines()[0]
        raise FlashNormError(f"{what} {path} is not readable JSON: {reason}") from None
    finally:
        source.close()


class Unchanged:
    """Identities of files read by someone else (TensorRT's parser, ONNX Runtime), taken
    before they read them; `check()` refuses any file that changed since."""

    def __init__(self, files: Iterable[tuple[str | os.PathLike[str], str]]) -> None:
        self.files = [(Path(path), what, regular_identity(path, what)) for path, what in files]

    def check(self) -> None:
        for path, what, before in self.files:
            try:
                how = before.difference(Identity.of(os.stat(path)))
            except OSError:
                how = "it was removed"
            if how:
                raise _refuse(what, path, f"changed while flashnorm was reading it ({how}); nothing was written")


def confined(name: str, folder: Path, what: str, *, also_within: Iterable[Path] = ()) -> Path:
    """The path `name` (read from inside a file) names in `folder`, with every symlink resolved.

    Refused with one line: an empty name, a NUL byte, an absolute name (POSIX or Windows), a
    `..` part, and a name that leaves `folder` through a symlink, unless it lands inside one
    of the folders `also_within` (a Hugging Face cache snapshot's blobs)."""
    shown = repr(name)
    if not name:
        raise FlashNormError(f"{what} is empty; it must name a file inside {folder}")
    if "\x00" in name:
        raise FlashNormError(f"{what} {shown} holds a NUL byte; it must name a file inside {folder}")
    windows = PureWindowsPath(name)
    if PurePosixPath(name).is_absolute() or windows.drive or windows.root:
        raise FlashNormError(f"{what} {shown} is absolute; it must be a relative path inside {folder}")
    if ".." in PurePosixPath(name).parts or ".." in windows.parts:
        raise FlashNormError(f"{what} {shown} climbs out with '..'; it must be a relative path inside {folder}")
    root = Path(os.path.realpath(folder))
    resolved = Path(os.path.realpath(root / name))
    allowed = [root, *(Path(os.path.realpath(extra)) for extra in also_within)]
    if not any(_inside(resolved, place) for place in allowed):
        raise FlashNormError(f"{what} {shown} leads to {resolved} through a symbolic link, outside {folder}")
    return resolved


def _inside(path: Path, folder: Path) -> bool:
    return folder in path.parents


def _opened_path(fd: int) -> Path | None:
    """The path the kernel says descriptor `fd` was opened at (Linux), or None elsewhere."""
    try:
        return Path(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        return None
