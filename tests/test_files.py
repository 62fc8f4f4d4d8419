"""flashnorm.files: staged writes (fsync, rename; a model and its data file replaced as one pair) for every writer."""

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


def _stage(path: Path, content: bytes) -> files.StagedFile:
    staged = files.StagedFile(path)
    os.write(staged.fd, content)
    return staged


def _model_naming(version: str):
    return lambda location: f"{version} {location}".encode()


def _pair(model: Path) -> str:
    """The version of the model at `model`, checked to read the data of that same version."""
    version, location = model.read_text().split(" ", 1)
    assert (model.parent / location).read_text() == f"data {version}", (version, location)
    return version


def test_commit_with_data_takes_the_usual_name_when_it_is_free(tmp_path):
    model = tmp_path / "m.onnx"
    assert files.commit_with_data(_stage(tmp_path / "m.onnx.data", b"data new"), model, _model_naming("new")) \
        == tmp_path / "m.onnx.data"
    assert _pair(model) == "new" and model.read_text() == "new m.onnx.data"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "m.onnx.data"]


def test_commit_with_data_replaces_a_pair_under_a_new_name_and_removes_the_old_data(tmp_path):
    model, usual = tmp_path / "m.onnx", tmp_path / "m.onnx.data"
    files.commit_with_data(_stage(usual, b"data old"), model, _model_naming("old"))
    (tmp_path / "weights.bin").write_text("a user's file the old model also names")
    target = files.commit_with_data(_stage(usual, b"data new"), model, _model_naming("new"),
                                    old_data=[usual, tmp_path / "weights.bin"])
    assert target != usual and target.name.startswith("m.onnx.") and target.name.endswith(".data")
    assert _pair(model) == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["m.onnx", target.name, "weights.bin"])
    again = files.commit_with_data(_stage(usual, b"data newer"), model, _model_naming("newer"), old_data=[target])
    assert again == usual and _pair(model) == "newer"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "m.onnx.data", "weights.bin"]


def test_commit_with_data_never_removes_a_file_it_is_told_to_keep(tmp_path):
    model, usual = tmp_path / "m.onnx", tmp_path / "m.onnx.data"
    files.commit_with_data(_stage(usual, b"data old"), model, _model_naming("old"))
    files.commit_with_data(_stage(usual, b"data new"), model, _model_naming("new"), old_data=[usual], keep=[usual])
    assert _pair(model) == "new" and usual.read_text() == "data old"


def test_commit_with_data_failing_before_the_switch_leaves_the_old_pair(tmp_path, monkeypatch):
    """A failure at the new model's rename: the old pair as it was, no new file left."""
    model, usual = tmp_path / "m.onnx", tmp_path / "m.onnx.data"
    files.commit_with_data(_stage(usual, b"data old"), model, _model_naming("old"))
    real_replace = os.replace

    def replace(source, destination):
        if Path(destination) == model:
            raise OSError(5, "Input/output error")
        real_replace(source, destination)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError):
        files.commit_with_data(_stage(usual, b"data new"), model, _model_naming("new"), old_data=[usual])
    assert _pair(model) == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "m.onnx.data"]


def test_adopted_file_is_renamed_into_place(tmp_path):
    scratch = tmp_path / ".scratch"
    scratch.mkdir()
    (scratch / "m.onnx.data").write_bytes(b"data new")
    files.commit_with_data(files.StagedFile(tmp_path / "m.onnx.data", scratch / "m.onnx.data"), tmp_path / "m.onnx",
                           _model_naming("new"))
    assert _pair(tmp_path / "m.onnx") == "new"
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
