"""Cancel (Proposition 3): a pre-attention norm whose every path reaches a per-head norm
through bias-free homogeneous ops loses its division; the result matches the eps formula."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
import pytest
from onnx import numpy_helper

from flashnorm.match import find_norm_sites
from flashnorm.passes.cancel import cancel, cancel_error_factor
from synthetic import build_attention_block, build_norm_model, feeds, relative_error, run


def _weights(model) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def _assert_cancelled_within_eps_bound(model, rng, optimize, *, eps, hidden, heads, scale, kv_heads=None):
    kv_heads = kv_heads or heads
    folded, _ = optimize(model, ["fold"])
    cancelled, reports = optimize(folded, ["cancel"])
    report = reports["cancel"]
    assert report.count("cancelled") == 1 and report.count("skipped") == 3, report.to_dict()
    decision = next(d for d in report.decisions if d.action == "cancelled")
    assert len(decision.details["downstream"]) == 3 and "ρ" in decision.details["error_bound"]
    assert len(find_norm_sites(gs.import_onnx(cancelled))) == 3  # only the per-head norms remain

    inputs = feeds(model, rng)
    inputs["x"] *= scale
    if "skip" in inputs:
        inputs["skip"] *= scale
    expected, actual = run(folded, inputs), run(cancelled, inputs)
    a = inputs["x"].astype(np.float64) + (inputs["skip"].astype(np.float64) if "skip" in inputs else 0.0)
    mean_square_a = np.mean(a * a, axis=-1)[..., None]  # [B, S, 1]
    weights = _weights(folded)
    for role, e, y in zip("qkv", expected, actual):
        (w,) = [v for name, v in weights.items() if name.startswith(f"w_{role}")]  # folded W*
        groups = kv_heads if role != "q" else heads
        b = (a @ w.astype(np.float64)).reshape(*a.shape[:2], groups, hidden // heads)
        b = np.repeat(b, heads // groups, axis=2)  # repeat_kv
        rho = cancel_error_factor(mean_square_a, np.mean(b * b, axis=-1), eps)  # [B, S, H]
        corrected = y.astype(np.float64) * rho.transpose(0, 2, 1)[..., None]  # outputs are [B, H, S, hd]
        assert relative_error(corrected, e) < 2e-5, role  # the formula explains the whole difference
        assert relative_error(y, e) <= np.max(np.abs(rho - 1)) + 2e-5
        approx = eps * (1 - mean_square_a[..., 0][..., None]) / (2 * np.mean(b * b, axis=-1))
        first_order = np.abs(approx) < 1e-2  # the report's ρ−1 ≈ ε(1−M(a))/(2M(b)) where ρ−1 is small
        np.testing.assert_allclose((rho - 1)[first_order], approx[first_order], rtol=0.05, atol=1e-9)
    for e, y in zip(expected[3:], actual[3:]):  # the Skip form's residual sum is kept exactly
        assert relative_error(y, e) < 1e-6


@pytest.mark.parametrize("scale", [1.0, 1e-2])
def test_qkv_norm_block_is_cancelled_within_eps_bound(scale, rng, optimize):
    model = build_attention_block(rng, kind="qkv_norm", hidden=32, heads=4, eps=1e-6)
    _assert_cancelled_within_eps_bound(model, rng, optimize, eps=1e-6, hidden=32, heads=4, scale=scale)


@pytest.mark.parametrize("pre_norm", ["legacy_torch", "gemma_add_one", "rms_normalization", "skip_simplified_layernorm"])
def test_every_pre_norm_spelling_cancels(pre_norm, rng, optimize):
    model = build_attention_block(rng, kind="qkv_norm", eps=1e-5, pre_norm=pre_norm)
    _assert_cancelled_within_eps_bound(model, rng, optimize, eps=1e-5, hidden=32, heads=4, scale=1e-2)


def test_gqa_repeat_through_expand_cancels(rng, optimize):
    model = build_attention_block(rng, kind="gqa_expand", eps=1e-6)
    _assert_cancelled_within_eps_bound(model, rng, optimize, eps=1e-6, hidden=32, heads=4, kv_heads=2, scale=1e-2)


def test_rotary_embedding_between_norms_cancels(rng, optimize):
    """RotaryEmbedding rotates each head vector by angles from the positions alone: linear per
    token and norm-preserving, so q/k keep their per-token scale and their mean square."""
    model = build_attention_block(rng, kind="rotary_op", eps=1e-6)
    _assert_cancelled_within_eps_bound(model, rng, optimize, eps=1e-6, hidden=32, heads=4, scale=1e-2)


def test_legacy_dynamic_reshape_without_stored_shapes_cancels(rng, optimize):
    """Reshape sizes from Shape(normalized), no value_info: shapes are inferred by the pass."""
    model = build_attention_block(rng, kind="qkv_norm", eps=1e-6, dynamic_shape=True)
    del model.graph.value_info[:]
    _assert_cancelled_within_eps_bound(model, rng, optimize, eps=1e-6, hidden=32, heads=4, scale=1e-2)


@pytest.mark.parametrize(("kind", "reason"), [
    ("qk_norm", "without a downstream RMSNorm"),
    ("biased", "bias"),
    ("rope_slice", "without a downstream RMSNorm"),
    ("rope_between", "non-constant"),
])
def test_ineligible_blocks_are_refused(kind, reason, rng, optimize, max_error):
    model = build_attention_block(rng, kind=kind)
    folded, _ = optimize(model, ["fold"])
    result, reports = optimize(folded, ["cancel"])
    report = reports["cancel"]
    assert report.count("cancelled") == 0
    pre_attention = report.decisions[0]
    assert reason in pre_attention.reason, pre_attention.reason
    assert max_error(folded, result) == 0.0


def test_cancel_without_fold_keeps_gain(rng):
    eps = 1e-6
    model = build_attention_block(rng, kind="qkv_norm", eps=eps)
    graph, report = cancel(gs.import_onnx(model))
    decision = next(d for d in report.decisions if d.action == "cancelled")
    assert decision.details["gain_kept"] is True
    cancelled = gs.export_onnx(graph)
    inputs = feeds(model, rng)
    for e, a in zip(run(model, inputs), run(cancelled, inputs)):
        assert relative_error(a, e) < 1e-3  # eps-approximate; exactness is tested above


def test_projection_to_graph_output_is_not_cancelled(rng):
    graph, report = cancel(gs.import_onnx(build_norm_model("pow_div", rng)))
    assert report.count("cancelled") == 0
    assert "without a downstream RMSNorm" in report.decisions[0].reason


def test_error_factor_is_one_without_eps(rng):
    a, b = rng.uniform(0.1, 3, 10), rng.uniform(0.1, 3, 10)
    np.testing.assert_allclose(cancel_error_factor(a, b, 0.0), 1.0)
    np.testing.assert_allclose(cancel_error_factor(1.0, b, 1e-3), np.sqrt((b + 1e-3) / (b + 1e-3 * (1 + 1e-3))))


@pytest.mark.parametrize("pre_norm", ["ln_decomposed", "layer_normalization"])
def test_layernorm_is_never_cancelled_nor_a_downstream_norm(pre_norm, rng, optimize, max_error):
    """A LayerNorm pre-attention norm before per-head RMSNorms keeps its division (its bias is not
    divided by σ); an RMSNorm whose paths end at a LayerNorm keeps its own (Proposition 3's bound
    is for a downstream RMSNorm)."""
    from flashnorm.passes.cancel import LAYER_NORM_REASON
    from synthetic import GraphBuilder, SPELLINGS, pow_div, random_bias, random_gain
    from onnx import TensorProto, helper

    model = build_attention_block(rng, kind="qkv_norm", pre_norm=pre_norm)
    folded, _ = optimize(model, ["fold"])
    result, reports = optimize(folded, ["cancel"])
    assert reports["cancel"].count("cancelled") == 0
    assert reports["cancel"].decisions[0].reason == LAYER_NORM_REASON
    assert max_error(folded, result) == 0.0

    hidden = 16
    b = GraphBuilder(17)
    y = pow_div(b, "x", random_gain(rng, hidden), 1e-5)
    h = b.op("MatMul", [y, b.const(rng.standard_normal((hidden, hidden)).astype(np.float32), "w")])
    out = SPELLINGS[pre_norm](b, h, random_gain(rng, hidden), 1e-5, bias=random_bias(rng, hidden))
    model = b.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", hidden])], [out])
    _, reports = optimize(model, ["cancel"])
    assert "path reaches LayerNorm" in reports["cancel"].decisions[0].reason
