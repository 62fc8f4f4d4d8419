"""Fold (Proposition 1): the gain moves into every consumer weight, exactly, and the norm
stays a norm ONNX Runtime fuses (gain of ones, not Identity); a LayerNorm's bias moves into the
consumers' biases and its weights are centred (bias of zeros left)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto, helper, numpy_helper

from flashnorm.match import find_norm_sites
from flashnorm.passes.fold import fold, row_scaler
from synthetic import (
    CONSUMERS, SPELLINGS, GraphBuilder, axes_input, build_norm_model, ln_rsqrt_axes_input, pow_div, random_bias,
    random_gain,
)


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
    _, reports = optimize(once, ["fold"])
    assert reports["fold"].count("folded") == 0
    assert "weightless" in reports["fold"].decisions[0].reason


@pytest.mark.parametrize("spelling", ["ln_decomposed", "layer_normalization"])
@pytest.mark.parametrize("consumer", ["transposed", "gemm", "biased", "matmul"])
def test_layernorm_fold_moves_gain_and_bias_and_centres(spelling, consumer, rng):
    """W_c = centre(diag(g)·W) and c* = b·W + c (Gemm: β·C + α·b·W, β then 1) in float64, each
    rounded once; the LayerNorm keeps a gain of ones and a bias of zeros; every weight's columns
    sum to zero up to that rounding."""
    model = build_norm_model(spelling, rng, consumer=consumer)
    graph = gs.import_onnx(model)
    (site,) = find_norm_sites(graph)
    g, b = site.gain.copy(), site.bias.copy()
    scales = {n.name: (float(n.attrs.get("alpha", 1.0)), float(n.attrs.get("beta", 1.0))) for n in graph.nodes}
    transposes = {n.name: n.inputs[1].inputs[0].name for n in graph.nodes if n.op == "MatMul" and n.inputs[1].inputs}
    originals = {n.name: [t.values.copy() if isinstance(t, gs.Constant) else None for t in n.inputs]
                 for n in graph.nodes if n.op in ("MatMul", "Gemm", "Transpose", "Add")}
    graph, report = fold(graph)
    assert report.count("folded") == 1 and report.decisions[0].details["kind"] == "layer"
    (after,) = find_norm_sites(graph)
    assert after.is_weightless and np.all(after.gain == 1) and after.bias is not None and not np.any(after.bias)

    def centred(w64: np.ndarray, axis: int) -> np.ndarray:
        return w64 - w64.mean(axis=axis, keepdims=True)

    for node in [n for n in graph.nodes if n.op in ("MatMul", "Gemm")]:
        stored = node.inputs[1]
        transposed = stored.inputs[0].op == "Transpose" if stored.inputs else False
        if transposed:
            stored = stored.inputs[0].inputs[0]
        original_name = node.name
        weight = originals[original_name][1] if not transposed else originals[transposes[original_name]][0]
        axis = 1 if transposed or int(node.attrs.get("transB", 0)) else 0
        gain = g[None, :] if axis == 1 else g[:, None]
        np.testing.assert_array_equal(stored.values, centred(weight.astype(np.float64) * gain, axis).astype(np.float32))
        assert np.max(np.abs(stored.values.astype(np.float64).sum(axis=axis))) < 1e-5 * np.abs(stored.values).sum()
        bw = weight.astype(np.float64).T @ b if axis == 0 else weight.astype(np.float64) @ b
        if node.op == "Gemm":
            c = originals[original_name][2] if len(originals[original_name]) > 2 else None
            alpha, beta = scales[original_name]
            expected = alpha * bw + (beta * c.astype(np.float64) if c is not None else 0.0)
            assert node.attrs["beta"] == 1.0
            np.testing.assert_array_equal(node.inputs[2].values, expected.astype(np.float32))
            continue
        (add,) = node.outputs[0].outputs
        assert add.op == "Add"
        c = next((t.values for t in add.inputs if isinstance(t, gs.Constant)), None)
        old = next((v for v in originals.get(add.name, []) if v is not None), None)  # the bias it had, if any
        expected = bw + (old.astype(np.float64) if old is not None else 0.0)
        np.testing.assert_array_equal(c, expected.astype(np.float32))


def test_layernorm_fold_is_exact_and_onnxruntime_still_fuses_it(rng, optimize, max_error, tmp_path):
    """The decomposed LayerNorm with a gain of ones and a bias of zeros is still one fused
    LayerNormalization for ONNX Runtime (it would not be with the Mul and Add removed)."""
    import onnxruntime as ort

    def fused_norms(model) -> int:
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.optimized_model_filepath = str(tmp_path / "ort.onnx")
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        return sum(n.op_type == "LayerNormalization" for n in onnx.load(str(tmp_path / "ort.onnx")).graph.node)

    model = build_norm_model("ln_decomposed", rng, consumer="biased")
    folded, reports = optimize(model, ["fold"])
    assert reports["fold"].count("folded") == 1
    assert max_error(model, folded) < 1e-5
    assert fused_norms(model) == 1 and fused_norms(folded) == 1
    _, again = optimize(folded, ["fold"])
    assert "already weightless (gain all ones, bias all zeros)" in again["fold"].decisions[0].reason


@pytest.mark.parametrize("spelling", ["ln_decomposed", "layer_normalization"])
def test_post_ln_is_refused_with_its_reason(spelling, rng, optimize, max_error):
    """BERT: every LayerNorm's output is also the residual stream (or the model's output)."""
    from synthetic import build_post_ln_block

    model = build_post_ln_block(rng, spelling=spelling)
    folded, reports = optimize(model, ["fold", "defer"])
    reasons = [d.reason for d in reports["fold"].decisions]
    assert [d.action for d in reports["fold"].decisions] == ["skipped"] * 3
    assert sum("post-LN: the normalized tensor is also the residual stream (feeds Add" in r for r in reasons) == 2
    assert "graph output" in reasons[2]
    assert sum("post-LN" in d.reason for d in reports["defer"].decisions) == 2
    assert max_error(model, folded) == 0.0


def test_parallel_attention_and_mlp_share_one_folded_layernorm(rng, optimize, max_error):
    """Falcon: one LayerNorm feeds q, k, v and the MLP's first projection; all four take the
    gain, the bias and the centring; the final LayerNorm's head gets an Add for b·W."""
    from synthetic import build_parallel_block

    model = build_parallel_block(rng)
    folded, reports = optimize(model, ["fold"])
    assert reports["fold"].count("folded") == 2, reports["fold"].to_dict()
    assert [len(d.details["consumers"]) for d in reports["fold"].decisions] == [4, 1]
    assert max_error(model, folded) < 1e-5


