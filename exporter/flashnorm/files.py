"""Staged writes: every file and folder FlashNorm writes is built under a temporary name beside
its destination and renamed into place only once complete and on disk (fsync), so a failure
never leaves half a file behind and a crash never leaves a renamed file without its bytes.

Models, their data files, JSON reports, engine plans, timing caches and Triton repositories
all go through this module; a model and its data file replace an earlier pair as one
(`commit_with_data`). It imports nothing outside the standard library.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path
from typing import IO, Callable, Collection, Iterator, Sequence

from flashnorm.errors import FlashNormError


class StagedFile:
    """A file written under a temporary name beside `path` (through `fd`); `commit()` fsyncs
    it and renames it into place, `discard()` removes it. `temporary` adopts a file someone
    else already wrote beside `path` (e.g. `onnx.save_model`'s output) instead of a new one."""

    def __init__(self, path: str | os.PathLike[str], temporary: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(path)
        directory = _directory(self.path)
        if not directory.is_dir():
            raise FlashNormError(f"cannot write {self.path}: directory {directory} does not exist")
        try:
            if temporary is None:
                self.fd, name = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=directory)
                self.temporary = Path(name)
            else:
                self.temporary = Path(temporary)
                self.fd = os.open(self.temporary, os.O_RDWR)
        except OSError as exc:
            raise FlashNormError(f"cannot write {self.path}: {exc.strerror}") from None
        self.committed = False
        os.fchmod(self.fd, 0o666 & ~umask())  # mkstemp's 0600 is for the temporary, not the result

    def commit(self, to: Path | None = None) -> None:
        """fsync, then rename into place: at `path`, or at `to` instead."""
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = -1
        if to is not None:
            self.path = to
        check_replaceable_file(self.path, f"output {self.path}")  # again: it may have appeared since the check
        os.replace(self.temporary, self.path)
        self.committed = True

    def discard(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.temporary)


def commit_with_data(data: StagedFile, model: Path, model_bytes: Callable[[str], bytes], *,
                     old_data: Collection[Path] = (), keep: Collection[Path] = ()) -> Path:
    """Put a model and the data file it names in place so that, at every instant, `model` is
    the old model reading its old data or the new model reading its new data, both complete:
    a crash or a failure at any step leaves one pair or the other, never a model without its
    data or reading another model's data at its own offsets.

    `data` is the new data file, staged for its usual name `data.path` (`<model>.data`);
    `model_bytes(location)` returns the new model naming its data file `location` (a file name
    in `model`'s folder). The data goes to `data.path` if no file is there; otherwise (an
    earlier output being replaced, whose model may read that name) to a new name of its own,
    `<model>.<8 random characters>.data`, so the old pair stays whole until the one rename of
    the new model over the old one. Returns where the data went.

    Once the new model is in place, this output's earlier data files are removed: those of
    `old_data` (the files the replaced model named, resolved) with one of the two names above,
    and a file left at `data.path`, except any in `keep` (another model's data). A failure
    before that removes the new data file, and leaves everything else as it was."""
    folder = _directory(model)
    usual = target = data.path
    if os.path.lexists(target):
        fd, name = tempfile.mkstemp(prefix=f"{model.name}.", suffix=".data", dir=folder)
        os.close(fd)
        target = Path(name)
    try:
        data.commit(to=target)
        _commit_bytes(model, model_bytes(target.name))
    except BaseException:
        data.discard()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(target)
        raise
    kept = {Path(os.path.realpath(path)) for path in [target, *keep]}
    earlier = [path for path in old_data if _is_data_name(model, Path(path))] + [usual]
    for path in earlier:
        if os.path.lexists(path) and Path(os.path.realpath(path)) not in kept:
            with contextlib.suppress(OSError):  # the new pair is in place: a stray old file at worst
                os.unlink(path)
    _sync_directory(folder)
    return target


def _is_data_name(model: Path, path: Path) -> bool:
    """Whether `path` has a name `commit_with_data` gives `model`'s data file, in its folder."""
    if Path(os.path.realpath(path.parent)) != Path(os.path.realpath(_directory(model))):
        return False
    renamed = re.escape(model.name) + r"\.[a-z0-9_]{8}\.data"  # tempfile.mkstemp's 8 characters
    return path.name == f"{model.name}.data" or re.fullmatch(renamed, path.name) is not None


def _commit_bytes(path: Path, content: bytes) -> None:
    staged = StagedFile(path)
    try:
        _write_all(staged.fd, content)
        staged.commit()
    except BaseException:
        staged.discard()
        raise


def _write_all(fd: int, content: bytes) -> None:
    view = memoryview(content)
    while view:
        view = view[os.write(fd, view):]


def _sync_directory(folder: Path) -> None:
    """Make the renames in `folder` durable (a directory fsync; not every file system has one)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def discard_all(files: Sequence[StagedFile]) -> None:
    for file in files:
        file.discard()


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str], mode: str = "wb") -> Iterator[IO]:
    """Open a staged file for `path`; it replaces `path` (fsync, rename) only if the block succeeds."""
    staged = StagedFile(path)
    try:
        with os.fdopen(staged.fd, mode, closefd=False) as handle:
            yield handle
        staged.commit()
    except BaseException:
        staged.discard()
        raise


def check_replaceable_file(target: Path, named: str) -> None:
    """FlashNormError (one line, starting with `named`) unless `target` may be replaced by a file:
    missing, a regular file, or a symlink (the link is replaced, never what it points to) to one.
    Never a device, FIFO or socket: a rename would replace the node itself (as root, /dev/null)."""
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise FlashNormError(f"cannot write {named}: {exc.strerror}") from None
    if stat.S_ISDIR(mode):
        raise FlashNormError(f"{named} is a directory")
    if not stat.S_ISREG(mode):
        raise FlashNormError(f"{named} exists and is {_kind(mode)}, not a regular file; flashnorm replaces only "
                             "regular files")


def _kind(mode: int) -> str:
    kinds = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"),
             (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "a special file")


MARKER = ".flashnorm-output"
"""The file flashnorm writes into every folder it creates as an output (Triton repositories,
checkpoints): the proof `force` needs before a non-empty folder is replaced."""


def check_replaceable_folder(target: Path, force: bool, named: str) -> None:
    """FlashNormError (one line, starting with `named`) unless `target` may become a folder output:
    missing or an empty folder, or, with `force`, a folder flashnorm wrote (it holds `MARKER`)."""
    if target.exists() and not target.is_dir():
        raise FlashNormError(f"{named} exists and is not a directory")
    if target.is_dir() and any(target.iterdir()):
        if not force:
            raise FlashNormError(f"{named} is not empty (pass --force to replace a folder flashnorm wrote)")
        if not (target / MARKER).is_file():
            raise FlashNormError(f"{named} is not empty and was not written by flashnorm (no {MARKER} in it); "
                                 "--force replaces only folders flashnorm wrote")


@contextlib.contextmanager
def staged_directory(target: str | os.PathLike[str], force: bool) -> Iterator[Path]:
    """Yield a folder beside `target` holding only `MARKER`; on success its files are fsynced
    and it replaces `target` (an old one is moved aside, then removed), on failure it vanishes.
    The folder gets the permissions of the user's umask (0755 typically), not mkdtemp's 0700.

    `target` may be missing or an empty folder; a non-empty one is replaced only with `force`
    and only if it holds `MARKER` (flashnorm wrote it): never a folder of someone else's.
    """
    target = Path(target).absolute()
    check_replaceable_folder(target, force, f"output directory {target}")
    if not target.parent.is_dir():
        raise FlashNormError(f"cannot write {target}: directory {target.parent} does not exist")
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        os.chmod(staging, 0o777 & ~umask())
        (staging / MARKER).write_text("written by flashnorm; `--force` may replace this folder\n")
        yield staging
        _sync_tree(staging)
        if target.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
            os.replace(target, retired / target.name)
            os.replace(staging, target)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _sync_tree(root: Path) -> None:
    for folder, _, names in os.walk(root):
        for name in names:
            path = Path(folder) / name
            if path.is_file() and not path.is_symlink():
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)


def _directory(path: Path) -> Path:
    return path.parent if str(path.parent) else Path(".")


def umask() -> int:
    """The process umask, read without changing it where Linux allows (no race with threads)."""
    with contextlib.suppress(OSError, StopIteration, ValueError):
        with open("/proc/self/status") as status:
            return int(next(line.split()[1] for line in status if line.startswith("Umask:")), 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
