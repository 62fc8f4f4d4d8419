"""The path guard (flashnorm.paths): every relation between an output and what a command reads
or writes, symlinks and `..` resolved, the places never replaced, --force and the marker."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flashnorm import files
from flashnorm.errors import FlashNormError
from flashnorm.paths import Input, Output, check_paths


@pytest.fixture
def place(tmp_path, monkeypatch):
    """A working folder with an input model, its data file and a model folder; cwd and HOME
    point into tmp_path so the guard's fixed places are ours."""
    work = tmp_path / "work"
    (work / "models" / "hf").mkdir(parents=True)
    (work / "models" / "m.onnx").write_bytes(os.urandom(64))
    (work / "models" / "m.onnx.data").write_bytes(os.urandom(64))
    (work / "models" / "hf" / "config.json").write_text("{}")
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    return work


def _inputs(work: Path) -> list[Input]:
    return [Input("model", work / "models" / "m.onnx"), Input("model's external data", work / "models" / "m.onnx.data"),
            Input("model source", work / "models" / "hf")]


@pytest.mark.parametrize("output, message", [
    ("models/m.onnx", "is the model"),
    ("models/../models/m.onnx.data", "is the model's external data"),
    ("models", "contains the model"),
    ("models/hf/out.onnx", "lies inside the model source"),
    (".", "is the current directory"),
    ("..", "contains the current directory"),
    ("/", "contains the current directory"),
])
def test_an_output_that_would_destroy_an_input_or_a_fixed_place_is_refused(place, output, message):
    folder = not output.endswith((".onnx", ".data"))
    with pytest.raises(FlashNormError, match=message):
        check_paths(_inputs(place), [Output("output", Path(output), folder=folder)])


def test_the_home_directory_and_its_parents_are_never_outputs(place, tmp_path):
    for target in (tmp_path / "home", tmp_path):
        with pytest.raises(FlashNormError, match="home directory|current directory"):
            check_paths([], [Output("repository", target, folder=True)])


def test_a_symlink_to_an_input_is_the_input(place):
    (place / "link.onnx").symlink_to(place / "models" / "m.onnx")
    with pytest.raises(FlashNormError, match="is the model"):
        check_paths(_inputs(place), [Output("output model", Path("link.onnx"))])


def test_two_outputs_of_one_command_may_not_overlap(place):
    with pytest.raises(FlashNormError, match="written by the same command"):
        check_paths([], [Output("engine", Path("out.plan")), Output("report", Path("./out.plan"))])
    with pytest.raises(FlashNormError, match="written by the same command"):
        check_paths([], [Output("repository", Path("repo"), folder=True), Output("report", Path("repo/r.json"))])


def test_locations_that_cannot_be_written_are_found_before_any_work(place):
    (place / "a-file").write_text("x")
    with pytest.raises(FlashNormError, match="does not exist"):
        check_paths([], [Output("output model", Path("absent/out.onnx"))])
    with pytest.raises(FlashNormError, match="a-file is not a directory"):
        check_paths([], [Output("output model", Path("a-file/out.onnx"))])
    (place / "folder.onnx").mkdir()
    with pytest.raises(FlashNormError, match="is a directory"):
        check_paths([], [Output("output model", Path("folder.onnx"))])
    with pytest.raises(FlashNormError, match="exists and is not a directory"):
        check_paths([], [Output("repository", Path("a-file"), folder=True)])
    check_paths([], [Output("model", Path("made/later/out.onnx"), make_parents=True)])


def test_force_replaces_only_a_folder_flashnorm_wrote(place):
    theirs = place / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    with pytest.raises(FlashNormError, match=r"not empty \(pass --force"):
        check_paths([], [Output("repository", theirs, folder=True)])
    with pytest.raises(FlashNormError, match="not written by flashnorm"):
        check_paths([], [Output("repository", theirs, folder=True)], force=True)
    with files.staged_directory(place / "ours", force=False) as staging:
        (staging / "config.pbtxt").write_text("x")
    check_paths([], [Output("repository", place / "ours", folder=True)], force=True)
    (place / "empty").mkdir()
    check_paths([], [Output("repository", place / "empty", folder=True)])


def test_ordinary_outputs_beside_the_inputs_pass(place):
    check_paths(_inputs(place), [Output("output model", Path("models/m.flashnorm.onnx")),
                                 Output("output model's external data", Path("models/m.flashnorm.onnx.data")),
                                 Output("report", Path("report.json")),
                                 Output("repository", Path("repo"), folder=True)])
    assert sorted(p.name for p in place.iterdir()) == ["models"]  # the write probe leaves nothing