def test_layernorm_with_a_quantized_consumer_is_refused(rng, optimize, max_error):
    """A bias and a centring cannot be folded exactly into a quantized weight: the site stays."""
    hidden, width = 16, 8
    b = GraphBuilder(21)
    y = ln_rsqrt_axes_input(b, "x", random_gain(rng, hidden), 1e-5, bias=random_bias(rng, hidden))
    codes = rng.integers(-100, 100, (hidden, width)).astype(np.int8)
    scale = b.const(np.full(width, 0.01, np.float32))
    w = b.op("DequantizeLinear", [b.const(codes, "w_q"), scale], axis=1)  # per output channel: RMS would fold exactly
    out = b.op("MatMul", [y, w])
    model = b.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", hidden])], [out])
    folded, reports = optimize(model, ["fold", "defer"])
    (decision,) = reports["fold"].decisions
    assert decision.action == "skipped" and "quantized" in decision.reason and "LayerNorm" in decision.reason
    assert "centred" in reports["defer"].decisions[0].reason or "run fold first" in reports["defer"].decisions[0].reason
    assert max_error(model, folded) == 0.0


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


def test_weight_behind_another_transpose_is_left_alone(rng, optimize, max_error):
    """Only Transpose([1, 0]) is looked through; any other perm leaves the site as it was."""
    hidden = 16
    b = GraphBuilder(17)
    y = pow_div(b, "x", random_gain(rng, hidden), 1e-5)
    w = b.const(rng.standard_normal((hidden, hidden)).astype(np.float32), "w")
    out = b.op("MatMul", [y, b.op("Transpose", [w], perm=[0, 1])])
    model = b.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", hidden])], [out])
    folded, reports = optimize(model, ["fold"])
    (decision,) = reports["fold"].decisions
    assert decision.action == "skipped" and "perm [0, 1] is not [1, 0]" in decision.reason
    assert max_error(model, folded) == 0.0


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
def test_quantized_weight_is_left_alone_by_default(kind, rng, optimize, max_error):
    """A per-tensor int8 weight would need requantizing (more error than the default quant
    limit takes; tests/passes/test_fold_quantized.py folds it with a larger one); an FP8
    initializer Cast up has no scale to requantize with."""
    model = _quantized_model(rng, kind)
    folded, reports = optimize(model, ["fold"])
    (decision,) = reports["fold"].decisions
    expected = "above the quant limit" if kind == "dequantize" else "quantized"
    assert decision.action == "skipped" and expected in decision.reason
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
    assert report.count("folded") == 0 and "above the quant limit" in report.decisions[0].reason
    assert report.decisions[0].details["quantized"]["weights"][0]["format"].startswith("MatMulNBits uint4 block 16")


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


