"""`flashnorm export` from the command line: one-line errors for bad input, and a real export
of a Hugging Face directory (a tiny random Llama saved with save_pretrained)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from flashnorm import cli
from flashnorm.progress import Progress
from flashnorm.validate import make_session
from models import cache


@pytest.fixture(autouse=True)
def _progress_on(monkeypatch):
    monkeypatch.setattr(Progress, "enabled", True)


def _error(capsys, argv) -> str:
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    return captured.err


def test_missing_directory(tmp_path, capsys):
    err = _error(capsys, ["export", str(tmp_path / "nowhere"), "-o", str(tmp_path / "m.onnx")])
    assert err.startswith("flashnorm export: error:") and "does not exist" in err


def test_not_a_model(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("hello")
    assert "not a model" in _error(capsys, ["export", str(tmp_path / "notes.txt"), "-o", str(tmp_path / "m.onnx")])
    assert "no config.json" in _error(capsys, ["export", str(tmp_path), "-o", str(tmp_path / "m.onnx")])


def test_unknown_model_name(tmp_path, capsys):
    err = _error(capsys, ["export", "--model", "llama-9000", "-o", str(tmp_path / "m.onnx")])
    assert "unknown model 'llama-9000'; known: smollm2-135m" in err


def test_nothing_to_export(tmp_path, capsys):
    assert "--model" in _error(capsys, ["export", "-o", str(tmp_path / "m.onnx")])


def test_output_must_be_onnx(tmp_path, capsys):
    cache.tiny_llama_model().save_pretrained(tmp_path / "hf")
    capsys.readouterr()  # drop save_pretrained's progress bar
    assert ".onnx" in _error(capsys, ["export", str(tmp_path / "hf"), "-o", str(tmp_path / "m.bin")])


@pytest.mark.parametrize("kv_cache", [False, True], ids=["logits", "kv"])
def test_hf_directory_export(tmp_path, capsys, rng, kv_cache):
    torch = pytest.importorskip("torch")
    model = cache.tiny_llama_model()
    model.save_pretrained(tmp_path / "hf")
    output = tmp_path / "tiny.onnx"
    argv = ["export", str(tmp_path / "hf"), "-o", str(output), "--report", str(tmp_path / "r.json")]
    assert cli.main(argv + (["--kv-cache"] if kv_cache else [])) == 0
    captured = capsys.readouterr()
    assert "loading" in captured.err and "exporting (legacy exporter, opset 17" in captured.err
    assert f"→ {output}" in captured.out and "kept tied" in captured.out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["opset"] == 17 and report["kv_cache"] is kv_cache and report["lm_head_tied_in_onnx"]
    assert report["parameters"] == sum(p.numel() for p in model.parameters())

    session = make_session(output)
    assert len(session.get_inputs()) == (3 + 4 if kv_cache else 3)
    ids = rng.integers(0, 128, (2, 5))
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.tile(np.arange(5), (2, 1))}
    if kv_cache:
        feeds.update({i.name: np.zeros((2, 2, 0, 16), np.float32) for i in session.get_inputs()[3:]})
    with torch.no_grad():
        expected = model(torch.from_numpy(ids)).logits.numpy()
    logits = session.run(["logits"], feeds)[0]
    assert np.abs(logits - expected).max() / np.abs(expected).max() < 1e-5


@pytest.mark.parametrize("dtype,stored", [("fp16", "float16"), ("bf16", "bfloat16")])
def test_export_fold_equals_fold_checkpoint_then_export(dtype, stored, tmp_path, capsys):
    """`export --dtype fp16|bf16 --fold` folds in float64 and rounds each weight once: the same
    initializers as `fold-checkpoint --dtype float16|bfloat16` then `export`."""
    import onnx
    from onnx import numpy_helper

    hf = tmp_path / "hf"
    cache.tiny_llama_model().save_pretrained(hf)
    one, two = tmp_path / "one.onnx", tmp_path / "two.onnx"
    report_path = tmp_path / "report.json"
    assert cli.main(["export", str(hf), "--dtype", dtype, "--fold", "-o", str(one), "--report", str(report_path)]) == 0
    report = json.loads(report_path.read_text())
    # 2 layers × 2 norms fold; the final norm feeds the tied head and keeps its gain.
    assert report["fold"]["folded"] == 4 and report["fold"]["left_alone"] == 1
    assert "folded 4 norms before rounding" in capsys.readouterr().out
    assert cli.main(["fold-checkpoint", str(hf), "--dtype", stored, "-o", str(tmp_path / "folded")]) == 0
    assert cli.main(["export", str(tmp_path / "folded"), "--dtype", dtype, "-o", str(two)]) == 0

    def weights(path):
        return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}

    a, b = weights(one), weights(two)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    gains = [name for name in a if "layernorm" in name]
    assert gains and all(np.all(a[name] == 1) for name in gains)
    assert [n.op_type for n in onnx.load(str(one)).graph.node] == [n.op_type for n in onnx.load(str(two)).graph.node]
