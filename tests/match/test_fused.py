"""One-node norm spellings: opset-23 RMSNormalization, ONNX Runtime's
SimplifiedLayerNormalization and SkipSimplifiedLayerNormalization (RMSNorm); opset-17
LayerNormalization and ONNX Runtime's SkipLayerNormalization (LayerNorm)."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto, helper

from flashnorm.match import find_norm_candidates, find_norm_sites
from synthetic import SPELLING_FAMILY, SPELLING_KIND, GraphBuilder, build_norm_model, random_bias, random_gain


@pytest.mark.parametrize("spelling", sorted(SPELLING_FAMILY))
def test_fused_spellings_are_found(spelling, rng):
    eps = float(10 ** rng.uniform(-7, -4))
    (site,) = find_norm_sites(gs.import_onnx(build_norm_model(spelling, rng, eps=eps)))
    assert site.spelling == SPELLING_FAMILY[spelling] and site.kind == SPELLING_KIND[spelling]
    assert site.eps == pytest.approx(eps, rel=1e-6)
    assert site.gain_index == (2 if "Skip" in site.spelling else 1)
    assert np.any(site.gain < 0) and len(site.consumers) == 3
    if "Skip" in site.spelling:
        assert [t.name for t in site.data_inputs][1] == "skip"
        assert site.residual_output is not None
    if site.kind == "layer":
        assert site.bias_node is site.nodes[0] and site.bias_index == site.gain_index + 1
        assert np.any(site.bias != 0) and not site.is_weightless


def test_com_microsoft_simplified_layernorm_is_found(rng):
    b = GraphBuilder(17)
    gain = random_gain(rng, 16)
    y = b.op("SimplifiedLayerNormalization", ["x", b.const(gain, "gain")], domain="com.microsoft", epsilon=1e-6)
    out = b.op("MatMul", [y, b.const(rng.standard_normal((16, 4)).astype(np.float32))])
    # ONNX Runtime registers this op in the default domain only, so the model is built
    # without running it (GraphBuilder.model would, to shape the contrib op's output).
    model = helper.make_model(helper.make_graph(
        b.nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16])],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, ["n", 4])], b.initializers,
    ), opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    graph = gs.import_onnx(model)
    (site,) = find_norm_sites(graph)
    np.testing.assert_array_equal(site.gain, gain.astype(np.float64))


def _rms_normalization(rng, axis: int, scale_shape, constant_scale: bool = True):
    b = GraphBuilder(23)
    scale = b.const(rng.standard_normal(scale_shape).astype(np.float32), "gain") if constant_scale else "scale"
    y = b.op("RMSNormalization", ["x", scale], axis=axis, epsilon=1e-5)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4, 8])]
    if not constant_scale:
        inputs.append(helper.make_tensor_value_info("scale", TensorProto.FLOAT, scale_shape))
    return gs.import_onnx(b.model(inputs, [y]))


def test_rms_normalization_over_two_axes_is_rejected(rng):
    found = find_norm_candidates(_rms_normalization(rng, -2, [4, 8]))
    assert not found.sites and "last axis" in found.rejected[0].reason


def test_runtime_scale_is_rejected(rng):
    found = find_norm_candidates(_rms_normalization(rng, -1, [8], constant_scale=False))
    assert not found.sites and "not a constant" in found.rejected[0].reason


def _layer_normalization(rng, *, axis: int = -1, bias: bool = True, statistics_read: bool = False):
    b = GraphBuilder(17)
    inputs = ["x", b.const(random_gain(rng, 8), "gain")] + ([b.const(random_bias(rng, 8), "ln_bias")] if bias else [])
    y, mean, _ = b.op("LayerNormalization", inputs, outputs=3, axis=axis, epsilon=1e-6)
    out = b.op("MatMul", [y, b.const(rng.standard_normal((8, 4)).astype(np.float32))])
    outputs = [out, mean] if statistics_read else [out]
    return gs.import_onnx(b.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4, 8])], outputs))


def test_layer_normalization_is_a_layernorm_site(rng):
    (site,) = find_norm_sites(_layer_normalization(rng))
    assert site.kind == "layer" and site.eps == pytest.approx(1e-6) and site.bias.shape == (8,)
    (site,) = find_norm_sites(_layer_normalization(rng, bias=False))
    assert site.kind == "layer" and site.bias is None and site.bias_node is None


def test_layer_normalization_over_two_axes_or_its_statistics_read_is_rejected(rng):
    found = find_norm_candidates(_layer_normalization(rng, axis=-2))
    assert not found.sites and "not over the last axis only" in found.rejected[0].reason
    found = find_norm_candidates(_layer_normalization(rng, statistics_read=True))
    assert not found.sites and "per-row statistic" in found.rejected[0].reason


@pytest.mark.parametrize("op", ["SkipSimplifiedLayerNormalization", "SkipLayerNormalization"])
def test_skip_with_bias_is_checked_and_folds(op, rng):
    """The bias a Skip form adds to input + skip before normalizing (input 3 of the RMSNorm's,
    input 4 of the LayerNorm's, whose input 3 is beta)."""
    from flashnorm.passes.fold import fold
    from synthetic import feeds, relative_error, run

    hidden = 16
    b = GraphBuilder(17)
    bias = rng.standard_normal(hidden).astype(np.float32)
    beta = [b.const(random_bias(rng, hidden), "ln_bias")] if op == "SkipLayerNormalization" else []
    y, _, _, total = b.op(op, ["x", "skip", b.const(random_gain(rng, hidden), "gain"), *beta, b.const(bias, "bias")],
                          outputs=4, domain="com.microsoft", epsilon=1e-6)
    out = b.op("MatMul", [y, b.const(rng.standard_normal((hidden, 8)).astype(np.float32), "w")])
    dims = ["batch", "seq", hidden]
    model = b.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, dims),
                     helper.make_tensor_value_info("skip", TensorProto.FLOAT, dims)], [out, total])
    (site,) = find_norm_sites(gs.import_onnx(model))  # the self-check adds the bias
    assert site.residual_output is not None
    graph, report = fold(gs.import_onnx(model))
    assert report.count("folded") == 1
    inputs = feeds(model, rng)
    for e, a in zip(run(model, inputs), run(gs.export_onnx(graph), inputs)):
        assert relative_error(a, e) < 1e-5
