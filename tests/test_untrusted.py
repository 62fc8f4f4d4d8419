"""flashnorm.untrusted: names read from inside files confined to their folder, inputs opened once
without blocking and refused unless regular, and their identity checked again before a commit."""

from __future__ import annotations

import os
import socket
import stat
import time

import pytest

from flashnorm.errors import FlashNormError
from flashnorm.untrusted import InputFile, Unchanged, confined, regular_identity


def _one_line(excinfo, *fragments: str) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


@pytest.mark.parametrize("name, why", [
    ("", "is empty"),
    ("w\x00.bin", "NUL byte"),
    ("/etc/passwd", "is absolute"),
    ("C:\\weights.bin", "is absolute"),
    ("\\\\server\\share\\w.bin", "is absolute"),
    ("../outside.bin", "'..'"),
    ("sub/../../outside.bin", "'..'"),
    ("..\\outside.bin", "'..'"),
])
def test_confined_refuses_names_that_could_leave_the_folder(tmp_path, name, why):
    with pytest.raises(FlashNormError) as excinfo:
        confined(name, tmp_path, "location")
    _one_line(excinfo, why)


def test_confined_resolves_symlinks_before_deciding(tmp_path):
    folder, outside = tmp_path / "model", tmp_path / "outside"
    folder.mkdir()
    outside.mkdir()
    (outside / "w.bin").write_bytes(b"x")
    (folder / "inside.bin").write_bytes(b"x")
    (folder / "sub").mkdir()
    os.symlink("../outside/w.bin", folder / "leaves.bin")
    os.symlink("inside.bin", folder / "stays.bin")
    os.symlink(outside, folder / "sub" / "door")
    assert confined("stays.bin", folder, "location") == (folder / "inside.bin").resolve()
    assert confined("sub/inside.bin", folder, "location") == (folder / "sub" / "inside.bin").resolve()
    for name in ("leaves.bin", "sub/door/w.bin"):
        with pytest.raises(FlashNormError) as excinfo:
            confined(name, folder, "location")
        _one_line(excinfo, "through a symbolic link", str(outside / "w.bin"))
    # A Hugging Face cache snapshot's symlinks lead into its blobs: allowed only where named.
    assert confined("leaves.bin", folder, "location", also_within=[outside]) == (outside / "w.bin").resolve()


def test_a_fifo_is_refused_at_once_never_waited_on(tmp_path):
    fifo = tmp_path / "weights.bin"
    os.mkfifo(fifo)
    started = time.monotonic()
    with pytest.raises(FlashNormError) as excinfo:
        InputFile(fifo, "external data file")
    _one_line(excinfo, "is a FIFO, not a regular file")
    with pytest.raises(FlashNormError, match="is a FIFO"):
        regular_identity(fifo, "model")
    assert time.monotonic() - started < 1


def test_a_socket_is_refused_saying_what_it_is(tmp_path):
    with socket.socket(socket.AF_UNIX) as listening:
        listening.bind(str(tmp_path / "model.onnx"))
        with pytest.raises(FlashNormError) as excinfo:
            InputFile(tmp_path / "model.onnx", "model")
    _one_line(excinfo, "is a socket, not a regular file")


@pytest.mark.skipif(os.geteuid() != 0, reason="making a device node needs root (os.mknod of a character device)")
def test_a_device_node_is_refused(tmp_path):
    device = tmp_path / "null"
    os.mknod(device, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # /dev/null's numbers
    with pytest.raises(FlashNormError) as excinfo:
        InputFile(device, "model")
    _one_line(excinfo, "is a character device")


def test_within_is_checked_on_the_opened_descriptor(tmp_path):
    (tmp_path / "outside.bin").write_bytes(b"x")
    folder = tmp_path / "model"
    folder.mkdir()
    os.symlink(tmp_path / "outside.bin", folder / "w.bin")
    with pytest.raises(FlashNormError) as excinfo:
        InputFile(folder / "w.bin", "external data file", within=folder)
    _one_line(excinfo, "outside")


def test_reads_go_through_one_descriptor_and_stop_at_the_end(tmp_path):
    path = tmp_path / "w.bin"
    path.write_bytes(bytes(range(16)))
    source = InputFile(path, "external data file")
    os.replace(tmp_path / "w.bin", tmp_path / "gone.bin")  # the name no longer matters to reads
    assert source.read_at(4, 4) == bytes([4, 5, 6, 7])
    with pytest.raises(FlashNormError) as excinfo:
        source.read_at(12, 8)
    _one_line(excinfo, "ends before byte 20")
    source.close()


def test_a_replaced_or_rewritten_file_is_noticed(tmp_path):
    path = tmp_path / "w.bin"
    path.write_bytes(b"old")
    source, others = InputFile(path, "external data file"), Unchanged([(path, "model")])
    source.check_unchanged()
    others.check()
    replacement = tmp_path / "new.bin"
    replacement.write_bytes(b"new")
    os.replace(replacement, path)
    with pytest.raises(FlashNormError) as excinfo:
        source.check_unchanged()
    _one_line(excinfo, "changed while flashnorm was reading it", "replaced by another file", "nothing was written")
    with pytest.raises(FlashNormError, match="replaced by another file"):
        others.check()

    rewritten = InputFile(path, "external data file")
    with open(path, "r+b") as handle:  # the same inode, new bytes, an mtime of its own
        handle.write(b"NEW")
    os.utime(path, ns=(rewritten.identity.mtime_ns + 1, rewritten.identity.mtime_ns + 1))
    with pytest.raises(FlashNormError, match="it was rewritten"):
        rewritten.check_unchanged()
    path.unlink()
    with pytest.raises(FlashNormError, match="it was removed"):
        rewritten.check_unchanged()
