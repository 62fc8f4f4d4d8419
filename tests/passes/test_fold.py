"""Fold (Proposition 1): the gain moves into every consumer weight, exactly, and the norm
stays a norm ONNX Runtime fuses (gain of ones, not Identity)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto, helper, numpy_helper

from flashnorm.match import find_norm_sites
from flashnorm.passes.fold import fold
from synthetic import CONSUMERS, SPELLINGS, GraphBuilder, axes_input, build_norm_model, pow_div, random_gain


@pytest.mark.parametrize("consumer", CONSUMERS)
@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_fold_every_spelling_and_consumer(spelling, consumer, rng, optimize, max_error):
    model = build_norm_model(spelling, rng, consumer=consumer)
    folded, reports = optimize(model, ["fold"])
    assert reports["fold"].count("folded") == 1, reports["fold"].to_dict()
    assert max_error(model, folded) < 1e-5
    (site,) = find_norm_sites(gs.import_onnx(folded))
    assert site.is_weightless and site.gain is not None  # a gain of ones, still a norm
    assert "Identity" not in {n.op_type for n in folded.graph.node}


def test_fold_per_head_rank4(rng, optimize, max_error):
    model = build_norm_model("pow_div", rng, rank=4)
    folded, reports = optimize(model, ["fold"])
    assert reports["fold"].count("folded") == 1
    assert max_error(model, folded) < 1e-5


def test_fold_scales_rows_in_float64_and_keeps_dtype(rng):
    model = build_norm_model("pow_div", rng, consumer="matmul")
    graph = gs.import_onnx(model)
    (site,) = find_norm_sites(graph)
    weight = site.consumers[0].inputs[1].values.copy()
    gain = site.gain.copy()
    graph, report = fold(graph)
    (matmul,) = [n for n in graph.nodes if n.op == "MatMul"]
    folded = matmul.inputs[1].values
    assert folded.dtype == weight.dtype
    np.testing.assert_array_equal(folded, (weight.astype(np.float64) * gain[:, None]).astype(np.float32))


def test_folded_graph_is_idempotent(rng, optimize):
    once, _ = optimize(build_norm_model("legacy_torch", rng), ["fold"])
    twice, reports = optimize(once, ["fold"])
    assert reports["fold"].count("folded") == 0
    assert "weightless" in reports["fold"].decisions[0].reason


def _layernorm(b: GraphBuilder, x: str, hidden: int, rng) -> str:
    mean = b.op("ReduceMean", [x], axes=[-1])
    centred = b.op("Sub", [x, mean])
    var = b.op("ReduceMean", [b.op("Pow", [centred, b.const(np.array(2.0, np.float32))])], axes=[-1])
    std = b.op("Sqrt", [b.op("Add", [var, b.const(np.array(1e-5, np.float32))])])
    return b.op("Mul", [b.op("Div", [centred, std]), b.const(random_gain(rng, hidden), "ln_gain")])


def test_layernorm_is_never_matched_or_touched(rng, optimize):
    hidden = 16
    b = GraphBuilder(17)
    y = _layernorm(b, "x", hidden, rng)
    fused = b.op("LayerNormalization", [y, b.const(random_gain(rng, hidden)), b.const(np.zeros(hidden, np.float32))])
    rms = pow_div(b, fused, random_gain(rng, hidden), 1e-5)
    w = (rng.standard_normal((hidden, 8))).astype(np.float32)
    out = b.op("MatMul", [rms, b.const(w, "w")])
    model = b.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", hidden])], [out])
    graph = gs.import_onnx(model)
    sites = find_norm_sites(graph)
    assert len(sites) == 1 and sites[0].input.name == fused  # only the RMSNorm
    before = {t.name: numpy_helper.to_array(t).copy() for t in model.graph.initializer if "ln_gain" in t.name}
    folded, reports = optimize(model, ["fold"])
    assert reports["fold"].count("folded") == 1
    after = {t.name: numpy_helper.to_array(t) for t in folded.graph.initializer}
    for name, value in before.items():
        np.testing.assert_array_equal(after[name], value)


def test_nonlinear_consumer_leaves_site_untouched(rng, optimize, max_error):
    hidden = 16
    b = GraphBuilder(17)
    y = pow_div(b, "x", random_gain(rng, hidden), 1e-5)
    projected = b.op("MatMul", [y, b.const(rng.standard_normal((hidden, 8)).astype(np.float32), "w")])
    gated = b.op("Sigmoid", [y])
    model = b.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", hidden])], [projected, gated])
    folded, reports = optimize(model, ["fold"])
    (decision,) = reports["fold"].decisions
    assert decision.action == "skipped" and "Sigmoid" in decision.reason
    assert max_error(model, folded) == 0.0
    np.testing.assert_array_equal(find_norm_sites(gs.import_onnx(folded))[0].gain,
                                  find_norm_sites(gs.import_onnx(model))[0].gain)


def test_graph_output_norm_is_not_folded(rng, optimize):
    b = GraphBuilder(17)
    y = pow_div(b, "x", random_gain(rng, 16), 1e-5)
    model = b.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])], [y])
    _, reports = optimize(model, ["fold"])
    assert "graph output" in reports["fold"].decisions[0].reason


def _quantized_model(rng, kind: str) -> onnx.ModelProto:
    hidden, width = 16, 8
    b = GraphBuilder(21)
    y = axes_input(b, "x", random_gain(rng, hidden), 1e-5)  # opset ≥ 18 spelling
    codes = rng.integers(-100, 100, (hidden, width))
    if kind == "dequantize":
        w = b.op("DequantizeLinear", [b.const(codes.astype(np.int8), "w_q"), b.const(np.array(0.01, np.float32))])
    else:  # an FP8 initializer cast up for the MatMul
        import ml_dtypes
        w = b.op("Cast", [b.const((codes / 50).astype(ml_dtypes.float8_e4m3fn), "w_fp8")], to=TensorProto.FLOAT)
    out = b.op("MatMul", [y, w])
    return b.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", hidden])], [out])


@pytest.mark.parametrize("kind", ["dequantize", "fp8"])
def test_quantized_weight_is_never_folded(kind, rng, optimize, max_error):
    model = _quantized_model(rng, kind)
    folded, reports = optimize(model, ["fold"])
    (decision,) = reports["fold"].decisions
    assert decision.action == "skipped" and "quantized" in decision.reason
    assert max_error(model, folded) == 0.0


def test_matmul_nbits_consumer_is_skipped(rng):
    hidden = 16
    b = GraphBuilder(17)
    y = pow_div(b, "x", random_gain(rng, hidden), 1e-5)
    packed = rng.integers(0, 255, (8, 1, 8)).astype(np.uint8)
    out = b.op("MatMulNBits", [y, b.const(packed, "w_nbits"), b.const(np.ones((8, 1), np.float32))],
               domain="com.microsoft", K=hidden, N=8, bits=4, block_size=16)
    graph = gs.import_onnx(b.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", hidden])], [out]))
    graph, report = fold(graph)
    assert report.count("folded") == 0 and "quantized" in report.decisions[0].reason


def _tied_model(rng) -> tuple[onnx.ModelProto, np.ndarray]:
    """Embedding Gather and LM head read one initializer (dynamo exporter keeps the tie)."""
    vocab, hidden = 40, 16
    b = GraphBuilder(17)
    table = rng.standard_normal((vocab, hidden)).astype(np.float32)
    embedding = b.const(table, "embed_tokens")
    h = b.op("Gather", [embedding, "ids"], axis=0)
    y = pow_div(b, h, random_gain(rng, hidden), 1e-5)
    logits = b.op("MatMul", [y, b.op("Transpose", [embedding], perm=[1, 0])])
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"])
    return b.model([ids], [logits, h]), table


def _tied_feeds(rng):
    return {"ids": rng.integers(0, 40, (2, 5)).astype(np.int64)}


def test_tied_weight_keeps_gain_by_default(rng, optimize):
    from synthetic import run

    model, _ = _tied_model(rng)
    folded, reports = optimize(model, ["fold"])
    (decision,) = reports["fold"].decisions
    assert decision.action == "skipped" and "shared" in decision.reason and "--untie" in decision.reason
    inputs = _tied_feeds(rng)
    for a, b in zip(run(model, inputs), run(folded, inputs)):
        np.testing.assert_array_equal(a, b)


def test_untie_folds_a_copy_and_embedding_keeps_original(rng, optimize):
    from synthetic import relative_error, run

    model, table = _tied_model(rng)
    folded, reports = optimize(model, ["fold"], untie=True)
    assert reports["fold"].count("folded") == 1
    graph = gs.import_onnx(folded)
    (gather,) = [n for n in graph.nodes if n.op == "Gather"]
    np.testing.assert_array_equal(gather.inputs[0].values, table)
    (matmul,) = [n for n in graph.nodes if n.op == "MatMul"]
    head = matmul.inputs[1].inputs[0].inputs[0]  # MatMul ← Transpose ← initializer
    assert head is not gather.inputs[0]
    inputs = _tied_feeds(rng)
    expected, actual = run(model, inputs), run(folded, inputs)
    assert relative_error(actual[0], expected[0]) < 1e-5
    np.testing.assert_array_equal(actual[1], expected[1])


def test_fold_bfloat16_weights_cast_back(rng):
    import ml_dtypes

    hidden = 16
    b = GraphBuilder(17)
    y = pow_div(b, "x", random_gain(rng, hidden), 1e-5)
    weight = rng.standard_normal((hidden, 8)).astype(ml_dtypes.bfloat16)
    out = b.op("Cast", [b.op("MatMul", [b.op("Cast", [y], to=TensorProto.BFLOAT16), b.const(weight, "w_bf16")])],
               to=TensorProto.FLOAT)
    graph = gs.import_onnx(b.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", hidden])], [out]))
    (site,) = find_norm_sites(graph)
    gain = site.gain.copy()
    graph, report = fold(graph)
    assert report.count("folded") == 1
    (matmul,) = [n for n in graph.nodes if n.op == "MatMul"]
    folded = matmul.inputs[1].values
    assert folded.dtype == weight.dtype
    np.testing.assert_array_equal(folded, (weight.astype(np.float64) * gain[:, None]).astype(ml_dtypes.bfloat16))


def test_onnxruntime_still_fuses_the_folded_norm(rng, optimize, tmp_path):
    """A gain of ones (not Identity) keeps ONNX Runtime's SimplifiedLayerNormalization fusion."""
    import onnxruntime as ort

    def fused_norms(model) -> int:
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.optimized_model_filepath = str(tmp_path / "ort.onnx")
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        return sum(n.op_type == "SimplifiedLayerNormalization" for n in onnx.load(str(tmp_path / "ort.onnx")).graph.node)

    model = build_norm_model("legacy_torch", rng)
    folded, reports = optimize(model, ["fold"])
    assert reports["fold"].count("folded") == 1
    assert fused_norms(model) == 1 and fused_norms(folded) == 1


