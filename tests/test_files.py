"""flashnorm.files: staged writes (fsync, rename, old file moved aside) for every writer."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from flashnorm import files
from flashnorm.errors import FlashNormError


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def test_atomic_write_fsyncs_before_the_rename(tmp_path, monkeypatch):
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append("replace"), real_replace(a, b))[1])
    with files.atomic_write(tmp_path / "report.json", "w") as handle:
        handle.write("{}")
    assert events == ["fsync", "replace"]
    assert (tmp_path / "report.json").read_text() == "{}"


def test_atomic_write_leaves_the_old_file_when_the_block_fails(tmp_path):
    target = tmp_path / "plan"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with files.atomic_write(target) as handle:
            handle.write(b"new, half")
            raise RuntimeError("interrupted")
    assert target.read_bytes() == b"old"
    assert _leftovers(tmp_path) == []


def test_missing_directory_is_one_line(tmp_path):
    with pytest.raises(FlashNormError, match="does not exist"):
        with files.atomic_write(tmp_path / "nowhere" / "x.json", "w"):
            pass


def test_commit_together_sets_the_last_file_aside_and_restores_it(tmp_path, monkeypatch):
    """A failed first rename puts the old model back; nothing temporary stays behind."""
    model, data = tmp_path / "m.onnx", tmp_path / "m.onnx.data"
    model.write_bytes(b"old model")
    data.write_bytes(b"old data")
    staged = [files.StagedFile(data), files.StagedFile(model)]
    for file, content in zip(staged, (b"new data", b"new model")):
        os.write(file.fd, content)
    real_commit = files.StagedFile.commit

    def fail_first(self):
        if self is staged[0]:
            raise OSError(5, "Input/output error")
        real_commit(self)

    monkeypatch.setattr(files.StagedFile, "commit", fail_first)
    with pytest.raises(OSError):
        files.commit_together(staged)
    assert (model.read_bytes(), data.read_bytes()) == (b"old model", b"old data")
    assert _leftovers(tmp_path) == []


def test_adopted_file_is_renamed_into_place(tmp_path):
    scratch = tmp_path / ".scratch"
    scratch.mkdir()
    (scratch / "m.onnx").write_bytes(b"written elsewhere")
    files.commit_together([files.StagedFile(tmp_path / "m.onnx", scratch / "m.onnx")])
    assert (tmp_path / "m.onnx").read_bytes() == b"written elsewhere"
    assert list(scratch.iterdir()) == []


def _written_by_flashnorm(target):
    with files.staged_directory(target, force=False) as staging:
        (staging / "old.txt").write_text("old")


def test_staged_directory_keeps_the_old_repository_when_the_new_one_fails(tmp_path):
    target = tmp_path / "repo"
    _written_by_flashnorm(target)
    with pytest.raises(RuntimeError):
        with files.staged_directory(target, force=True) as staging:
            (staging / "new.txt").write_text("new")
            raise RuntimeError("interrupted")
    assert sorted(p.name for p in target.iterdir()) == [files.MARKER, "old.txt"]
    assert _leftovers(tmp_path) == []


def test_staged_directory_replaces_the_old_one(tmp_path):
    target = tmp_path / "repo"
    _written_by_flashnorm(target)
    with files.staged_directory(target, force=True) as staging:
        (staging / "sub").mkdir()
        (staging / "sub" / "new.txt").write_text("new")
    written = [p.relative_to(target).as_posix() for p in sorted(target.rglob("*"))]
    assert written == [files.MARKER, "sub", "sub/new.txt"]
    assert _leftovers(tmp_path) == []


def test_staged_directory_force_never_replaces_a_folder_flashnorm_did_not_write(tmp_path):
    target = tmp_path / "project"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(FlashNormError, match="not written by flashnorm"):
        with files.staged_directory(target, force=True):
            pytest.fail("must not start")
    assert [p.name for p in target.iterdir()] == ["notes.txt"]
    assert _leftovers(tmp_path) == []


def test_staged_directory_is_created_with_the_umask(tmp_path):
    previous = os.umask(0o022)
    try:
        with files.staged_directory(tmp_path / "repo", force=False) as staging:
            (staging / "file.txt").write_text("x")
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "repo").stat().st_mode) == 0o755
