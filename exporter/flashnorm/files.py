"""Staged writes: every file and folder FlashNorm writes is built under a temporary name beside
its destination and renamed into place only once complete and on disk (fsync), so a failure
never leaves half a file behind and a crash never leaves a renamed file without its bytes.

Models, their data files, JSON reports, engine plans, timing caches and Triton repositories
all go through this module. It imports nothing outside the standard library.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import IO, Iterator, Sequence

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

    def commit(self) -> None:
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = -1
        check_replaceable_file(self.path, f"output {self.path}")  # again: it may have appeared since the check
        os.replace(self.temporary, self.path)
        self.committed = True

    def discard(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.temporary)


class SetAside:
    """An existing file moved to a temporary name beside it; `restore()` moves it back, `drop()`
    removes it."""

    def __init__(self, path: Path) -> None:
        check_replaceable_file(path, f"output {path}")
        fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".old.tmp", dir=_directory(path))
        os.close(fd)
        try:
            os.replace(path, temporary)
        except BaseException:
            os.unlink(temporary)
            raise
        self.path, self.temporary = path, Path(temporary)

    def restore(self) -> None:
        os.replace(self.temporary, self.path)

    def drop(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.temporary)


def commit_together(files: Sequence[StagedFile]) -> None:
    """Rename written files into place in order, the last one being the file that names the
    others (a model after its data). A file already at the last one's destination is moved
    aside first: between the renames it would name the new files with its own expectations
    (an old model reading new data at its old offsets), so for that moment there is none
    there instead. On failure every uncommitted file is removed and the old last file goes
    back only if none of the new files replaced what it named."""
    previous: SetAside | None = None
    try:
        if len(files) > 1 and os.path.lexists(files[-1].path):
            previous = SetAside(files[-1].path)
        for file in files:
            file.commit()
        if previous is not None:
            previous.drop()
    except BaseException:
        discard_all(files)
        if previous is not None:
            if files[0].committed:
                previous.drop()
            else:
                previous.restore()
        raise


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
