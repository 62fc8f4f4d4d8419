"""`flashnorm demo`: export (reused from the session's cached export), optimize, compare on
real text and generate, with a readable report."""

from __future__ import annotations

import json

import pytest

from flashnorm import cli
from flashnorm.progress import Progress


@pytest.mark.slow
def test_demo_end_to_end(smollm2_onnx, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(Progress, "enabled", True)
    argv = ["demo", "-o", str(tmp_path), "--exported", str(smollm2_onnx), "--tokens", "8",
            "--report", str(tmp_path / "demo.json")]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    assert "optimizing" in captured.err and "generating 8 tokens" in captured.err
    # What goes to disk is said before anything is written.
    assert captured.err.splitlines()[0] == (f"flashnorm demo: writing the optimized model of smollm2-135m to {tmp_path}/ "
                                            "(about 0.5 GB; -o chooses another folder)")
    assert "61 RMSNorm sites" in captured.out and "8 tokens identical" in captured.out
    # Every count comes with the reasons of the sites left alone.
    fold_line = next(line for line in captured.out.splitlines() if line.strip().startswith("fold"))
    assert "60 folded, 1 left alone: 1 × " in fold_line and "tied" in fold_line
    cancel_line = next(line for line in captured.out.splitlines() if line.strip().startswith("cancel"))
    assert "61 left alone: 30 × " in cancel_line and cancel_line.count(" × ") == 3  # 30 + 30 + 1, grouped
    assert "Paris" in captured.out and captured.out.rstrip().splitlines()[-1].startswith("PASSED")
    report = json.loads((tmp_path / "demo.json").read_text())
    assert report["passed"] and report["optimize"]["summary"]["fold.folded"] == 60
    assert report["compare"]["outputs"][0]["rel_l2"] < 1e-5
    assert (tmp_path / "smollm2-135m.flashnorm.onnx").is_file()


def test_demo_refuses_missing_export(tmp_path, capsys):
    assert cli.main(["demo", "-o", str(tmp_path), "--exported", str(tmp_path / "none.onnx")]) == 2
    assert "model " + str(tmp_path / "none.onnx") + " does not exist" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_failed_demo_removes_what_it_made_and_only_that(tmp_path, capsys, monkeypatch):
    import types

    from flashnorm.export import sources

    # No real model: the run fails while optimizing the (bad) export, after making its folders.
    monkeypatch.setattr(sources, "resolve_source", lambda *a, **k: types.SimpleNamespace())
    (tmp_path / "bad.onnx").write_bytes(b"not a model")
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "smollm2-135m.flashnorm.onnx").write_bytes(b"the user's")
    for target in ("made/deeper", "kept"):
        assert cli.main(["demo", "-o", str(tmp_path / target), "--exported", str(tmp_path / "bad.onnx")]) == 2
        assert "bad.onnx is not an ONNX model" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.onnx", "kept"]
    assert [p.name for p in (tmp_path / "kept").iterdir()] == ["smollm2-135m.flashnorm.onnx"]
    assert (tmp_path / "kept" / "smollm2-135m.flashnorm.onnx").read_bytes() == b"the user's"


@pytest.mark.slow
def test_demo_fp16(smollm2_fp16_onnx, tmp_path, capsys):
    """`flashnorm demo --dtype fp16` on the fp16 export: optimized and compared in fp16 on ONNX
    Runtime, within a few units of fp16 rounding of the unfolded fp16 model."""
    argv = ["demo", "-o", str(tmp_path), "--exported", str(smollm2_fp16_onnx), "--dtype", "fp16", "--tokens", "8",
            "--report", str(tmp_path / "demo.json")]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "precision  float16 on ONNX Runtime" in out and "Paris" in out
    report = json.loads((tmp_path / "demo.json").read_text())
    assert report["passed"] and report["optimize"]["summary"]["fold.folded"] == 60
    logits = report["compare"]["outputs"][0]
    assert 0 < logits["rel_l2"] < 8 * 2.0 ** -11 and logits["top1_agreement"] == 1.0
    assert (tmp_path / "smollm2-135m.fp16.flashnorm.onnx").is_file()


def test_demo_unknown_dtype(tmp_path, capsys):
    assert cli.main(["demo", "-o", str(tmp_path), "--dtype", "int8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "argument --dtype: 'int8' is not one of fp32, fp16, bf16, float32" in err
