"""`flashnorm inspect`: every site with spelling, eps, gain statistics, consumers, and
whether fold and cancel apply (and why not)."""

from __future__ import annotations

import json

import numpy as np
import onnx
from onnx import TensorProto, helper

from flashnorm import cli
from synthetic import GraphBuilder, build_attention_block, build_norm_model, random_gain

_SITE_PREFIXES = {f"#{i}" for i in range(10)}  # a reason line starts with its site's number


def test_text_table_lists_sites_and_reasons(tmp_path, rng, capsys):
    path = tmp_path / "block.onnx"
    onnx.save(build_attention_block(rng, kind="qk_norm"), path)
    assert cli.main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split()[:5] == ["#", "site", "kind", "spelling", "eps"]
    assert sum(1 for line in lines if " decomposed " in line) == 3
    assert "#0 cancel: path reaches graph output" in out  # QK-only: V has no downstream norm
    assert "not a linear op with a constant weight" in out  # per-head norms feed a Transpose
    assert "3 sites, 1 foldable, 0 cancellable, 1 deferrable after fold" in out


def test_reasons_grouped_and_every_site_with_verbose(tmp_path, rng, capsys):
    path = tmp_path / "block.onnx"
    onnx.save(build_attention_block(rng, kind="qk_norm"), path)
    outputs = {}
    for flags in ([], ["-v"]):
        assert cli.main(["inspect", str(path), *flags]) == 0
        outputs[bool(flags)] = capsys.readouterr().out.splitlines()
    reasons = [line for line in outputs[False] if line[:2] in _SITE_PREFIXES]
    assert reasons == [
        "#1 fold: consumer Transpose '…' is not a linear op with a constant weight (2 sites)",
        "#0 cancel: path reaches graph output '…' without a downstream RMSNorm (3 sites)",
        "#1 defer: fold leaves the gain here (its reason says why); defer needs a weightless norm (2 sites)",
    ]
    every_site = [line for line in outputs[True] if line[:2] in _SITE_PREFIXES]
    assert len(every_site) == 2 + 3 + 2, "one line per site and step"
    assert "#2 fold: consumer Transpose 'Transpose_61' is not a linear op with a constant weight" in every_site
    table = outputs[False][:4]
    assert outputs[True][:4] == table, "the table lists every site either way"


def test_json_report_has_every_field(tmp_path, rng, capsys):
    path = tmp_path / "block.onnx"
    onnx.save(build_attention_block(rng, kind="qkv_norm"), path)
    assert cli.main(["inspect", str(path), "--report", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["norm_sites"] == 4 and report["foldable"] == 1 and report["cancellable"] == 1
    assert report["deferrable"] == 1 and not report["sites"][1]["defer"]["applies"]
    first = report["sites"][0]
    assert first["spelling"] == "decomposed" and first["gain_convention"] == "w"
    assert first["eps"] == np.float32(1e-6).item()
    assert first["gain"]["negatives"] > 0 and first["gain"]["min"] < 0 < first["gain"]["max"]
    assert [c.split()[0] for c in first["consumers"]] == ["MatMul"] * 3
    assert first["fold"]["applies"] and first["cancel"]["applies"] and len(first["cancel"]["downstream"]) == 3
    v_norm = report["sites"][3]
    assert v_norm["gain"] is None and v_norm["weightless"] and not v_norm["fold"]["applies"]


def test_gemma_convention_and_report_file(tmp_path, rng, capsys):
    path, report_path = tmp_path / "gemma.onnx", tmp_path / "r.json"
    onnx.save(build_norm_model("gemma_add_one", rng), path)
    assert cli.main(["inspect", str(path), "--report", str(report_path), "-q"]) == 0
    assert capsys.readouterr().out == ""
    (site,) = json.loads(report_path.read_text())["sites"]
    assert site["gain_convention"] == "1+w" and site["fold"]["applies"]


def test_model_without_a_norm_lists_near_misses(tmp_path, rng, capsys):
    b = GraphBuilder(17)
    y = b.op("LayerNormalization", ["x", b.const(random_gain(rng, 8)), b.const(np.zeros(8, np.float32))], axis=0)
    path = tmp_path / "ln.onnx"
    onnx.save(b.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])], [y]), path)
    assert cli.main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "no RMSNorm or LayerNorm sites found" in out and "rejected LayerNormalization" in out


def test_layernorm_sites_show_their_kind_route_and_refusals(tmp_path, rng, capsys):
    """A pre-LN site folds and defers; a post-LN one (its output also the residual) is refused,
    with the reason; cancel says why it is for RMSNorm."""
    from synthetic import build_post_ln_block

    path = tmp_path / "ln.onnx"
    onnx.save(build_norm_model("ln_decomposed", rng, consumer="biased"), path)
    assert cli.main(["inspect", str(path), "--report", "-"]) == 0
    (site,) = json.loads(capsys.readouterr().out)["sites"]
    assert site["kind"] == "layer" and site["bias"]["size"] == 32 and not site["weightless"]
    assert site["fold"]["applies"] and site["defer"]["applies"] and not site["cancel"]["applies"]
    assert "Proposition 3" in site["cancel"]["reason"]

    onnx.save(build_post_ln_block(rng), path)
    assert cli.main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert " layer " in out.splitlines()[1]
    assert "fold: post-LN: the normalized tensor is also the residual stream (feeds Add" in out
    assert "defer: post-LN: the normalized tensor is also the residual stream" in out


def test_not_onnx_is_one_line(tmp_path, capsys):
    path = tmp_path / "x.onnx"
    path.write_text("hello")
    assert cli.main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not an ONNX model" in err


def test_inspect_changes_nothing(rng):
    import onnx_graphsurgeon as gs

    from flashnorm.passes.dry_run import inspect_graph

    model = build_attention_block(rng, kind="qkv_norm", dynamic_shape=True)
    del model.graph.value_info[:]
    graph = gs.import_onnx(model)
    before = gs.export_onnx(graph).SerializeToString()
    report = inspect_graph(graph)
    assert report["foldable"] == 1 and report["cancellable"] == 1
    assert gs.export_onnx(graph).SerializeToString() == before
