"""The session cache's release (tests/models/cache.py): what a finished fixture's files take
with them, and what they leave."""

from __future__ import annotations

import shutil

import pytest

from models import cache

EXPORT = "smollm2-135m.legacy.d1fbb5027693.onnx"
DERIVED = ["smollm2-135m.legacy.d1fbb5027693.onnx.data",
           "smollm2-135m.legacy.d1fbb5027693.fold-cancel.412552cf05e8.onnx",
           "smollm2-135m.legacy.d1fbb5027693.fold-cancel.412552cf05e8.json"]
OTHERS = ["smollm2-135m.legacy.fp16.9e3e164622dc.onnx",  # another export, same family
          "smollm2-135m.legacy.kv.d1fbb5027693.onnx",
          "smollm2-135m.legacy.d1fbb5027693x.onnx"]  # a longer stem, no dot after it


def _populate(folder):
    for name in [EXPORT, *DERIVED, *OTHERS]:
        (folder / name).write_bytes(b"x")


@pytest.mark.parametrize("missing", [False, True], ids=["present", "already-gone"])
def test_release_removes_the_file_and_what_derives_from_it(tmp_path, monkeypatch, missing):
    monkeypatch.delenv(cache.CACHE_ENV, raising=False)
    _populate(tmp_path)
    if missing:
        (tmp_path / EXPORT).unlink()
    cache.release(tmp_path / EXPORT)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(OTHERS)


def test_release_removes_a_folder_and_its_derivatives(tmp_path, monkeypatch):
    monkeypatch.delenv(cache.CACHE_ENV, raising=False)
    checkpoint = tmp_path / "smollm2-135m.folded-checkpoint.2400ee141176"
    (checkpoint / "sub").mkdir(parents=True)
    (checkpoint / "sub" / "model.safetensors").write_bytes(b"x")
    (tmp_path / "smollm2-135m.folded-checkpoint.2400ee141176.log").write_bytes(b"x")
    (tmp_path / "smollm2-135m.folded-checkpoint.0000ee141176").mkdir()
    cache.release(checkpoint)
    assert [p.name for p in tmp_path.iterdir()] == ["smollm2-135m.folded-checkpoint.0000ee141176"]


def test_release_after_the_session_folder_went_is_a_no_op(tmp_path, monkeypatch):
    # The last selected test's teardown ends the session, whose folder goes before the release
    # runs (`-k` selecting test_defer's SmolLM2 test last once failed there).
    monkeypatch.delenv(cache.CACHE_ENV, raising=False)
    folder = tmp_path / "session0"
    folder.mkdir()
    _populate(folder)
    shutil.rmtree(folder)
    cache.release(folder / EXPORT)
    assert not folder.exists()


def test_release_keeps_everything_in_a_persistent_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path))
    _populate(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    cache.release(tmp_path / EXPORT)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
