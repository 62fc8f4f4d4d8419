"""`flashnorm compare` from the command line: pass → exit 0, fail → exit 1 with the failing
output named, bad input → one line and exit 2; on the real model with real text; and on graphs
without input_ids (synthetic norm blocks, fp16, integer and bool inputs), fed seeded random
tensors."""

from __future__ import annotations

import json
import re

import numpy as np
import onnx
import onnx.numpy_helper as onh
import pytest

from onnx import TensorProto, helper

from flashnorm import cli
from flashnorm.passes import optimize_file
from flashnorm.progress import Progress
from synthetic import build_norm_model


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
    assert "PASS logits [3, 9, 128]" in out
    assert "generation on onnxruntime (CPUExecutionProvider): 6 greedy tokens identical" in out
    report = json.loads((tmp_path / "r.json").read_text())
    logits = report["outputs"][0]
    assert report["passed"] and logits["rel_l2"] < 1e-5 and logits["top1_agreement"] == 1.0
    assert report["inputs"]["seed"] == 7 and report["generation"]["identical"]
    assert report["generation"]["runner"] == "onnxruntime (CPUExecutionProvider)"


def test_perturbed_model_fails_with_exit_1(tiny_llama_onnx, tmp_path, capsys, rng):
    _perturbed(tiny_llama_onnx, tmp_path / "bad.onnx", rng)
    capsys.readouterr()  # drop what fixtures printed
    assert cli.main(["compare", str(tiny_llama_onnx), str(tmp_path / "bad.onnx"), "--report", "-"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] is False and report["outputs"][0]["rel_l2"] > 1e-4


def test_quiet_still_ends_a_failed_comparison_with_its_verdict_and_seed(tiny_llama_onnx, tmp_path, capsys, rng):
    _perturbed(tiny_llama_onnx, tmp_path / "bad.onnx", rng)
    capsys.readouterr()
    assert cli.main(["compare", str(tiny_llama_onnx), str(tmp_path / "bad.onnx"), "-q", "--seed", "5"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert re.fullmatch(r"flashnorm compare: failed: output logits: max abs \S+, rel L2 \S+ \(atol 0.0001, rtol 0.001, "
                        r"max rel L2 1e-05\); seed 5 \(--seed 5 replays these inputs\)\n", captured.err), captured.err


def test_given_ids_and_past(tiny_llama_onnx, tiny_folded, capsys):
    assert cli.main(["compare", str(tiny_llama_onnx), str(tiny_folded), "--input-ids", "5, 17, 99, 3"]) == 0
    assert "[5, 17, 99, 3] shape [1, 4]" in capsys.readouterr().out


@pytest.mark.parametrize("argv_tail, message", [
    (["--input-ids", "1,500"], "[0, 128)"),
    (["--past-length", "4"], "needs a model with KV-cache inputs"),
    (["--batch", "0"], "argument --batch: must be at least 1"),
    # Refused before allocating, not OOM-killed: the export records the model's context (128 tokens).
    (["--sequence", "1000000"], "--sequence: 1000000 positions exceed the model's context of 128 tokens"),
    (["--generate", "10000000"], "--sequence/--generate: 10000016 positions exceed the model's context of 128"),
    (["--providers", "NoSuchExecutionProvider"], "available"),
])
def test_bad_input_is_one_line(tiny_llama_onnx, tiny_folded, capsys, argv_tail, message):
    assert cli.main(["compare", str(tiny_llama_onnx), str(tiny_folded), *argv_tail]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_sizes_beyond_memory_are_refused_where_no_context_is_recorded(tiny_llama_onnx, tmp_path, capsys):
    import onnx

    model = onnx.load(str(tiny_llama_onnx))
    kept = [(p.key, p.value) for p in model.metadata_props if p.key != "flashnorm.context_length"]
    del model.metadata_props[:]
    onnx.helper.set_model_props(model, dict(kept))
    onnx.save(model, str(tmp_path / "other-exporter.onnx"))
    for tail, message in ((["--sequence", "1000000"], "--batch/--sequence/--iterations: these sizes need at least"),
                          (["--generate", "10000000"], "--generate/--tokens: these sizes need at least")):
        assert cli.main(["compare", str(tmp_path / "other-exporter.onnx"), str(tmp_path / "other-exporter.onnx"),
                         *tail]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err


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


# ── models without input_ids: seeded random tensors ────────────────────────────────────────

def _save_norm_model(spelling: str, directory, rng) -> tuple[str, str]:
    """A synthetic RMSNorm → projections model and its FlashNorm-folded version."""
    original, folded = directory / f"{spelling}.onnx", directory / f"{spelling}.flashnorm.onnx"
    onnx.save(build_norm_model(spelling, rng), str(original))
    report = optimize_file(original, folded)
    assert report["summary"]["fold.folded"] == 1  # the candidate really differs from the reference
    return str(original), str(folded)


def _scaled_initializer(source, destination, name_prefix: str, factor: float = 1.01) -> str:
    """The model with its first initializer whose name starts with `name_prefix` scaled by `factor`:
    a small, real accuracy bug; returns that initializer's name."""
    model = onnx.load(str(source))
    weight = next(t for t in model.graph.initializer if t.name.startswith(name_prefix))
    array = onh.to_array(weight)
    weight.CopyFrom(onh.from_array((array * factor).astype(array.dtype), weight.name))
    onnx.save(model, str(destination))
    return weight.name


def _save(nodes, inputs, outputs, initializers, path, check: bool = True) -> str:
    model = helper.make_model(helper.make_graph(nodes, "block", inputs, outputs, initializers),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    if check:  # the checker wants a shape on every graph input and output
        onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return str(path)


def test_folded_norm_block_passes(tmp_path, capsys, rng):
    original, folded = _save_norm_model("pow_div", tmp_path, rng)
    argv = ["compare", original, folded, "--iterations", "2", "--seed", "11", "--report", str(tmp_path / "r.json")]
    assert cli.main(argv) == 0
    assert "input x: float32 [1, 16, 32] normal(0, 1)" in capsys.readouterr().out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["passed"] and report["inputs"] == {
        "seed": 11, "iterations": 2, "input x": "float32 [1, 16, 32] normal(0, 1)",
    }
    assert [o["name"] for o in report["outputs"]] == [o.name for o in onnx.load(original).graph.output]
    assert all(o["passed"] and o["rel_l2"] < 1e-5 and o["shape"][:2] == [1, 16] for o in report["outputs"])


def test_perturbed_norm_block_fails_with_exit_1(tmp_path, capsys, rng):
    original, folded = _save_norm_model("pow_div", tmp_path, rng)
    _scaled_initializer(folded, tmp_path / "bad.onnx", "w_")
    capsys.readouterr()
    assert cli.main(["compare", original, str(tmp_path / "bad.onnx"), "--report", "-"]) == 1
    report = json.loads(capsys.readouterr().out)
    failed = [o for o in report["outputs"] if not o["passed"]]
    assert report["passed"] is False and len(failed) == 1 and failed[0]["rel_l2"] > 1e-3
    assert sum(o["passed"] for o in report["outputs"]) == len(report["outputs"]) - 1


def test_input_shapes_size_the_shared_dynamic_axes(tmp_path, rng):
    """x and skip are both [batch, seq, 32]: giving x's shape sizes skip too."""
    original, folded = _save_norm_model("skip_simplified_layernorm", tmp_path, rng)
    argv = ["compare", original, folded, "--input-shapes", "x:3x5x32", "--report", str(tmp_path / "r.json")]
    assert cli.main(argv) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["inputs"]["input skip"] == "float32 [3, 5, 32] normal(0, 1)"
    assert [o["shape"] for o in report["outputs"]] == [[3, 5, 48], [3, 5, 16], [3, 5, 16], [3, 5, 32]]
    assert all(o["rel_l2"] < 1e-5 for o in report["outputs"])


def test_float16_model(tmp_path, rng):
    """fp16 throughout, a fold in fp16: x·g → W against x → fp16(diag(g)·W); the two differ by
    fp16 rounding of the folded weight, which the tolerances admit and a 1% error does not."""
    gain = rng.normal(1.0, 0.5, 64).astype(np.float16)
    weight = (rng.standard_normal((64, 24)) / 8).astype(np.float16)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["batch", "seq", 64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["batch", "seq", 24])
    reference = _save([helper.make_node("Mul", ["x", "g"], ["scaled"]),
                       helper.make_node("MatMul", ["scaled", "w"], ["y"])], [x], [y], [onh.from_array(gain, "g"), onh.from_array(weight, "w")], tmp_path / "fp16.onnx")
    folded = (gain.astype(np.float32)[:, None] * weight.astype(np.float32)).astype(np.float16)
    candidate = _save([helper.make_node("MatMul", ["x", "w_folded"], ["y"])], [x], [y],
                      [onh.from_array(folded, "w_folded")], tmp_path / "fp16.folded.onnx")
    tolerances = ["--atol", "1e-2", "--rtol", "1e-2", "--max-rel-l2", "3e-3", "--report", str(tmp_path / "r.json")]
    assert cli.main(["compare", reference, candidate, "--input-shapes", "x:2x8x64", *tolerances]) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["inputs"]["input x"] == "float16 [2, 8, 64] normal(0, 1)"
    assert 0 < report["outputs"][0]["rel_l2"] < 3e-3  # fp16 rounding: present, and small
    _scaled_initializer(candidate, tmp_path / "bad.onnx", "w_folded")
    assert cli.main(["compare", reference, str(tmp_path / "bad.onnx"), *tolerances]) == 1


def _embedding_pair(tmp_path, rng) -> tuple[str, str, np.ndarray]:
    """ids (int64) → table → ±(by a bool mask) → projection, against the same with the projection
    folded into the table: (table·W)[ids] = table[ids]·W."""
    table = rng.standard_normal((16, 32)).astype(np.float32)
    weight = (rng.standard_normal((32, 8)) / 6).astype(np.float32)
    inputs = [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"]),
              helper.make_tensor_value_info("mask", TensorProto.BOOL, ["batch", "seq", 1])]
    y = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 8])]
    signed = [helper.make_node("Neg", ["e"], ["minus"]), helper.make_node("Where", ["mask", "e", "minus"], ["s"])]
    reference = _save([helper.make_node("Gather", ["table", "ids"], ["e"]), *signed,
                       helper.make_node("MatMul", ["s", "w"], ["y"])], inputs, y,
                      [onh.from_array(table, "table"), onh.from_array(weight, "w")], tmp_path / "embed.onnx")
    candidate = _save([helper.make_node("Gather", ["projected", "ids"], ["e"]), *signed[:1],
                       helper.make_node("Where", ["mask", "e", "minus"], ["y"])], inputs, y,
                      [onh.from_array(table @ weight, "projected")], tmp_path / "embed.folded.onnx")
    return reference, candidate, table @ weight


def test_integer_and_bool_inputs(tmp_path, rng):
    reference, candidate, _ = _embedding_pair(tmp_path, rng)
    argv = ["compare", reference, candidate, "--input-shapes", "ids:4x8", "--report", str(tmp_path / "r.json")]
    assert cli.main(argv) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["inputs"]["input ids"] == "int64 [4, 8] integers in [0, 16)"
    assert report["inputs"]["input mask"] == "bool [4, 8, 1] True/False"
    assert report["outputs"][0]["shape"] == [4, 8, 8] and report["outputs"][0]["rel_l2"] < 1e-5


def test_val_range_keeps_ids_away_from_bad_rows(tmp_path, rng):
    """Rows 4..15 of the candidate's table are wrong: only ids in [0, 4) pass."""
    reference, candidate, projected = _embedding_pair(tmp_path, rng)
    model = onnx.load(candidate)
    corrupted = projected.copy()
    corrupted[4:] *= 1.5
    model.graph.initializer[0].CopyFrom(onh.from_array(corrupted, "projected"))
    onnx.save(model, str(tmp_path / "corrupted.onnx"))
    argv = ["compare", reference, str(tmp_path / "corrupted.onnx"), "--input-shapes", "ids:2x64"]
    assert cli.main([*argv, "--val-range", "ids:[0,4]"]) == 0
    assert cli.main(argv) == 1


def test_shapeless_input_is_refused(tmp_path, capsys):
    """An input without even a rank: Polygraphy would take it for a scalar; one line instead."""
    free = [helper.make_tensor_value_info("free", TensorProto.FLOAT, None)]
    out = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    model = _save([helper.make_node("Relu", ["free"], ["y"])], free, out, [], tmp_path / "relu.onnx", check=False)
    assert cli.main(["compare", model, model, "--input-shapes", "free:3x4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "input(s) ['free'] declare no shape" in err


@pytest.mark.parametrize("case, argv_tail, message", [
    ("other inputs", [], "the models take different inputs: reference ['skip', 'x'] vs candidate ['x']"),
    ("same", ["--input-shapes", "x:2x5"], "x: [2, 5] has rank 2, but x is declared [batch, seq, 32]"),
    ("same", ["--input-shapes", "x:2x5x32", "skip:3x5x32"], "axis 'batch' is 2 in x but 3 in skip"),
    ("same", ["--input-shapes", "y:1x2x32"], "--input-shapes names ['y'], not inputs of the model"),
    ("same", ["--val-range", "x:1"], "bad --val-range 'x:1'"),
    ("same", ["--generate", "3", "--batch", "2"], "--batch/--generate: only for token models"),
    ("same", ["--iterations", "0"], "argument --iterations: must be at least 1"),
    ("fp16 candidate", [], "input x is float32 in the reference but float16 in the candidate"),
    ("fixed candidate", [], "input skip: the candidate declares [2, 5, 32] and cannot take the shape [1, 16, 32]"),
])
def test_bad_generic_input_is_one_line(tmp_path, capsys, rng, case, argv_tail, message):
    original, folded = _save_norm_model("skip_simplified_layernorm", tmp_path, rng)
    if case == "other inputs":
        folded = _save_norm_model("pow_div", tmp_path, rng)[1]
    if case in ("fp16 candidate", "fixed candidate"):  # the candidate declares its inputs differently
        model = onnx.load(folded)
        x, skip = sorted(model.graph.input, key=lambda v: v.name != "x")[:2]
        if case == "fp16 candidate":
            x.type.tensor_type.elem_type = TensorProto.FLOAT16
        else:
            skip.CopyFrom(helper.make_tensor_value_info("skip", TensorProto.FLOAT, [2, 5, 32]))
        onnx.save(model, str(tmp_path / "declared.onnx"))
        folded = str(tmp_path / "declared.onnx")
    assert cli.main(["compare", original, folded, *argv_tail]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_random_tensor_options_on_a_token_model(tiny_llama_onnx, tiny_folded, capsys):
    assert cli.main(["compare", str(tiny_llama_onnx), str(tiny_folded), "--input-shapes", "input_ids:1x4"]) == 2
    assert "are for models without input_ids" in capsys.readouterr().err
