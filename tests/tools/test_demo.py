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
    assert "61 RMSNorm sites" in captured.out and "8 tokens identical" in captured.out
    assert "Paris" in captured.out and captured.out.rstrip().splitlines()[-1].startswith("PASSED")
    report = json.loads((tmp_path / "demo.json").read_text())
    assert report["passed"] and report["optimize"]["summary"]["fold.folded"] == 60
    assert report["compare"]["outputs"][0]["rel_l2"] < 1e-5
    assert (tmp_path / "smollm2-135m.flashnorm.onnx").is_file()


def test_demo_refuses_missing_export(tmp_path, capsys):
    assert cli.main(["demo", "-o", str(tmp_path), "--exported", str(tmp_path / "none.onnx")]) == 2
    assert "does not exist" in capsys.readouterr().err
