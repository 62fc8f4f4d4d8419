"""`flashnorm optimize`: file in, file out, report; bad input is one line, a non-zero exit
and no output file; the input is never modified."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from flashnorm import cli
from flashnorm.errors import FlashNormError
from flashnorm.passes import optimize_file
from synthetic import GraphBuilder, build_attention_block, build_norm_model, feeds, random_gain, relative_error, run


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _compare(reference, candidate, rng) -> float:
    inputs = feeds(onnx.load(str(reference)), rng)
    return max(relative_error(a, e) for a, e in zip(run(str(candidate), inputs), run(str(reference), inputs)))


def test_default_passes_fold_and_cancel(tmp_path, rng, capsys):
    source, target, report_path = tmp_path / "in.onnx", tmp_path / "out.onnx", tmp_path / "r.json"
    onnx.save(build_attention_block(rng, kind="qkv_norm", eps=1e-6), source)
    digest = _digest(source)
    assert cli.main(["optimize", str(source), "-o", str(target), "--report", str(report_path)]) == 0
    assert _digest(source) == digest
    report = json.loads(report_path.read_text())
    assert report["passes"] == ["fold", "cancel"]
    assert report["summary"]["fold.folded"] == 1 and report["summary"]["cancel.cancelled"] == 1
    assert _compare(source, target, rng) < 1e-4  # cancel is eps-approximate (bound tested in passes/)
    out = capsys.readouterr().out
    assert "fold: 1 folded" in out and "cancel: 1 cancelled" in out


@pytest.mark.parametrize("spelling", ["legacy_torch", "rms_normalization", "skip_simplified_layernorm"])
def test_fold_only_is_exact(spelling, tmp_path, rng):
    source, target = tmp_path / "in.onnx", tmp_path / "out.onnx"
    onnx.save(build_norm_model(spelling, rng), source)
    report = optimize_file(source, target, "fold")
    assert report["summary"] == {"fold.folded": 1}
    assert _compare(source, target, rng) < 1e-5


def test_untie_flag_reaches_fold(tmp_path, rng):
    b = GraphBuilder(17)
    table = b.const(rng.standard_normal((30, 16)).astype(np.float32), "embed")
    h = b.op("Gather", [table, "ids"], axis=0)
    sq = b.op("Mul", [h, h])
    rms = b.op("Sqrt", [b.op("Add", [b.op("ReduceMean", [sq], axes=[-1]), b.const(np.array(1e-5, np.float32))])])
    y = b.op("Mul", [b.op("Div", [h, rms]), b.const(random_gain(rng, 16), "gain")])
    logits = b.op("MatMul", [y, b.op("Transpose", [table], perm=[1, 0])])
    source = tmp_path / "tied.onnx"
    onnx.save(b.model([helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "s"])], [logits]), source)
    kept = optimize_file(source, tmp_path / "kept.onnx", "fold")
    assert kept["summary"] == {"fold.skipped": 1}
    untied = optimize_file(source, tmp_path / "untied.onnx", "fold", untie=True)
    assert untied["summary"] == {"fold.folded": 1}
    inputs = {"ids": rng.integers(0, 30, (2, 4)).astype(np.int64)}
    (expected,) = run(str(source), inputs)
    (actual,) = run(str(tmp_path / "untied.onnx"), inputs)
    assert relative_error(actual, expected) < 1e-5


def _normless_model(rng) -> onnx.ModelProto:
    b = GraphBuilder(17)
    out = b.op("MatMul", [b.op("Relu", ["x"]), b.const(rng.standard_normal((8, 4)).astype(np.float32))])
    return b.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])], [out])


def _invalid_model(rng) -> onnx.ModelProto:
    model = build_norm_model("pow_div", rng)
    model.graph.node[0].input[0] = "no_such_tensor"
    return model


BAD_INPUTS = {
    "not_onnx": (lambda path, rng: path.write_bytes(b"\x00garbage, not a protobuf\xff" * 10), [], "not an ONNX"),
    "invalid_model": (lambda path, rng: onnx.save(_invalid_model(rng), path), [], "not a valid ONNX model"),
    "no_norms": (lambda path, rng: onnx.save(_normless_model(rng), path), [], "no RMSNorm or LayerNorm found"),
    "unknown_pass": (lambda path, rng: onnx.save(build_norm_model("pow_div", rng), path),
                     ["--passes", "fold,magic"], "unknown pass 'magic'"),
    "missing_input": (lambda path, rng: None, [], "does not exist"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_line_and_leaves_nothing(case, tmp_path, rng, capsys):
    write, extra, message = BAD_INPUTS[case]
    source, target = tmp_path / "in.onnx", tmp_path / "out.onnx"
    write(source, rng)
    before = _digest(source) if source.exists() else None
    assert cli.main(["optimize", str(source), "-o", str(target), *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err, err
    assert not target.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == (["in.onnx"] if before else [])
    assert (before is None) or _digest(source) == before


def test_unwritable_output_is_refused(tmp_path, rng, capsys):
    source = tmp_path / "in.onnx"
    onnx.save(build_norm_model("pow_div", rng), source)
    assert cli.main(["optimize", str(source), "-o", str(tmp_path / "missing_dir" / "out.onnx")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot write" in err
    assert not (tmp_path / "missing_dir").exists()


def test_output_over_input_is_refused(tmp_path, rng):
    source = tmp_path / "in.onnx"
    onnx.save(build_norm_model("pow_div", rng), source)
    digest = _digest(source)
    with pytest.raises(FlashNormError, match="never overwrites its input"):
        optimize_file(source, source)
    assert _digest(source) == digest


def test_verbose_lists_every_skipped_site(tmp_path, rng, capsys):
    # Per-head q/k norms feed a Transpose: fold and defer skip both, cancel skips all 3 sites.
    source = tmp_path / "in.onnx"
    onnx.save(build_attention_block(rng, kind="qk_norm"), source)
    outputs = {}
    for flags in ([], ["-v"]):
        assert cli.main(["optimize", str(source), "-o", str(tmp_path / "out.onnx"), "--passes", "fold,cancel,defer",
                         *flags]) == 0
        outputs[bool(flags)] = capsys.readouterr().out.splitlines()
    grouped = [line for line in outputs[False] if "skipped" in line and line.startswith("    ")]
    assert len(grouped) == 3 and all(line.startswith("    skipped (") for line in grouped)
    assert "    skipped (3 sites, e.g. " in "\n".join(grouped)
    every_site = [line for line in outputs[True] if ": skipped: " in line]
    assert len(every_site) == 2 + 3 + 2, "one line per site and pass"
    assert not any("'…'" in line for line in every_site), "each site's own reason, names included"


def test_text_report_groups_skipped_sites_by_reason():
    from flashnorm.tools.optimize import format_text

    sites = [{"site": f"norm{i}", "action": "skipped", "reason": f"consumer MatMul 'mm{i}' is not a projection"}
             for i in range(30)]
    sites += [{"site": "final", "action": "skipped", "reason": "the normalized tensor is a graph output"},
              {"site": "norm30", "action": "deferred", "reason": ""}]
    report = {"input": "in.onnx", "output": "out.onnx", "norm_sites": 32,
              "reports": [{"pass": "defer", "counts": {"skipped": 31, "deferred": 1}, "sites": sites}]}
    lines = format_text(report).splitlines()
    assert lines[1:] == ["  defer: 31 skipped, 1 deferred",
                         "    skipped (30 sites, e.g. norm0): consumer MatMul '…' is not a projection",
                         "    skipped (final): the normalized tensor is a graph output"]
    verbose = format_text(report, verbose=True).splitlines()
    assert len(verbose) == 2 + 31 and "    norm7: skipped: consumer MatMul 'mm7' is not a projection" in verbose