# ── Scale: weights are read only while the optimized model is written ─────────────────────

def test_row_scaler_matches_the_float64_formula_bit_for_bit(rng):
    """float32 weights and float32 gains are scaled in place in float32: the same bits as
    float64 then cast, including signs, tiny and huge products. A gain float32 cannot hold
    and a float16 weight go through float64."""
    weight = rng.standard_normal((256, 384)).astype(np.float32)
    weight[0, :8] = [1e-38, -3e-39, 3e38, -3e38, 1e-45, 0.0, -0.0, 1.0]  # subnormals, overflow
    gains = {
        "float32 gain": random_gain(rng, 256).astype(np.float64),
        "gain float32 cannot hold": random_gain(rng, 256).astype(np.float64) * (1 + 2.0**-30),
    }
    gains["float32 gain"][:3] = np.float32([1e-30, 1e30, -2.0])
    for case, gain in gains.items():
        for axis in (0, 1):  # [K, N] rows, [N, K] columns
            w = weight if axis == 0 else weight[:, :256].copy()
            g = gain.reshape((-1, 1) if axis == 0 else (1, -1))
            fresh = w.copy()
            with np.errstate(over="ignore"):
                expected = (w.astype(np.float64) * g).astype(np.float32)
                actual = row_scaler(g, w.dtype)(fresh)
            assert actual.dtype == np.float32
            assert (actual is fresh) == (case == "float32 gain"), "in place exactly when float32 holds the gain"
            np.testing.assert_array_equal(actual.view(np.uint32), expected.view(np.uint32), err_msg=case)
    # The second gain really needs float64: rounding it to float32 first changes results.
    g = gains["gain float32 cannot hold"].reshape(-1, 1)
    with np.errstate(over="ignore"):
        assert not np.array_equal(weight * g.astype(np.float32), (weight.astype(np.float64) * g).astype(np.float32))

    half = rng.standard_normal((256, 64)).astype(np.float16)
    g = gains["float32 gain"].reshape(-1, 1)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(row_scaler(g, half.dtype)(half.copy()),
                                      (half.astype(np.float64) * g).astype(np.float16))


