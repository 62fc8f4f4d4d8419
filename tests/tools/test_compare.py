"""`flashnorm compare` from the command line: pass → exit 0, fail → exit 1 with the failing
output named, bad input → one line and exit 2; on the real model with real text."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx.numpy_helper as onh
import pytest

from flashnorm import cli
from flashnorm.passes import optimize_file
from flashnorm.progress import Progress


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setattr(Progress, "enabled", False)


@pytest.fixture(scope="module")
def tiny_folded(tiny_llama_onnx, tmp_path_factory):
    path = tmp_path_factory.mktemp("compare") / "tiny.flashnorm.onnx"
    Progress.enabled = False
    optimize_file(tiny_llama_onnx, path)
    return path


def _perturbed(source, destination, rng) -> None:
    """The model with one MatMul weight scaled by 1.01: a real, small accuracy bug."""
    model = onnx.load(str(source))
    weight = next(t for t in model.graph.initializer if t.name.startswith("onnx::MatMul"))
    weight.CopyFrom(onh.from_array(onh.to_array(weight) * np.float32(1.01), weight.name))
    onnx.save(model, str(destination))


def test_folded_model_passes(tiny_llama_onnx, tiny_folded, tmp_path, capsys):
    argv = ["compare", str(tiny_llama_onnx), str(tiny_folded), "--batch", "3", "--sequence", "9",
            "--iterations", "2", "--seed", "7", "--generate", "6", "--report", str(tmp_path / "r.json")]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "PASS logits [3, 9, 128]" in out and "6 greedy tokens identical" in out
    report = json.loads((tmp_path / "r.json").read_text())
    logits = report["outputs"][0]
    assert report["passed"] and logits["rel_l2"] < 1e-5 and logits["top1_agreement"] == 1.0
    assert report["inputs"]["seed"] == 7 and report["generation"]["identical"]


def test_perturbed_model_fails_with_exit_1(tiny_llama_onnx, tmp_path, capsys, rng):
    _perturbed(tiny_llama_onnx, tmp_path / "bad.onnx", rng)
    capsys.readouterr()  # drop what fixtures printed
    assert cli.main(["compare", str(tiny_llama_onnx), str(tmp_path / "bad.onnx"), "--report", "-"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] is False and report["outputs"][0]["rel_l2"] > 1e-4


def test_given_ids_and_past(tiny_llama_onnx, tiny_folded, capsys):
    assert cli.main(["compare", str(tiny_llama_onnx), str(tiny_folded), "--input-ids", "5, 17, 99, 3"]) == 0
    assert "[5, 17, 99, 3] shape [1, 4]" in capsys.readouterr().out


@pytest.mark.parametrize("argv_tail, message", [
    (["--input-ids", "1,500"], "[0, 128)"),
    (["--past-length", "4"], "needs a model with KV-cache inputs"),
    (["--batch", "0"], "--batch must be at least 1"),
    (["--providers", "NoSuchExecutionProvider"], "available"),
])
def test_bad_input_is_one_line(tiny_llama_onnx, tiny_folded, capsys, argv_tail, message):
    assert cli.main(["compare", str(tiny_llama_onnx), str(tiny_folded), *argv_tail]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_kv_cache_model_with_a_real_past(session_tmp, tmp_path, capsys):
    from models import cache

    original = cache.tiny_llama_export(session_tmp, kv_cache=True)
    optimize_file(original, tmp_path / "kv.flashnorm.onnx")
    argv = ["compare", str(original), str(tmp_path / "kv.flashnorm.onnx"), "--past-length", "5", "--sequence", "3",
            "--generate", "4", "--report", str(tmp_path / "r.json")]
    assert cli.main(argv) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    names = [o["name"] for o in report["outputs"]]
    assert names == ["logits"] + [f"present.{i}.{kind}" for i in range(2) for kind in ("key", "value")]
    assert report["outputs"][1]["shape"] == [2, 2, 8, 16]  # 5 past + 3 new positions
    assert all(o["rel_l2"] < 1e-5 for o in report["outputs"]) and report["generation"]["identical"]


def test_missing_model_file(tiny_llama_onnx, tmp_path, capsys):
    assert cli.main(["compare", str(tiny_llama_onnx), str(tmp_path / "absent.onnx")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_text_without_a_known_tokenizer(tiny_folded, capsys):
    # The tiny model was exported from memory (export_causal_lm): no source directory recorded.
    assert cli.main(["compare", str(tiny_folded), str(tiny_folded), "--text", "hello"]) == 2
    assert "--tokenizer" in capsys.readouterr().err


@pytest.mark.slow
def test_real_text_on_smollm2(smollm2_onnx, smollm2_folded_onnx, tmp_path, capsys):
    """--text finds the tokenizer through the metadata `flashnorm export` wrote."""
    argv = ["compare", str(smollm2_onnx), str(smollm2_folded_onnx), "--text", "The capital of France is",
            "--generate", "8", "--max-rel-l2", "1e-5", "--report", str(tmp_path / "r.json")]
    assert cli.main(argv) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["inputs"]["input_ids"].startswith("[504, 3575, 282, 4649, 314]")
    assert report["outputs"][0]["rel_l2"] < 1e-5 and report["generation"]["identical"]
