"""One-node RMSNorm spellings: opset-23 RMSNormalization, ONNX Runtime's
SimplifiedLayerNormalization and SkipSimplifiedLayerNormalization."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto, helper

from flashnorm.match import find_norm_candidates, find_norm_sites
from synthetic import SPELLING_FAMILY, GraphBuilder, build_norm_model, random_gain


@pytest.mark.parametrize("spelling", sorted(SPELLING_FAMILY))
def test_fused_spellings_are_found(spelling, rng):
    eps = float(10 ** rng.uniform(-7, -4))
    (site,) = find_norm_sites(gs.import_onnx(build_norm_model(spelling, rng, eps=eps)))
    assert site.spelling == SPELLING_FAMILY[spelling]
    assert site.eps == pytest.approx(eps, rel=1e-6)
    assert site.gain_index == (2 if "Skip" in site.spelling else 1)
    assert np.any(site.gain < 0) and len(site.consumers) == 3
    if "Skip" in site.spelling:
        assert [t.name for t in site.data_inputs][1] == "skip"
        assert site.residual_output is not None


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


def test_layer_normalization_op_is_listed_as_rejected(rng):
    b = GraphBuilder(17)
    y = b.op("LayerNormalization", ["x", b.const(random_gain(rng, 8)), b.const(np.zeros(8, np.float32))])
    graph = gs.import_onnx(b.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])], [y]))
    found = find_norm_candidates(graph)
    assert not found.sites and "mean" in found.rejected[0].reason


def test_skip_with_bias_is_checked_and_folds(rng):
    from flashnorm.passes.fold import fold
    from synthetic import feeds, relative_error, run

    hidden = 16
    b = GraphBuilder(17)
    bias = rng.standard_normal(hidden).astype(np.float32)
    y, _, _, total = b.op("SkipSimplifiedLayerNormalization", ["x", "skip", b.const(random_gain(rng, hidden), "gain"),
                                                                 b.const(bias, "bias")],
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