def test_shape_consumer_does_not_block_fold(rng, optimize, max_error):
    """The legacy exporter reads Shape(normalized) for Reshape sizes: shape, not values."""
    from synthetic import build_attention_block

    model = build_attention_block(rng, dynamic_shape=True)
    folded, reports = optimize(model, ["fold"])
    assert reports["fold"].decisions[0].action == "folded"
    assert max_error(model, folded) < 1e-5


def test_fold_float16_model(rng, optimize, max_error):
    """fp16 activations and weights, norm computed in fp32 between Casts, fp16 gain."""
    hidden = 32
    b = GraphBuilder(17)
    x = b.op("Cast", ["x"], to=TensorProto.FLOAT)
    sq = b.op("Pow", [x, b.const(np.array(2.0, np.float32))])
    ms = b.op("ReduceMean", [sq], axes=[-1])
    inv = b.op("Reciprocal", [b.op("Sqrt", [b.op("Add", [ms, b.const(np.array(1e-5, np.float32))])])])
    y = b.op("Cast", [b.op("Mul", [x, inv])], to=TensorProto.FLOAT16)
    y = b.op("Mul", [b.const(random_gain(rng, hidden).astype(np.float16), "gain"), y])
    outs = [b.op("Cast", [b.op("MatMul", [y, b.const((rng.standard_normal((hidden, 16)) / 6).astype(np.float16), "w")])],
                 to=TensorProto.FLOAT) for _ in range(2)]
    model = b.model([helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["batch", "seq", hidden])], outs)
    folded, reports = optimize(model, ["fold"])
    assert reports["fold"].count("folded") == 1
    (site,) = find_norm_sites(gs.import_onnx(folded))
    assert site.is_weightless and site.gain_dtype == np.float16
    assert max_error(model, folded) < 2e-3  # W* re-rounded to fp16


def test_broadcasting_gain_keeps_its_shape(rng, optimize, max_error):
    """A [1, 1, D] gain on a rank-2 activation makes the output rank 3; ones keep that."""
    hidden = 16
    b = GraphBuilder(17)
    y = pow_div(b, "x", None, 1e-5)
    y = b.op("Mul", [y, b.const(random_gain(rng, hidden).reshape(1, 1, hidden), "gain")])
    out = b.op("MatMul", [y, b.const(rng.standard_normal((hidden, 8)).astype(np.float32), "w")])
    shape = b.op("Cast", [b.op("Shape", [y])], to=TensorProto.FLOAT)
    model = b.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, ["tokens", hidden])], [out, shape])
    folded, reports = optimize(model, ["fold"])
    assert reports["fold"].count("folded") == 1
    assert max_error(model, folded) < 1e-5  # includes the Shape output: [1, tokens, D]
