"""The real model: SmolLM2-135M (a trained Llama: 30 layers, tied embeddings, gains with
negative values) exported, optimized and compared end to end on CPU.

Sites: 30 layers × (input_layernorm + post_attention_layernorm) + the final norm = 61.
Folding: the 60 layer norms feed only Q/K/V or gate/up projections, so their gains fold.
The final norm feeds the LM head, whose weight IS the embedding table (tied): folding its
gain would change the embedding lookups too, so by default it is kept (60 folded); with
--untie the head gets its own copy and all 61 fold.

Why the legacy export can test the tied case at all: the legacy exporter's constant folding
materializes Transpose(embedding) as a second 113 MB initializer, which unties the head in
the file. `flashnorm export` re-ties it (the copy is checked to be exactly the transposed
embedding, then replaced by a Transpose node), so the graph keeps one shared initializer as
the dynamo exporter does; `test_legacy_export_keeps_one_embedding_table` checks that.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from flashnorm import modelio
from flashnorm.match import find_norm_sites
from flashnorm.validate import compare_models, greedy_generate, language_model_feeds, make_session, read_signature, tokenize
from models import cache

pytestmark = pytest.mark.slow

TEXT = (
    "Gravity is the force by which a planet or other body draws objects toward its center. "
    "The force of gravity keeps all of the planets in orbit around the sun."
)
LAYERS, VOCAB, HIDDEN = 30, 49152, 576
SITES = 2 * LAYERS + 1


def _weights(path) -> dict[str, onnx.TensorProto]:
    return {t.name: t for t in onnx.load(str(path), load_external_data=False).graph.initializer}


def test_legacy_export_signature(smollm2_onnx):
    signature = read_signature(smollm2_onnx)
    assert signature.input_names == ["input_ids", "attention_mask", "position_ids"]
    assert signature.output_names == ["logits"]
    for spec in signature.inputs:
        assert spec.shape == ("batch", "sequence")
    assert signature.outputs[0].shape == ("batch", "sequence", VOCAB)
    assert signature.metadata["flashnorm.exporter"] == "legacy"
    model = onnx.load(str(smollm2_onnx), load_external_data=False)
    assert {(o.domain or "ai.onnx"): o.version for o in model.opset_import}["ai.onnx"] == 17


def test_legacy_export_keeps_one_embedding_table(smollm2_onnx):
    weights = _weights(smollm2_onnx)
    tables = [name for name, t in weights.items() if sorted(t.dims) == [HIDDEN, VOCAB]]
    assert tables == ["model.embed_tokens.weight"], "the legacy exporter's untied copy of the head survived"
    graph = onnx.load(str(smollm2_onnx), load_external_data=False).graph
    readers = sorted(n.op_type for n in graph.node if "model.embed_tokens.weight" in n.input)
    assert readers == ["Gather", "Transpose"]


def test_export_matches_torch(smollm2_onnx, smollm2_tokenizer):
    """The exported graph computes what the checkpoint computes (ORT vs torch, fp32)."""
    import torch

    from flashnorm.validate import make_session

    ids = tokenize(TEXT, smollm2_tokenizer)
    feeds = language_model_feeds(read_signature(smollm2_onnx), ids)
    logits = make_session(smollm2_onnx).run(["logits"], feeds)[0]
    with torch.no_grad():
        expected = cache.smollm2_model()(**{k: torch.from_numpy(v) for k, v in feeds.items()}).logits.numpy()
    assert np.abs(logits - expected).max() / np.abs(expected).max() < 1e-5
    assert (logits.argmax(-1) == expected.argmax(-1)).all()


def test_all_sites_found(smollm2_onnx):
    sites = find_norm_sites(modelio.load(smollm2_onnx))
    assert len(sites) == SITES
    assert all(site.gain_convention == "w" for site in sites)
    assert sum(bool(np.any(site.gain < 0)) for site in sites) > 0, "SmolLM2 has negative gains: a fold must handle them"


def _counts(report) -> dict[str, int]:
    return report["summary"]


def test_fold_keeps_tied_head(smollm2_onnx):
    _, report = cache.optimized(smollm2_onnx)
    assert report["norm_sites"] == SITES
    assert _counts(report)["fold.folded"] == SITES - 1
    fold = next(r for r in report["reports"] if r["pass"] == "fold")
    skipped = [s for s in fold["sites"] if s["action"] != "folded"]
    assert len(skipped) == 1 and "model/norm" in skipped[0]["site"] and "tied" in skipped[0]["reason"]
    # A Llama has nothing to cancel: every norm output reaches Q/K/V, gate/up or the head,
    # and no downstream RMSNorm through bias-free homogeneous paths only.
    assert _counts(report).get("cancel.cancelled", 0) == 0


def test_untie_folds_all(smollm2_onnx, smollm2_untied_onnx):
    _, report = cache.optimized(smollm2_onnx, untie=True)  # the fixture's file: its report
    assert _counts(report)["fold.folded"] == SITES
    # The untied copy is a second [VOCAB, HIDDEN]-sized table: the head's own folded weight.
    tables = [t for t in _weights(smollm2_untied_onnx).values() if sorted(t.dims) == [HIDDEN, VOCAB]]
    assert len(tables) == 2


@pytest.mark.parametrize("untie", [False, True], ids=["tied", "untied"])
def test_logits_on_real_text(smollm2_onnx, smollm2_folded_onnx, smollm2_untied_onnx, smollm2_tokenizer, untie):
    optimized = smollm2_untied_onnx if untie else smollm2_folded_onnx
    ids = tokenize(TEXT, smollm2_tokenizer)
    feeds = [language_model_feeds(read_signature(smollm2_onnx), ids)]
    report = compare_models(smollm2_onnx, optimized, feeds, max_rel_l2=1e-5)
    logits = report.output("logits")
    assert report.passed, logits
    assert logits.rel_l2 < 1e-5 and logits.scaled_max_abs < 1e-5
    assert logits.top1_agreement == 1.0
    assert logits.max_abs > 0, "the optimized graph must differ from the original (it was rewritten)"


def test_64_greedy_tokens_identical(smollm2_folded_onnx, smollm2_greedy, smollm2_tokenizer):
    prompt, original = smollm2_greedy
    folded = greedy_generate(make_session(smollm2_folded_onnx), prompt, len(original))
    text = smollm2_tokenizer.decode(original)
    assert len(original) == 64
    assert folded == original, (next(i for i, (a, b) in enumerate(zip(original, folded)) if a != b), text,
                                smollm2_tokenizer.decode(folded))
    assert text.lstrip().startswith("Paris"), text


def test_dynamo_export_tied_fold(smollm2_dynamo_onnx, smollm2_tokenizer):
    """opset 23: RMSNormalization nodes; the dynamo exporter keeps the tie by itself."""
    graph = onnx.load(str(smollm2_dynamo_onnx), load_external_data=False).graph
    assert sum(n.op_type == "RMSNormalization" for n in graph.node) == SITES
    tables = [t for t in graph.initializer if sorted(t.dims) == [HIDDEN, VOCAB]]
    assert len(tables) == 1
    optimized, report = cache.optimized(smollm2_dynamo_onnx)
    assert report["norm_sites"] == SITES
    assert _counts(report)["fold.folded"] == SITES - 1
    ids = tokenize(TEXT, smollm2_tokenizer)
    # Batch 2: the dynamo graph needs position_ids for batch > 1 (they are always inputs here).
    batch = np.concatenate([ids, ids[:, ::-1]], axis=0)
    report = compare_models(smollm2_dynamo_onnx, optimized, [language_model_feeds(read_signature(optimized), batch)])
    logits = report.output("logits")
    assert report.passed and logits.rel_l2 < 1e-5 and logits.top1_agreement == 1.0, logits


@pytest.mark.parametrize("variant", ["original", "folded", "deferred"])
def test_tensorrt_rtx_builds_the_real_model(variant, smollm2_onnx, smollm2_folded_onnx, smollm2_deferred_onnx):
    """TensorRT-RTX's ONNX parser and builder (the same open-source parser as TensorRT) take the
    original, the folded and the folded+cancelled+deferred SmolLM2-135M with no parser error
    and a dynamic profile up to 1×512 tokens; the deferred file's 60 FlashNormMatMul<N> nodes
    are built from their reference functions. Optimization level 0: the parse and the network
    are what is checked here, and it builds in about half the time."""
    import importlib.util
    import os

    from flashnorm.engine import BuildOptions, ShapeRange, build_serialized_engine

    if importlib.util.find_spec("tensorrt_rtx") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("tensorrt_rtx is not installed: CI installs it with the [dev] extra")
        pytest.skip("tensorrt_rtx is not installed (pip install -e '.[dev]')")
    model = {"original": smollm2_onnx, "folded": smollm2_folded_onnx,
             "deferred": smollm2_deferred_onnx}[variant]
    tokens = ShapeRange((1, 1), (1, 64), (1, 512))
    signature = read_signature(model)
    _, report = build_serialized_engine(model, BuildOptions(
        backend="tensorrt-rtx", shapes={name: tokens for name in signature.input_names}, optimization_level=0,
        progress=False))
    assert report["profile"] == {name: "1x1,1x64,1x512" for name in signature.input_names}
    network = report["network"]
    # Every norm's mean of squares, in the graph or a reference body; each reference body also takes
    # the mean (times the RMS statistic's 0: one body for both statistics).
    assert network["mean_reductions"] == SITES + (60 if variant == "deferred" else 0)
    projections = LAYERS * 7 + 1  # q, k, v, o, gate, up, down per layer and the head
    if variant == "deferred":
        assert report["flashnorm_nodes"] == 60 and report["flashnorm_plugin_layers"] == 0
        # One matrix multiply per deferred node instead of one per projection it replaced.
        assert network["layer_types"]["MATRIX_MULTIPLY"] - (projections - LAYERS * 5 + 60) == 2 * LAYERS
    else:
        assert report["flashnorm_nodes"] == 0
        assert network["layer_types"]["MATRIX_MULTIPLY"] - projections == 2 * LAYERS  # attention's two per layer