def _two_block_model(rng, hidden: int, ffn: int) -> tuple[onnx.ModelProto, dict[str, str], dict[str, np.ndarray]]:
    """x → norm(g1) → up → Relu → down → + x → norm(g2) → q, and k behind a Transpose ([N, K]
    weight: columns scaled). Returns the model, weight names by role, and every weight by name."""
    b = GraphBuilder(17)
    values = {
        "g1": random_gain(rng, hidden), "g2": random_gain(rng, hidden),
        "up": (rng.standard_normal((hidden, ffn)) / 8).astype(np.float32),
        "down": (rng.standard_normal((ffn, hidden)) / 16).astype(np.float32),
        "q": (rng.standard_normal((hidden, hidden)) / 8).astype(np.float32),
        "k_t": (rng.standard_normal((hidden, hidden)) / 8).astype(np.float32),
    }
    names = {role: b.const(v, role) for role, v in values.items() if not role.startswith("g")}
    y1 = pow_div(b, "x", values["g1"], 1e-5)
    down = b.op("MatMul", [b.op("Relu", [b.op("MatMul", [y1, names["up"]])]), names["down"]])
    y2 = pow_div(b, b.op("Add", ["x", down]), values["g2"], 1e-5)
    q = b.op("MatMul", [y2, names["q"]])
    k = b.op("MatMul", [y2, b.op("Transpose", [names["k_t"]], perm=[1, 0])])
    model = b.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", hidden])], [q, k])
    weights = {names[role]: v for role, v in values.items() if role in names}
    return model, names, weights | {"g1": values["g1"], "g2": values["g2"]}


def _save_external(model: onnx.ModelProto, path) -> None:
    onnx.save(model, str(path), save_as_external_data=True, location="weights.bin", size_threshold=1024)


def test_optimize_external_model_reads_folded_weights_once_while_saving(rng, tmp_path, external_reads):
    """`optimize_file` (fold + cancel) on an external-data model: planning, fold and cancel
    read no weight; the save reads each folded weight once and copies the others file to
    file; the folded weights are the float64 formula's bits."""
    from flashnorm.passes import optimize_file
    from synthetic import relative_error, run

    model, names, weights = _two_block_model(rng, hidden=64, ffn=256)
    source, out = tmp_path / "in" / "model.onnx", tmp_path / "model.flashnorm.onnx"
    source.parent.mkdir()
    _save_external(model, source)

    report = optimize_file(source, out)
    assert report["summary"]["fold.folded"] == 2, report["summary"]
    assert all(saving for _, saving in external_reads), f"read before the save: {external_reads}"
    folded_sources = sorted([names["up"], names["q"], names["k_t"]])
    assert sorted(name for name, _ in external_reads) == folded_sources, "each folded weight read once, nothing else"

    saved = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(out)).graph.initializer}
    g1, g2 = weights["g1"].astype(np.float64), weights["g2"].astype(np.float64)
    expected = {
        names["up"]: (weights[names["up"]].astype(np.float64) * g1[:, None]).astype(np.float32),
        names["q"]: (weights[names["q"]].astype(np.float64) * g2[:, None]).astype(np.float32),
        names["k_t"]: (weights[names["k_t"]].astype(np.float64) * g2[None, :]).astype(np.float32),
    }
    for name, want in expected.items():
        (folded,) = [v for n, v in saved.items() if n.startswith(f"{name}.folded_for.")]
        np.testing.assert_array_equal(folded, want)
    np.testing.assert_array_equal(saved[names["down"]], weights[names["down"]])

    x = {"x": rng.standard_normal((3, 64)).astype(np.float32)}
    for got, want in zip(run(str(out), x), run(str(source), x)):
        assert relative_error(got, want) < 1e-5


def test_untie_copies_a_tied_weight_lazily(rng, tmp_path, external_reads):
    """--untie on an external-data model: the LM head's folded copy is computed while
    saving; the embedding keeps the original table, copied file to file."""
    from flashnorm.passes import optimize_file

    model, table = _tied_model(rng)
    source, out = tmp_path / "tied.onnx", tmp_path / "tied.flashnorm.onnx"
    _save_external(model, source)
    (name,) = [t.name for t in onnx.load(str(source), load_external_data=False).graph.initializer
               if t.data_location == TensorProto.EXTERNAL]

    report = optimize_file(source, out, untie=True)
    assert report["summary"]["fold.folded"] == 1
    assert external_reads == [(name, True)]
    saved = onnx.load(str(out))
    (gather,) = [n for n in saved.graph.node if n.op_type == "Gather"]
    initializers = {t.name: numpy_helper.to_array(t) for t in saved.graph.initializer}
    np.testing.assert_array_equal(initializers[gather.input[0]], table)
    (copy,) = [v for n, v in initializers.items() if n.startswith(f"{name}.folded_for.")]
    (site,) = find_norm_sites(gs.import_onnx(model))
    np.testing.assert_array_equal(copy, (table.astype(np.float64) * site.gain[None, :]).astype(np.float32))


