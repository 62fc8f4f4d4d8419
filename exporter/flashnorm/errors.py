"""The one exception type the CLI turns into a one-line message and a non-zero exit, the one
wording every command uses for a file that is not there, the exit statuses, and where the
traceback of a bug goes (never to the user's terminal)."""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from pathlib import Path

EXIT_FAILED_CHECK = 1
"""A check ran and failed (compare, fold-checkpoint --check-int8, demo): the verdict is one line."""
EXIT_BAD_INPUT = 2
"""A bad or unsupported input or option, or the system refused a read or write: one line."""
EXIT_NOT_COMPARED = 3
"""compare: the engine was built but cannot run here, so nothing was compared."""
EXIT_INCONCLUSIVE = 4
"""compare --budget on a quantized pair: the ratio's 95 % interval spans the budget's line, so
neither within nor over; the report says how much more text would settle it."""
EXIT_BUG = 70
"""EX_SOFTWARE (sysexits.h): an exception flashnorm did not expect, i.e. a bug in flashnorm."""
EXIT_BROKEN_PIPE = 141
"""128 + SIGPIPE: standard output was closed early (`| head`); what a shell reports for `cat`."""


class FlashNormError(Exception):
    """A bad or unsupported input. The message is one line that names what was asked for
    and, where it helps, what exists instead."""

    exit_code = EXIT_BAD_INPUT
    label = "error"  # what the CLI prints before the message


class NotCompared(FlashNormError):
    """The comparison could not run here (the engine was built, but this machine cannot run
    it): not a failed comparison and not a bad input, so it has its own exit code."""

    exit_code = EXIT_NOT_COMPARED
    label = "not compared"


def missing_file(what: str, path: str | os.PathLike[str]) -> FlashNormError:
    """The error for a required file that is absent: the same words in every command."""
    return FlashNormError(f"{what} {os.fspath(path)} does not exist or is not a file")


def require_file(what: str, path: str | os.PathLike[str]) -> Path:
    """`path` as a Path if it is a file, else `missing_file(what, path)`."""
    if not Path(path).is_file():
        raise missing_file(what, path)
    return Path(path)


def write_bug_log(command: str, argv: list[str], error: BaseException) -> Path:
    """Write `error`'s traceback to a new file `flashnorm-bug-<command>-<time>-<random>.log` in the
    temporary folder (TMPDIR, else /tmp) and return its path. The name is new (created
    exclusively, never over an existing file or through a symlink) and the file is readable by
    its owner only: a traceback may quote paths and values of the user's."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    fd, name = tempfile.mkstemp(prefix=f"flashnorm-bug-{command or 'cli'}-{stamp}-", suffix=".log")
    from flashnorm import __version__

    with os.fdopen(fd, "w", encoding="utf-8", errors="backslashreplace") as log:
        log.write(f"flashnorm {__version__}: an unexpected {type(error).__name__}\ncommand line: flashnorm {' '.join(argv)}\n\n")
        log.write("".join(traceback.format_exception(error)))
    return Path(name)
