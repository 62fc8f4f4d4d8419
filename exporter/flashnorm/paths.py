"""The path guard: what a command may write or replace, decided before it starts.

Every command declares its inputs and its outputs (`Input`, `Output`); `check_paths` resolves
them (symlinks, `..`, relative to the current directory) and refuses, with one line, an output
that is, contains or lies inside an input (an ONNX model's external-data files included) or
another output, one that is or contains the current directory, the home directory or a
filesystem root, one whose location cannot be written, and one that exists and is not what the
command would write: a file output over anything but a regular file (a device such as
/dev/null, a FIFO, a socket: renaming over it would replace the device node, not write
through it), a folder output over anything but a folder. `--force` replaces only a folder
that flashnorm itself wrote (it carries `files.MARKER`), never anything else: refuse rather than
guess, as `cp`, `rsync` and `git` do. (A report to a standard stream is written through it, not
replaced: the CLI keeps it out of the guard, see `cli.REPORT_STREAMS`.) It imports nothing outside the standard library but
`errors` and `files`; reading an ONNX file's external-data names is done by the caller
(`flashnorm.modelio.external_data_files`), so this module stays cheap to import.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Iterable, Sequence

from flashnorm.errors import FlashNormError
from flashnorm.files import check_replaceable_file, check_replaceable_folder


@dataclasses.dataclass(frozen=True)
class Input:
    """A file or folder a command reads: `what` names it in messages ("model", "engine")."""

    what: str
    path: Path


@dataclasses.dataclass(frozen=True)
class Output:
    """A file or folder a command writes. `folder`: the output is a folder replaced whole
    (a repository, a checkpoint); else a file replaced by rename."""

    what: str
    path: Path
    folder: bool = False
    make_parents: bool = False
    """The command creates missing parent folders (demo's output folder): the nearest existing
    ancestor must be writable instead of the parent."""


def inputs(what: str, paths: Iterable[str | os.PathLike[str] | None]) -> list[Input]:
    """`Input`s for the given paths that exist (a missing input is the command's own error)."""
    return [Input(what, Path(p)) for p in paths if p is not None and os.path.exists(p)]


def resolved(path: str | os.PathLike[str]) -> Path:
    """`path` absolute with every symlink and `..` resolved (the parts that exist)."""
    return Path(os.path.realpath(os.path.abspath(os.fspath(path))))


def _inside(inner: Path, outer: Path) -> bool:
    return inner != outer and outer in inner.parents


def _protected_places() -> list[tuple[str, Path]]:
    places = [("the current directory", resolved(os.getcwd())), ("the filesystem root", Path("/"))]
    home = os.path.expanduser("~")
    if home and home != "~":
        places.append(("the home directory", resolved(home)))
    return places


def check_paths(command_inputs: Sequence[Input], outputs: Sequence[Output], force: bool = False) -> None:
    """Refuse (FlashNormError, one line) any output that would destroy an input, another output
    or a place no command should replace, or that cannot be written; see the module docstring."""
    sources = [(item, resolved(item.path)) for item in command_inputs]
    targets = [(item, resolved(item.path)) for item in outputs]
    places = _protected_places()
    for index, (output, target) in enumerate(targets):
        named = f"{output.what} {output.path}"
        for place, where in places:
            if target == where or _inside(where, target):
                verb = "is" if target == where else "contains"
                raise FlashNormError(f"{named} {verb} {place}; flashnorm never replaces it")
        if target != Path("/") and os.path.ismount(target):
            raise FlashNormError(f"{named} is a mount point; flashnorm never replaces it")
        for source_item, source in sources:
            relation = _relation(target, source)
            if relation:
                raise FlashNormError(f"{named} {relation} the {source_item.what} {source_item.path}; "
                                     "choose an output elsewhere")
        for other, other_target in targets[:index]:
            relation = _relation(target, other_target)
            if relation:
                raise FlashNormError(f"{named} {relation} the {other.what} {other.path} written by the same command")
        _check_writable(output, target, force)


def _relation(target: Path, source: Path) -> str:
    if target == source:
        return "is"
    if _inside(source, target):
        return "contains"
    if _inside(target, source):
        return "lies inside"
    return ""


def _check_writable(output: Output, target: Path, force: bool) -> None:
    named = f"{output.what} {output.path}"
    parent = target.parent
    if output.make_parents:
        while not os.path.lexists(parent) and parent != parent.parent:
            parent = parent.parent
    if not parent.is_dir():
        problem = "is not a directory" if os.path.lexists(parent) else "does not exist"
        raise FlashNormError(f"cannot write {named}: {parent} {problem}")
    try:  # a real probe: permission bits say nothing to root, nor of a read-only or full file system
        fd, probe = tempfile.mkstemp(prefix=".flashnorm-probe-", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise FlashNormError(f"cannot write {named}: directory {parent}: {exc.strerror}") from None
    if output.folder:
        check_replaceable_folder(target, force, named)
    else:
        check_replaceable_file(target, named)
