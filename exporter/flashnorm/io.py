"""Load and save ONNX models: external data, atomic writes, clear errors.

Every file FlashNorm writes goes to a temporary name beside the destination and is renamed
into place only once complete, so a failure never leaves half a file behind.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import IO, Iterator

from flashnorm.errors import FlashNormError

_TWO_GIB = 2**31


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
        with os.fdopen(fd, mode) as handle:
            yield handle
        os.replace(temporary, destination)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
