"""The one exception type the CLI turns into a one-line message and a non-zero exit, and the
one wording every command uses for a file that is not there."""

from __future__ import annotations

import os
from pathlib import Path


class FlashNormError(Exception):
    """A bad or unsupported input. The message is one line that names what was asked for
    and, where it helps, what exists instead."""

    exit_code = 2
    label = "error"  # what the CLI prints before the message


class NotCompared(FlashNormError):
    """The comparison could not run here (the engine was built, but this machine cannot run
    it): not a failed comparison and not a bad input, so it has its own exit code."""

    exit_code = 3
    label = "not compared"


def missing_file(what: str, path: str | os.PathLike[str]) -> FlashNormError:
    """The error for a required file that is absent: the same words in every command."""
    return FlashNormError(f"{what} {os.fspath(path)} does not exist or is not a file")


def require_file(what: str, path: str | os.PathLike[str]) -> Path:
    """`path` as a Path if it is a file, else `missing_file(what, path)`."""
    if not Path(path).is_file():
        raise missing_file(what, path)
    return Path(path)
