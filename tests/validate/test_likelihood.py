"""The quantized-model budget (flashnorm.validate.likelihood): the NLL it measures equals
transformers' loss for the same tokens, a model with a KV cache measures the same as one
without, the budget's arithmetic, the shipped text, and `flashnorm compare --budget` on a
fake-quantized pair (QuantizeLinear → DequantizeLinear on every MatMul weight)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from flashnorm import cli
from flashnorm.errors import FlashNormError
from flashnorm.progress import Progress
from flashnorm.validate import likelihood
from flashnorm.validate.runners import make_session
from models import cache

pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setattr(Progress, "enabled", False)


def fake_quantized(source, path, *, scale_factor=1.0, head_factor=1.0):
    """`source` with every 2-D MatMul weight behind an int8 QuantizeLinear → DequantizeLinear
    (per output column); the quantization step times `scale_factor` (coarser above 1), and the
    final norm's gain (so the logits) times `head_factor`."""
    model = onnx.load(str(source))
    graph = model.graph
    weights = {t.name: t for t in graph.initializer}
    final_gain = weights["model.norm.weight"]
    final_gain.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(final_gain) * np.float32(head_factor),
                                                final_gain.name))
    nodes = []
    for node in graph.node:
        name = node.input[1] if node.op_type == "MatMul" and len(node.input) > 1 else None
        if name in weights and len(weights[name].dims) == 2:
            values = numpy_helper.to_array(weights[name]).astype(np.float64)
            scale = (np.abs(values).max(axis=0) / 127 * scale_factor).astype(np.float32)
            scale[scale == 0] = 1
            q = np.clip(np.round(values / scale), -128, 127).astype(np.int8)
            graph.initializer.extend([numpy_helper.from_array(q, f"{name}.q"), numpy_helper.from_array(scale, f"{name}.s")])
            nodes.append(helper.make_node("DequantizeLinear", [f"{name}.q", f"{name}.s"], [f"{name}.dq"], axis=1))
            node.input[1] = f"{name}.dq"
        nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="module")
def trio(session_tmp):
    fp32 = cache.tiny_llama_export(session_tmp)
    directory = session_tmp / "likelihood"
    directory.mkdir(exist_ok=True)
    reference = fake_quantized(fp32, directory / "int8.onnx")
    worse = fake_quantized(fp32, directory / "int8.worse.onnx", head_factor=3.0)
    return fp32, reference, worse


def _ids(n=40, seed=0):
    return np.random.default_rng(seed).integers(0, cache.TINY_LLAMA["vocab_size"], n).tolist()


def test_nll_is_the_loss_transformers_gives(session_tmp):
    import torch

    fp32 = cache.tiny_llama_export(session_tmp)
    ids = _ids()
    with torch.no_grad():
        loss = float(cache.tiny_llama_model()(torch.tensor([ids]), labels=torch.tensor([ids])).loss)
    nll = likelihood.token_nll(make_session(fp32), ids)
    assert nll.shape == (len(ids) - 1,)
    assert nll.mean() == pytest.approx(loss, rel=1e-5)
    # Windows: each window predicts all but its first token.
    assert likelihood.token_nll(make_session(fp32), ids, window=16).shape == (len(ids) - 1 - 2,)


def test_a_model_with_a_kv_cache_measures_the_same(session_tmp):
    plain = cache.tiny_llama_export(session_tmp)
    with_cache = cache.tiny_llama_export(session_tmp, kv_cache=True)
    ids = _ids()
    a = likelihood.measure(plain, ids, prompt_tokens=8, greedy=6)
    b = likelihood.measure(with_cache, ids, prompt_tokens=8, greedy=6)
    assert a.nll == pytest.approx(b.nll, rel=1e-5) and a.greedy == b.greedy and len(a.greedy) == 6
    assert a.quantized_ops == {}


def test_the_limit():
    assert likelihood.nll_limit(2.0, 2.5) == pytest.approx(0.55)
    assert likelihood.nll_limit(2.0, 1.9) == likelihood.MIN_ALLOWANCE == 0.002
    assert likelihood.nll_limit(2.0, 2.0) == 0.002
    assert likelihood.nll_limit(2.0, 3.0, max_extra_ratio=2) == 2.0


def test_quantized_ops_are_counted(trio):
    fp32, reference, _ = trio
    assert likelihood.quantized_ops(fp32) == {}
    assert likelihood.quantized_ops(reference) == {"DequantizeLinear": 14}  # 7 per layer (the tied head is a Transpose)


def test_shipped_texts():
    """Four kinds of writing, each about 2 000 SmolLM2 tokens (the counts are in data/README.md;
    5 800–9 700 characters), each header dropped and nothing else: code lines that start with
    '#' stay."""
    texts = {name: likelihood.shipped_text(name) for name in likelihood.SHIPPED_TEXTS}
    assert set(texts) == {"declaration", "botchan", "midsummer", "sqlite"}
    assert likelihood.shipped_text() == texts["declaration"] and "Four score and seven years ago" in texts["declaration"]
    assert texts["botchan"].startswith("CHAPTER I\nBecause of an hereditary recklessness")
    assert texts["midsummer"].startswith("ACT I") and "THESEUS" in texts["midsummer"]
    assert texts["sqlite"].startswith("/*\n** 2001-09-15") and "\n#define SQLITE_VERSION " in texts["sqlite"]
    for name, text in texts.items():
        assert not text.startswith("#") and "Public domain:" not in text, name
        assert 5_000 < len(text) < 10_000, (name, len(text))
    assert likelihood.shipped_text_names(None) == likelihood.shipped_text_names("all") == list(texts)
    assert likelihood.shipped_text_names("sqlite") == ["sqlite"]
    with pytest.raises(FlashNormError, match="choose from declaration, botchan, midsummer, sqlite or all"):
        likelihood.shipped_text_names("hamlet")


