"""Decomposed RMSNorm and LayerNorm spellings: every exporter's op-by-op form is found with the
right kind, eps, gain, convention and bias; wrong axes are rejected with a reason."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto, helper, numpy_helper

from flashnorm.match import find_norm_candidates, find_norm_sites
from synthetic import SPELLING_FAMILY, SPELLING_KIND, SPELLINGS, GraphBuilder, build_norm_model, random_gain

DECOMPOSED = sorted(s for s in SPELLINGS if s not in SPELLING_FAMILY)


def _initializer(model, prefix: str) -> np.ndarray:
    (value,) = [numpy_helper.to_array(t) for t in model.graph.initializer if t.name.startswith(prefix)]
    return value


@pytest.mark.parametrize("spelling", DECOMPOSED)
def test_every_decomposed_spelling_is_found(spelling, rng):
    eps = float(10 ** rng.uniform(-7, -4))
    model = build_norm_model(spelling, rng, eps=eps)
    (site,) = find_norm_sites(gs.import_onnx(model))
    assert site.spelling == "decomposed" and site.kind == SPELLING_KIND[spelling]
    assert site.eps == pytest.approx(eps, rel=1e-6)
    assert site.axis == -1 and site.hidden_size == 32
    if site.kind == "layer":
        assert site.input.name == "x"
    assert len(site.consumers) == 3 and all(n.op == "MatMul" for n in site.consumers)
    if spelling == "gemma_add_one":
        w = _initializer(model, "gemma_w")
        assert site.gain_convention == "1+w" and site.gain_tensor.name.startswith("gemma_w")
        np.testing.assert_allclose(site.gain, 1.0 + w.astype(np.float64), rtol=1e-6)
    else:
        assert site.gain_convention == "w"
        stored = _initializer(model, "gain") if spelling != "constant_node_gain" else None
        if stored is not None:
            np.testing.assert_array_equal(site.gain, stored.astype(np.float64))
    assert np.any(site.gain < 0)
    if site.kind == "layer":
        np.testing.assert_array_equal(site.bias, _initializer(model, "ln_bias").astype(np.float64))
        assert site.bias_node.op == "Add" and site.bias_node.inputs[site.bias_index].name.startswith("ln_bias")
        assert [n.op for n in site.nodes[:2]] == ["ReduceMean", "Sub"] and not site.is_weightless
    else:
        assert site.bias is None and site.bias_node is None


def test_legacy_torch_input_cast_is_shared_not_claimed(rng):
    """SmolLM2's legacy export: the first Cast feeds the norm and the residual Add."""
    graph = gs.import_onnx(build_norm_model("legacy_torch", rng))
    (site,) = find_norm_sites(graph)
    cast = site.input.inputs[0]
    assert cast.op == "Cast" and cast not in site.nodes
    assert {n.op for n in site.input.outputs} >= {"Pow", "Mul", "Add"}
    assert [n.op for n in site.nodes] == ["Pow", "ReduceMean", "Add", "Sqrt", "Div", "Mul", "Cast", "Mul"]


def test_per_head_rank4(rng):
    (site,) = find_norm_sites(gs.import_onnx(build_norm_model("mul_reciprocal", rng, rank=4, hidden=8)))
    assert site.hidden_size == 8 and len(site.input.shape) == 4


def test_weightless_norm_has_no_gain(rng):
    (site,) = find_norm_sites(gs.import_onnx(build_norm_model("pow_div", rng, weightless=True)))
    assert site.gain is None and site.gain_convention == "none" and site.is_weightless
    assert site.output.outputs[0].op == "MatMul"


def _single_norm_graph(rng, axes, *, centred: bool = False, rank: int = 3, mean_axes=(-1,)):
    hidden = 16
    b = GraphBuilder(17)
    x = "x"
    if centred:
        x = b.op("Sub", ["x", b.op("ReduceMean", ["x"], axes=list(mean_axes))])
    sq = b.op("Pow", [x, b.const(np.array(2.0, np.float32))])
    ms = b.op("ReduceMean", [sq], axes=axes)
    rms = b.op("Sqrt", [b.op("Add", [ms, b.const(np.array(1e-5, np.float32))])])
    y = b.op("Mul", [b.op("Div", [x, rms]), b.const(random_gain(rng, hidden), "gain")])
    out = b.op("MatMul", [y, b.const(rng.standard_normal((hidden, 4)).astype(np.float32))])
    dims = ["batch", 6, hidden][-rank:]
    return gs.import_onnx(b.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)], [out]))


def test_mean_subtracted_first_makes_a_layernorm(rng):
    (site,) = find_norm_sites(_single_norm_graph(rng, [-1], centred=True))
    assert site.kind == "layer" and site.input.name == "x" and site.bias is None
    assert [n.op for n in site.nodes] == ["ReduceMean", "Sub", "Pow", "ReduceMean", "Add", "Sqrt", "Div", "Mul"]


def test_layernorm_mean_over_another_axis_is_rejected(rng):
    found = find_norm_candidates(_single_norm_graph(rng, [-1], centred=True, mean_axes=[1]))
    assert not found.sites and "not the last axis" in found.rejected[0].reason


def test_weightless_layernorm(rng):
    (site,) = find_norm_sites(gs.import_onnx(build_norm_model("ln_decomposed", rng, weightless=True)))
    assert site.kind == "layer" and site.gain is None and site.bias is None and site.is_weightless


def test_reduction_over_another_axis_is_rejected(rng):
    found = find_norm_candidates(_single_norm_graph(rng, [1]))
    assert not found.sites and "not the last axis" in found.rejected[0].reason


def test_non_negative_last_axis_is_accepted(rng):
    (site,) = find_norm_sites(_single_norm_graph(rng, [2]))
    assert site.axis == -1


def test_reduction_over_two_axes_is_rejected(rng):
    found = find_norm_candidates(_single_norm_graph(rng, [-2, -1]))
    assert not found.sites and "not one axis" in found.rejected[0].reason