_PEAK_SCRIPT = """
import sys
from flashnorm.passes import optimize_file
from flashnorm.progress import Progress

def peak_mb():
    with open("/proc/self/status") as status:
        return int(next(line.split()[1] for line in status if line.startswith("VmHWM:"))) / 1024

Progress.enabled = False
small, big, out = sys.argv[1:4]
# A warm-up on the same graph with small weights pays the fixed costs (imports, the
# matcher's ONNX Runtime self-check sessions) before measuring what the weights cost.
optimize_file(small, out)
before = peak_mb()
report = optimize_file(big, out)
print(report["summary"]["fold.folded"], peak_mb() - before)
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc (Linux)")
def test_optimize_holds_at_most_one_weight(rng, tmp_path):
    """96 MB of external weights, 64 MB of them folded: `optimize_file`'s peak grows by
    about one tensor (the largest, 32 MB, read, scaled in place, written, freed), not by
    every folded weight (the eager fold: about 200 MB)."""
    import subprocess
    import sys

    small = tmp_path / "small.onnx"
    _save_external(_two_block_model(rng, hidden=64, ffn=128)[0], small)
    model, names, weights = _two_block_model(rng, hidden=2048, ffn=4096)
    big = tmp_path / "big.onnx"
    _save_external(model, big)
    tensor_mb = weights[names["up"]].nbytes / 2**20
    del model, weights
    result = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(small), str(big), str(tmp_path / "out.onnx")],
                            capture_output=True, text=True, check=True)
    folded, growth_mb = result.stdout.split()[-2:]
    assert folded == "2"
    assert float(growth_mb) < 1.5 * tensor_mb, \
        f"peak grew by {float(growth_mb):.1f} MB (one tensor is {tensor_mb:.0f} MB)"


def test_layernorm_in_front_of_a_tied_head_is_untied_not_mutated(rng, optimize):
    """GPT-2's final LayerNorm feeds the LM head tied to the embedding: kept by default; with
    --untie the head gets its own folded, centred copy and a bias b·W, the embedding its table."""
    from synthetic import relative_error, run

    vocab, hidden = 40, 16
    b = GraphBuilder(17)
    table = rng.standard_normal((vocab, hidden)).astype(np.float32)
    embedding = b.const(table, "wte")
    h = b.op("Gather", [embedding, "ids"], axis=0)
    y = ln_rsqrt_axes_input(b, h, random_gain(rng, hidden), 1e-5, bias=random_bias(rng, hidden))
    logits = b.op("MatMul", [y, b.op("Transpose", [embedding], perm=[1, 0])])
    b.opset = 18
    model = b.model([helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"])], [logits, h])
    inputs = {"ids": rng.integers(0, vocab, (2, 5)).astype(np.int64)}
    kept, reports = optimize(model, ["fold"])
    assert "shared" in reports["fold"].decisions[0].reason and "--untie" in reports["fold"].decisions[0].reason
    untied, reports = optimize(model, ["fold", "defer"], untie=True)
    assert reports["fold"].count("folded") == 1 and reports["defer"].count("deferred") == 1
    (gather,) = [n for n in untied.graph.node if n.op_type == "Gather"]
    np.testing.assert_array_equal(next(numpy_helper.to_array(t) for t in untied.graph.initializer
                                       if t.name == gather.input[0]), table)
    expected, actual = run(model, inputs), run(untied, inputs)
    assert relative_error(actual[0], expected[0]) < 1e-5
    np.testing.assert_array_equal(actual[1], expected[1])