def test_judge_nll_budget(trio):
    fp32, reference, worse = trio
    ids = _ids(64)
    # `worse` costs NLL (so there is a ratio): the same file as candidate is the ratio 1 in every draw.
    same = likelihood.judge_nll_budget(fp32, worse, worse, ids, text="ids", greedy=4, block=4)
    assert same.passed and same.candidate_nll == same.reference_nll and same.interval["high"] == 1
    assert same.candidate_agrees_with_reference == 4 and same.quantized_ops["candidate"]
    bad = likelihood.judge_nll_budget(fp32, reference, worse, ids, text="ids", greedy=4, block=4)
    assert not bad.passed and bad.verdict == "over" and bad.candidate_extra > bad.limit


def test_compare_budget_on_a_quantized_pair(trio, tmp_path, capsys):
    fp32, reference, worse = trio
    ids = ",".join(map(str, _ids(48)))
    report_path = tmp_path / "report.json"
    argv = ["compare", str(worse), str(worse), "--budget", str(fp32), "--input-ids", ids,
            "--optimization-level", "basic", "--generate", "5", "--budget-segment", "4", "--report", str(report_path)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    report = json.loads(report_path.read_text())["quantized_budget"]
    assert report["passed"] and report["tokens"] == 48 and len(report["candidate_greedy"]) == 5
    assert "quantized budget: mean NLL per token" in out and "PASSED" in out
    argv[1:3] = [str(reference), str(worse)]
    assert cli.main(argv) == 1
    assert "FAILED" in capsys.readouterr().out
    argv[argv.index("--budget-segment") + 1] = "8"  # 48 tokens: 6 segments, too few for an interval
    assert cli.main(argv) == 4
    out = capsys.readouterr().out
    assert "INCONCLUSIVE: too little text for an interval" in out and "47 tokens make 6 segment(s)" in out
    assert "(48 tokens, 47 of them predicted)" in out  # the first has no context to be predicted from


def test_compare_budget_refuses_a_quantized_float_model(trio, capsys):
    fp32, reference, _ = trio
    assert cli.main(["compare", str(reference), str(reference), "--budget", str(reference), "--input-ids", "1,2,3"]) == 2
    assert "is not a float32 model" in capsys.readouterr().err


def test_compare_budget_inconclusive_exits_4(trio, tmp_path, capsys):
    """A line set at the candidate's own ratio: the interval spans it, exit 4, and the report
    says how much text would settle it; the seed is printed and in the report."""
    fp32, _, reference = trio  # the worse one: its extra NLL is positive, so there is a ratio
    coarser = fake_quantized(fp32, tmp_path / "int8.coarser.onnx", scale_factor=1.5, head_factor=3.1)
    ids = ",".join(map(str, _ids(96)))
    argv = ["compare", str(reference), str(coarser), "--budget", str(fp32), "--input-ids", ids,
            "--optimization-level", "basic", "--budget-segment", "8", "--budget-seed", "5"]
    first = cli.main([*argv, "--budget-ratio", "100", "--report", str(tmp_path / "a.json")])
    measured = json.loads((tmp_path / "a.json").read_text())["quantized_budget"]
    assert first == 0 and measured["verdict"] == "within" and measured["bootstrap"]["seed"] == 5
    interval = measured["interval"]
    assert interval["statistic"] == "ratio" and interval["segments"] == 12
    assert interval["low"] < interval["estimate"] < interval["high"]
    capsys.readouterr()
    line = f"{interval['estimate']:.6f}"
    assert cli.main([*argv, "--budget-ratio", line, "--report", str(tmp_path / "b.json")]) == 4
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "b.json").read_text())["quantized_budget"]
    assert report["verdict"] == "inconclusive" and report["exit_code"] == 4 and not report["passed"]
    assert "INCONCLUSIVE" in out and "seed 5" in out and "exit 4" in out


def test_genai_config_beside_the_model_is_read_as_untrusted(tmp_path):
    import os

    model = tmp_path / "model.onnx"
    assert likelihood.past_head_size(model) is None  # no genai_config.json: nothing declared
    config = tmp_path / "genai_config.json"
    config.write_text(json.dumps({"model": {"decoder": {"head_size": 64}}}))
    assert likelihood.past_head_size(model) == 64
    config.write_text(json.dumps({"model": []}))
    assert likelihood.past_head_size(model) is None  # another layout: the model's own shapes decide
    config.unlink()
    os.mkfifo(config)  # a FIFO without a writer: refused at once, never waited on
    with pytest.raises(FlashNormError, match="genai config .* is a FIFO, not a regular file"):
        likelihood.past_head_size(model)
