"""Fold into quantized weights (flashnorm.passes.quantized): every format folded in its own
format, node types unchanged, checked in ONNX Runtime against a float64 evaluation of the
ORIGINAL quantized graph (dequantized here in numpy, independently of the pass); exact formats
within float rounding, requantized ones within what the report says the requantization cost;
malformed inputs left alone with a one-line reason."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto, helper, numpy_helper

from flashnorm.match import find_norm_sites
from flashnorm.passes import run_passes
from synthetic import GraphBuilder, axes_input, random_gain

EPS = 1e-5
HIDDEN = 96  # 3 blocks of 32, 6 of 16; not a multiple of 64 or 128 (padded last block)


# ── float64 reference: the norm and a dequantized weight, in numpy ─────────────────────────

def norm64(x: np.ndarray, gain: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + EPS) * gain.astype(np.float64)


def nbits_weight(b: np.ndarray, scales: np.ndarray, zero_points, bits: int, k: int, block: int) -> np.ndarray:
    """MatMulNBits' B, scales, zero points → W [K, N] float64 (written from the op's docs)."""
    n, blocks, _ = b.shape
    per = 8 // bits
    codes = np.stack([(b >> (bits * i)) & ((1 << bits) - 1) for i in range(per)], axis=-1).reshape(n, blocks, -1)
    if zero_points is None:
        zeros = np.full((n, blocks), 1 << (bits - 1))
    elif zero_points.dtype.kind == "f":  # of the scales' type: the zero point itself, not packed
        zeros = zero_points.reshape(n, blocks).astype(np.float64)
    else:
        zp = zero_points.reshape(n, -1)
        zeros = np.stack([(zp >> (bits * i)) & ((1 << bits) - 1) for i in range(per)], axis=-1).reshape(n, -1)[:, :blocks]
    w = (codes[..., :block] - zeros[..., None].astype(np.float64)) * scales.reshape(n, blocks, 1).astype(np.float64)
    return w.reshape(n, -1)[:, :k].T


def run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    """ONNX Runtime on CPU without graph optimizations: its DequantizeLinear → MatMul fusion
    (into MatMulNBits, activations quantized to int8) would hide float-rounding-sized checks."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def graph_weights(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def relative_rms(actual: np.ndarray, expected: np.ndarray) -> float:
    return float(np.sqrt(np.mean((actual.astype(np.float64) - expected) ** 2) / np.mean(expected ** 2)))


def fold_model(model: onnx.ModelProto, **options):
    graph, reports = run_passes(gs.import_onnx(model), ["fold"], **options)
    return gs.export_onnx(graph), reports[0]


def x_feed(rng, hidden=HIDDEN):
    return (rng.standard_normal((2, 5, hidden)) * rng.uniform(0.5, 2.0) + 0.1).astype(np.float32)


def op_types(model):
    return sorted((n.op_type, n.domain) for n in model.graph.node)


# ── MatMulNBits, made by ONNX Runtime's own quantizer ───────────────────────────────────────

def _float_model(rng, widths=(40,), hidden=HIDDEN, gain=None):
    b = GraphBuilder(21)
    gain = random_gain(rng, hidden) if gain is None else gain
    y = axes_input(b, "x", gain, EPS)
    outs = [b.op("MatMul", [y, b.const((rng.standard_normal((hidden, n)) / np.sqrt(hidden)).astype(np.float32), "w")])
            for n in widths]
    return b.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", hidden])], outs), gain


def ort_nbits(model: onnx.ModelProto, bits: int, block: int, symmetric: bool) -> onnx.ModelProto:
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    config = DefaultWeightOnlyQuantConfig(block_size=block, is_symmetric=symmetric, bits=bits)
    quantizer = MatMulNBitsQuantizer(onnx.ModelProto.FromString(model.SerializeToString()), algo_config=config)
    quantizer.process()
    return quantizer.model.model


def nbits_reference(model, x, gain):
    weights = graph_weights(model)
    outs = []
    for node in model.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        a = {x.name: x.i for x in node.attribute}
        zp = weights[node.input[3]] if len(node.input) > 3 and node.input[3] else None
        w = nbits_weight(weights[node.input[1]], weights[node.input[2]], zp, a["bits"], a["K"], a["block_size"])
        outs.append(norm64(x, gain) @ w)
    return outs


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("block", [16, 32, 128])
@pytest.mark.parametrize("symmetric", [True, False])
def test_matmulnbits_from_onnxruntime_quantizer(bits, block, symmetric, rng):
    model, gain = _float_model(rng, widths=(40, 24))
    quantized = ort_nbits(model, bits, block, symmetric)
    assert sum(n.op_type == "MatMulNBits" for n in quantized.graph.node) == 2
    x = x_feed(rng)
    reference = nbits_reference(quantized, x, gain)
    for got, want in zip(run(quantized, {"x": x}), reference):  # the test's dequantizer is ORT's
        assert relative_rms(got, want) < 1e-5
    folded, report = fold_model(quantized, quant_limit=float("inf"))
    assert report.count("folded") == 1, report.to_dict()
    assert op_types(folded) == op_types(quantized)
    details = report.decisions[0].details["quantized"]
    assert not details["exact"] and len(details["weights"]) == 2
    (site,) = find_norm_sites(gs.import_onnx(folded))
    assert site.is_weightless
    for got, want, weight in zip(run(folded, {"x": x}), reference, details["weights"]):
        error = relative_rms(got, want)
        # The report's rel_error is the expected relative output error for normalized inputs.
        assert error < 3 * weight["rel_error"] + 1e-5, (error, weight)
        assert weight["rel_error"] > 0 and weight["own_noise"] > 0
        assert abs(weight["noise_ratio"] - weight["rel_error"] / weight["own_noise"]) < 1e-9
        assert sum(weight["clip_ratios"].values()) == pytest.approx(1.0, abs=1e-3)


# ── DequantizeLinear weights, written here ──────────────────────────────────────────────────

CODE_TYPES = {  # name: (numpy dtype, qmin, qmax, ONNX type)
    "int4": ("int4", -8, 7), "uint4": ("uint4", 0, 15), "int8": (np.int8, -128, 127), "uint8": (np.uint8, 0, 255),
    "float8e4m3fn": ("float8_e4m3fn", None, None),
}


def _np_type(name):
    import ml_dtypes

    kind = CODE_TYPES[name][0]
    return np.dtype(getattr(ml_dtypes, kind) if isinstance(kind, str) else kind)


def expand(scale: np.ndarray, shape, kind: str, axis: int, block: int) -> np.ndarray:
    """A scale (or zero point) of the given layout, repeated to the weight's shape."""
    if kind == "tensor":
        return np.broadcast_to(scale.reshape(1, 1), shape).astype(np.float64)
    if kind == "axis":
        return np.broadcast_to(scale.reshape((-1, 1) if axis == 0 else (1, -1)), shape).astype(np.float64)
    return np.repeat(scale.astype(np.float64), block, axis=axis)[:shape[0], :shape[1]]


def quantize_np(w: np.ndarray, code: str, kind: str, axis: int, block: int, asymmetric: bool):
    """A plain amax quantizer (the test's own): codes, scale (float32), zero point or None."""
    def reduce(values, fn):
        if kind == "tensor":
            return np.asarray(fn(values)).reshape(())
        if kind == "axis":
            return fn(values, axis=1 - axis)
        moved = values if axis == 1 else values.T
        blocks = -(-moved.shape[1] // block)
        padded = np.zeros((moved.shape[0], blocks * block))
        padded[:, :moved.shape[1]] = moved
        out = fn(padded.reshape(moved.shape[0], blocks, block), axis=2)
        return out if axis == 1 else out.T

    dtype = _np_type(code)
    if code == "float8e4m3fn":
        scale = (reduce(np.abs(w), np.max) / 448).astype(np.float32)
        codes = (w / expand(scale, w.shape, kind, axis, block)).astype(dtype)
        return codes, scale, None
    _, qmin, qmax = CODE_TYPES[code]
    if asymmetric or qmin == 0:
        hi, lo = np.maximum(reduce(w, np.max), 0), np.minimum(reduce(w, np.min), 0)
        scale = ((hi - lo) / (qmax - qmin)).astype(np.float32)
        zero = np.clip(np.round(qmin - lo / scale), qmin, qmax)
        full_zero = expand(zero, w.shape, kind, axis, block)
        codes = np.clip(np.round(w / expand(scale, w.shape, kind, axis, block)) + full_zero, qmin, qmax)
        return codes.astype(dtype), scale, zero.astype(dtype)
    scale = (reduce(np.abs(w), np.max) / qmax).astype(np.float32)
    codes = np.clip(np.round(w / expand(scale, w.shape, kind, axis, block)), qmin, qmax)
    return codes.astype(dtype), scale, None


def dequantize_np(codes, scale, zero, kind, axis, block) -> np.ndarray:
    full = expand(scale, codes.shape, kind, axis, block)
    z = 0.0 if zero is None else expand(zero.astype(np.float64), codes.shape, kind, axis, block)
    return (codes.astype(np.float64) - z) * full


LAYOUTS = {  # name: (kind, axis relative to K (0) or N (1), block, exact)
    "per-tensor": ("tensor", 0, 0, False),
    "per-axis-N": ("axis", 1, 0, False),
    "per-axis-K": ("axis", 0, 0, True),
    "blocked-K32": ("block", 0, 32, False),
    "blocked-K1": ("block", 0, 1, True),
    "blocked-N8": ("block", 1, 8, True),
}


def dq_model(rng, code, layout, spelling, asymmetric, gain=None, width=40):
    """x → norm → MatMul/Gemm reading DequantizeLinear(codes, scale[, zero]) as its weight.
    spelling: 'kn' [K, N] codes; 'transpose' [N, K] codes behind Transpose; 'gemm' [N, K] codes,
    Gemm transB=1; 'cast' [K, N] codes, DequantizeLinear → Cast(float16) → Cast(float)."""
    kind, k_or_n, block, _ = LAYOUTS[layout]
    b = GraphBuilder(21)
    gain = random_gain(rng, HIDDEN) if gain is None else gain
    y = axes_input(b, "x", gain, EPS)
    w = rng.standard_normal((HIDDEN, width)) / np.sqrt(HIDDEN)  # [K, N]
    transposed = spelling in ("transpose", "gemm")
    stored = w.T if transposed else w
    axis = k_or_n if not transposed else 1 - k_or_n
    codes, scale, zero = quantize_np(stored, code, kind, axis, block, asymmetric)
    inputs = [b.const(codes, "w_q"), b.const(scale, "w_scale")] + ([b.const(zero, "w_zero")] if zero is not None else [])
    attrs = {"axis": axis} if kind != "tensor" else {}
    if kind == "block":
        attrs["block_size"] = block
    weight = b.op("DequantizeLinear", inputs, **attrs)
    if spelling == "transpose":
        weight = b.op("Transpose", [weight], perm=[1, 0])
    if spelling == "cast":
        weight = b.op("Cast", [b.op("Cast", [weight], to=TensorProto.FLOAT16)], to=TensorProto.FLOAT)
    dims = ["tokens"] if spelling == "gemm" else ["batch", "seq"]
    out = b.op("Gemm", [y, weight], transB=1) if spelling == "gemm" else b.op("MatMul", [y, weight])
    model = b.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, dims + [HIDDEN])], [out])
    deq = dequantize_np(codes, scale, zero, kind, axis, block)
    if spelling == "cast":
        deq = deq.astype(np.float16).astype(np.float64)
    return model, gain, deq.T if transposed else deq


def _check_folded(model, gain, weight, rng, *, exact, x=None, limit=float("inf"), rounding=1e-5):
    """Fold, then compare ONNX Runtime on the folded file with the float64 evaluation of the
    original; returns the fold's site details. `rounding`: what float rounding alone may cost
    (an fp16 Cast after the dequantized weight rounds the folded values again)."""
    folded, report = fold_model(model, quant_limit=limit)
    assert report.count("folded") == 1, report.to_dict()
    assert op_types(folded) == op_types(model)
    details = report.decisions[0].details["quantized"]
    assert details["exact"] == exact
    x = x_feed(rng) if x is None else x
    if x.ndim == 3 and model.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "tokens":
        x = x.reshape(-1, x.shape[-1])
    want = norm64(x, gain) @ weight
    (original,) = run(model, {"x": x})
    assert relative_rms(original, want) < 5e-5  # the test's dequantizer is ORT's
    (got,) = run(folded, {"x": x})
    error = relative_rms(got, want)
    (weight_details,) = details["weights"]
    if exact:
        assert error < rounding and weight_details["noise_ratio"] < 0.05, (error, weight_details)
    else:
        assert error < 3 * weight_details["rel_error"] + rounding, (error, weight_details)
        assert weight_details["noise_ratio"] > 0
    return details


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("code,asymmetric", [("int4", False), ("uint4", True), ("int8", False), ("int8", True),
                                             ("uint8", True)])
def test_dequantize_linear_every_layout(code, asymmetric, layout, rng):
    model, gain, weight = dq_model(rng, code, layout, "kn", asymmetric)
    _check_folded(model, gain, weight, rng, exact=LAYOUTS[layout][3])


@pytest.mark.parametrize("layout", ["per-tensor", "per-axis-N", "per-axis-K"])
def test_dequantize_linear_float8(layout, rng):
    model, gain, weight = dq_model(rng, "float8e4m3fn", layout, "kn", False)
    _check_folded(model, gain, weight, rng, exact=LAYOUTS[layout][3])


@pytest.mark.parametrize("spelling", ["transpose", "gemm", "cast"])
@pytest.mark.parametrize("layout", ["per-axis-N", "per-axis-K", "blocked-K32"])
def test_dequantize_linear_transposed_spellings(spelling, layout, rng):
    model, gain, weight = dq_model(rng, "int8", layout, spelling, False)
    _check_folded(model, gain, weight, rng, exact=LAYOUTS[layout][3], rounding=2e-3 if spelling == "cast" else 1e-5)


# ── fake quantization (ModelOpt): float → QuantizeLinear → DequantizeLinear ────────────────

def fake_quant_model(rng, code, layout, gain=None, width=40):
    """ModelOpt's weight spelling: a float [N, K] initializer → Q → DQ (one shared scale, zero
    points of the code type, zeros) → Transpose → MatMul; scale from amax per group."""
    kind, k_or_n, block, _ = LAYOUTS[layout]
    b = GraphBuilder(21)
    gain = random_gain(rng, HIDDEN) if gain is None else gain
    y = axes_input(b, "x", gain, EPS)
    w = (rng.standard_normal((width, HIDDEN)) / np.sqrt(HIDDEN)).astype(np.float32)  # [N, K]
    axis = 1 - k_or_n
    codes, scale, _ = quantize_np(w.astype(np.float64), code, kind, axis, block, False)
    zero = np.zeros(scale.shape, _np_type(code))
    attrs = {"axis": axis} if kind != "tensor" else {}
    if kind == "block":
        attrs["block_size"] = block
    scale_name, zero_name = b.const(scale, "w_scale"), b.const(zero, "w_zero")
    q = b.op("QuantizeLinear", [b.const(w, "w"), scale_name, zero_name], **attrs)
    weight = b.op("Transpose", [b.op("DequantizeLinear", [q, scale_name, zero_name], **attrs)], perm=[1, 0])
    out = b.op("MatMul", [y, weight])
    model = b.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", HIDDEN])], [out])
    # What QuantizeLinear computes at run time: w / s in float32 (float64 would round a tie
    # the other way now and then), saturated to the code range.
    quotient = w / expand(scale, w.shape, kind, axis, block).astype(np.float32)
    if code == "float8e4m3fn":
        codes = np.clip(quotient, -448, 448).astype(_np_type(code))
    else:
        codes = np.clip(np.round(quotient), CODE_TYPES[code][1], CODE_TYPES[code][2])
    return model, gain, dequantize_np(codes, scale, None, kind, axis, block).T, w


@pytest.mark.parametrize("code,layout", [("int8", "per-axis-N"), ("int8", "per-tensor"), ("int4", "blocked-K32"),
                                         ("float8e4m3fn", "per-tensor"), ("int8", "per-axis-K")])
def test_fake_quant_folds_into_the_float_weight(code, layout, rng):
    model, gain, weight, w = fake_quant_model(rng, code, layout)
    details = _check_folded(model, gain, weight, rng, exact=LAYOUTS[layout][3])
    assert "fake quant" in details["weights"][0]["format"]
    folded, _ = fold_model(model, quant_limit=float("inf"))
    saved = graph_weights(folded)
    (quantize,) = [n for n in folded.graph.node if n.op_type == "QuantizeLinear"]
    (dequantize,) = [n for n in folded.graph.node if n.op_type == "DequantizeLinear"]
    # The float weight took the gain; Q and DQ share the recomputed scale: amax(|g·W|) per group.
    np.testing.assert_array_equal(saved[quantize.input[0]], (w.astype(np.float64) * gain).astype(np.float32))
    assert quantize.input[1] == dequantize.input[1]
    kind, k_or_n, block, _ = LAYOUTS[layout]
    _, expected_scale, _ = quantize_np(w.astype(np.float64) * gain, code, kind, 1 - k_or_n, block, False)
    np.testing.assert_allclose(saved[quantize.input[1]], expected_scale, rtol=1e-6)


# ── exact: a per-input-channel scale in front of the projection ────────────────────────────

def test_prescale_mul_absorbs_the_gain_exactly(rng):
    """ModelOpt int4_awq: x̂·g → Mul(pre_quant_scale) → MatMulNBits; the gain goes into the
    scale (exact), the quantized weight is not touched; a plain float projection beside it is
    folded as usual."""
    model, gain = _float_model(rng, widths=(40, 24))
    quantized = ort_nbits(model, 4, 32, False)
    graph = gs.import_onnx(quantized)
    (site,) = find_norm_sites(graph)
    nbits = [n for n in graph.nodes if n.op == "MatMulNBits"]
    prescale = (np.exp(rng.uniform(-1, 1, HIDDEN))).astype(np.float32)
    scaled = gs.Variable("prescaled", dtype=np.float32)
    graph.nodes.append(gs.Node("Mul", name="pre_quant_scale", inputs=[site.output, gs.Constant("s", prescale)],
                               outputs=[scaled]))
    nbits[0].inputs[0] = scaled
    model = gs.export_onnx(graph)
    before = graph_weights(model)
    x = x_feed(rng)
    folded, report = fold_model(model)  # the default quant limit: the exact prescale is taken...
    assert report.count("skipped") == 1 and "quant limit" in report.decisions[0].reason  # ...the bare MatMulNBits is not
    folded, report = fold_model(model, quant_limit=float("inf"))
    weights = report.decisions[0].details["quantized"]["weights"]
    (exact,) = [w for w in weights if w["exact"]]
    assert len(weights) == 2 and exact["format"].startswith("prescale") and exact["consumer"] == "Mul pre_quant_scale"
    after = graph_weights(folded)
    (mul,) = [n for n in folded.graph.node if n.op_type == "Mul" and n.name == "pre_quant_scale"]
    np.testing.assert_array_equal(after[mul.input[1]], (prescale.astype(np.float64) * gain).astype(np.float32))
    (behind,) = [n for n in folded.graph.node if n.op_type == "MatMulNBits" and n.input[0] == mul.output[0]]
    assert behind.input[1] in before  # behind the prescale: B unchanged
    index = [o.name for o in folded.graph.output].index(behind.output[0])
    got, expected = run(folded, {"x": x})[index], run(model, {"x": x})[index].astype(np.float64)
    want = (norm64(x, gain) * prescale) @ nbits_weight(*[before[n] for n in behind.input[1:4]], 4, HIDDEN, 32)
    assert relative_rms(got, want) < 1e-5 and relative_rms(got, expected) < 1e-5


def test_prescale_alone_folds_within_the_default_limit(rng):
    model, gain = _float_model(rng, widths=(40,))
    quantized = ort_nbits(model, 4, 32, True)
    graph = gs.import_onnx(quantized)
    (site,) = find_norm_sites(graph)
    (nbits,) = [n for n in graph.nodes if n.op == "MatMulNBits"]
    prescale = np.exp(rng.uniform(-1, 1, HIDDEN)).astype(np.float32)
    scaled = gs.Variable("prescaled", dtype=np.float32)
    graph.nodes.append(gs.Node("Mul", name="pre_quant_scale", inputs=[site.output, gs.Constant("s", prescale)],
                               outputs=[scaled]))
    nbits.inputs[0] = scaled
    model = gs.export_onnx(graph)
    x = x_feed(rng)
    folded, report = fold_model(model)
    assert report.count("folded") == 1 and report.decisions[0].details["quantized"]["exact"]
    assert relative_rms(run(folded, {"x": x})[0], run(model, {"x": x})[0].astype(np.float64)) < 1e-5


# ── refusals: one line, the site left alone ─────────────────────────────────────────────────

def test_activation_quantize_linear_is_refused_with_the_route(rng):
    """ModelOpt int8/fp8: a static QuantizeLinear on the norm's output, calibrated on x̂·g."""
    b = GraphBuilder(21)
    y = axes_input(b, "x", random_gain(rng, HIDDEN), EPS)
    scale, zero = b.const(np.array(0.05, np.float32)), b.const(np.array(0, np.int8))
    a = b.op("DequantizeLinear", [b.op("QuantizeLinear", [y, scale, zero]), scale, zero])
    out = b.op("MatMul", [a, b.const((rng.standard_normal((HIDDEN, 8)) / 10).astype(np.float32), "w")])
    model = b.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", HIDDEN])], [out])
    folded, report = fold_model(model)
    (decision,) = report.decisions
    assert decision.action == "skipped" and "fold first, then quantize" in decision.reason
    assert "\n" not in decision.reason
    x = x_feed(rng)
    np.testing.assert_array_equal(run(folded, {"x": x})[0], run(model, {"x": x})[0])


def _edit_model(model, edit):
    graph = gs.import_onnx(model)
    edit(graph)
    return gs.export_onnx(graph, do_type_check=False)


def _malformed(rng):
    """(name, model, words the reason must contain) for inputs the fold must refuse."""
    cases = []
    model, _, _ = dq_model(rng, "int8", "blocked-K32", "kn", False)

    def wrong_scale(graph):
        (dq,) = [n for n in graph.nodes if n.op == "DequantizeLinear"]
        dq.inputs[1] = gs.Constant("bad_scale", np.ones((2, 40), np.float32))
    cases.append(("scale shape vs block size", _edit_model(model, wrong_scale), "does not match block_size"))
    model, _, _ = dq_model(rng, "uint8", "per-axis-N", "kn", True)

    def wrong_zero(graph):
        (dq,) = [n for n in graph.nodes if n.op == "DequantizeLinear"]
        dq.inputs[2] = gs.Constant("bad_zero", dq.inputs[2].values.astype(np.int8))
    cases.append(("zero point type", _edit_model(model, wrong_zero), "zero point of type int8"))

    def graph_input(graph):
        (dq,) = [n for n in graph.nodes if n.op == "DequantizeLinear"]
        codes = gs.Variable("w_codes_input", dtype=np.uint8, shape=list(dq.inputs[0].shape))
        dq.inputs[0] = codes
        graph.inputs.append(codes)
    cases.append(("codes are a graph input", _edit_model(model, graph_input), "graph input"))
    quantized = ort_nbits(_float_model(rng)[0], 4, 32, False)

    def nbits_scales(graph):
        (node,) = [n for n in graph.nodes if n.op == "MatMulNBits"]
        node.inputs[2] = gs.Constant("bad_scales", np.ones((40, 2), np.float32))
    cases.append(("MatMulNBits scales", _edit_model(quantized, nbits_scales), "does not match N=40"))

    def nbits_zero(graph):
        (node,) = [n for n in graph.nodes if n.op == "MatMulNBits"]
        node.inputs[3] = gs.Constant("bad_zero", node.inputs[3].values.astype(np.int8))
    cases.append(("MatMulNBits zero point type", _edit_model(quantized, nbits_zero), "zero points of type int8"))

    def g_idx(graph):
        (node,) = [n for n in graph.nodes if n.op == "MatMulNBits"]
        node.inputs.append(gs.Constant("g_idx", (np.arange(HIDDEN) // 32).astype(np.int32)))
    cases.append(("MatMulNBits g_idx", _edit_model(quantized, g_idx), "g_idx (act-order)"))
    return cases


def test_malformed_quantized_inputs_leave_the_site_alone(rng):
    for name, model, words in _malformed(rng):
        folded, report = fold_model(model, quant_limit=float("inf"))
        (decision,) = report.decisions
        assert decision.action == "skipped" and words in decision.reason, (name, decision.reason)
        assert "\n" not in decision.reason
        before = {n.name: list(n.input) for n in model.graph.node}
        assert {n.name: list(n.input) for n in folded.graph.node} == before, name  # the file as it was
        assert graph_weights(folded).keys() == graph_weights(model).keys()


def test_sites_above_the_quant_limit_keep_their_gain(rng):
    model, gain = _float_model(rng, widths=(40,))
    quantized = ort_nbits(model, 4, 32, False)
    folded, report = fold_model(quantized, quant_limit=0.01)
    (decision,) = report.decisions
    assert decision.action == "skipped" and "above the quant limit 0.01" in decision.reason
    measured = decision.details["quantized"]["noise_ratio"]
    assert measured > 0.01 and decision.details["quantized"]["weights"][0]["rel_error"] > 0
    x = x_feed(rng)
    np.testing.assert_array_equal(run(folded, {"x": x})[0], run(quantized, {"x": x})[0])
    _, report = fold_model(quantized, quant_limit=measured * 1.001)
    assert report.count("folded") == 1
    assert report.decisions[0].details["quantized"]["noise_ratio"] == pytest.approx(measured)


def test_tied_quantized_weight_follows_the_untie_rule(rng):
    """One MatMulNBits weight read by two projections of different norms: kept without
    --untie; with it, each consumer gets its own requantized copy."""
    b = GraphBuilder(21)
    y1 = axes_input(b, "x", random_gain(rng, HIDDEN), EPS)
    y2 = axes_input(b, b.op("Relu", ["x"]), random_gain(rng, HIDDEN), EPS)
    w = b.const((rng.standard_normal((HIDDEN, 40)) / 10).astype(np.float32), "w")
    outs = [b.op("MatMul", [y1, w]), b.op("MatMul", [y2, w])]
    model = b.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", HIDDEN])], outs)
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(model, algo_config=DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=True))
    quantizer.process()
    quantized = quantizer.model.model
    nbits = [n for n in quantized.graph.node if n.op_type == "MatMulNBits"]
    if len({n.input[1] for n in nbits}) != 1:  # the quantizer made two copies: tie them by hand
        graph = gs.import_onnx(quantized)
        first, second = [n for n in graph.nodes if n.op == "MatMulNBits"]
        second.inputs[1], second.inputs[2] = first.inputs[1], first.inputs[2]
        quantized = gs.export_onnx(graph.cleanup())
    _, report = fold_model(quantized, quant_limit=float("inf"))
    assert report.count("folded") == 0 and all("--untie" in d.reason for d in report.decisions)
    folded, report = fold_model(quantized, quant_limit=float("inf"), untie=True)
    assert report.count("folded") == 2
    assert op_types(folded) == op_types(quantized)
    x = x_feed(rng)
    got, want = run(folded, {"x": x}), run(quantized, {"x": x})
    for a, e, d in zip(got, want, report.decisions):
        assert relative_rms(a, e.astype(np.float64)) < 3 * d.details["quantized"]["rel_error"] + 1e-4


# ── whole files: CLI, inspect, defer, external data ────────────────────────────────────────

def _nbits_file(rng, path, bits=4, block=32, symmetric=False):
    model, gain = _float_model(rng, widths=(40, 24))
    onnx.save(ort_nbits(model, bits, block, symmetric), str(path))
    return gain


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "abc"])
def test_bad_quant_limit_is_one_line_exit_2(value, tmp_path, rng, capsys):
    from flashnorm import cli

    path = tmp_path / "q.onnx"
    _nbits_file(rng, path)
    for command in (["optimize", str(path), "-o", str(tmp_path / "out.onnx")], ["inspect", str(path)]):
        assert cli.main([*command, f"--quant-limit={value}"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "--quant-limit" in err, err
    assert not (tmp_path / "out.onnx").exists()


def test_optimize_and_inspect_report_the_requantization_error(tmp_path, rng, capsys):
    import json

    from flashnorm import cli

    path, out, report_path = tmp_path / "q.onnx", tmp_path / "out.onnx", tmp_path / "report.json"
    _nbits_file(rng, path)
    original = path.read_bytes()
    assert cli.main(["inspect", str(path), "--quant-limit", "100"]) == 0
    text = capsys.readouterr().out
    assert "requantized: rel error" in text and "MatMulNBits uint4 block 32 asymmetric" in text
    assert "1 foldable" in text
    assert cli.main(["inspect", str(path)]) == 0  # the default limit
    assert "above the quant limit 0.25" in capsys.readouterr().out
    assert cli.main(["optimize", str(path), "-o", str(out), "--quant-limit", "100", "--report", str(report_path)]) == 0
    assert "sites folded into quantized weights, 0 exactly; 1 requantized" in capsys.readouterr().out
    report = json.loads(report_path.read_text())
    (site,) = report["reports"][0]["sites"]
    assert site["action"] == "folded" and len(site["details"]["quantized"]["weights"]) == 2
    assert report["quant_limit"] == 100
    assert path.read_bytes() == original  # the input is never modified
    assert op_types(onnx.load(str(out))) == op_types(onnx.load(str(path)))


def test_defer_refuses_quantized_consumers_and_says_which(rng, tmp_path):
    from flashnorm.passes.dry_run import inspect_graph

    model, _ = _float_model(rng, widths=(40,))
    nbits = ort_nbits(model, 4, 32, True)
    graph, reports = run_passes(gs.import_onnx(nbits), ["fold", "defer"], quant_limit=float("inf"))
    assert reports[0].count("folded") == 1
    (decision,) = reports[1].decisions
    assert decision.action == "skipped" and "plugin takes float weights" in decision.reason
    assert "inside the op" in decision.reason
    dq, _, _ = dq_model(rng, "int8", "per-axis-K", "kn", False)
    report = inspect_graph(gs.import_onnx(dq))
    (site,) = report["sites"]
    assert site["fold"]["applies"] and site["fold"]["quantized"]["exact"]
    assert site["defer"]["applies"] and site["defer"]["dequantized"] == [
        f"{site['consumers'][0]}: DequantizeLinear int8 → float32"]
    from flashnorm.tools.inspect import format_text

    assert "#0 defer reads a weight the graph dequantizes (MatMul" in format_text(report, verbose=True)
    assert "#0 defer reads weights the graph dequantizes (DequantizeLinear int8 → float32: 1 weight at 1 site)" \
        in format_text(report)


def _quantized_initializers(model):
    return sorted((tuple(t.dims), t.data_type) for t in model.graph.initializer if t.data_type not in (
        TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.INT64))


@pytest.mark.parametrize("spelling", ["kn", "transpose", "gemm", "cast"])
@pytest.mark.parametrize("code,layout", [("int8", "per-axis-K"), ("uint4", "blocked-N8"), ("int4", "blocked-K1")])
def test_defer_reads_a_weight_the_graph_dequantizes(code, layout, spelling, rng):
    """The fold is exact in these layouts; defer then replaces the MatMul by the plugin node
    reading the DequantizeLinear's output: the codes stay in the file, the output is the
    float64 evaluation of the original graph's."""
    from flashnorm import contract

    model, gain, weight = dq_model(rng, code, layout, spelling, code == "uint4")
    graph, reports = run_passes(gs.import_onnx(model), ["fold", "defer"], quant_limit=float("inf"))
    assert reports[0].count("folded") == 1 and reports[1].count("deferred") == 1, reports[1].to_dict()
    (decision,) = reports[1].decisions
    assert decision.details["dequantized"] and code in decision.details["dequantized"][0]
    deferred = gs.export_onnx(graph)
    onnx.checker.check_model(deferred, full_check=True)
    ops = [n.op_type for n in deferred.graph.node]
    assert ops.count("DequantizeLinear") == 1 and "MatMul" not in ops and "Gemm" not in ops
    assert [n for n in deferred.graph.node if contract.is_deferred_node(n.op_type, n.domain)]
    assert _quantized_initializers(deferred) == _quantized_initializers(model)
    x = x_feed(rng)
    if spelling == "gemm":
        x = x.reshape(-1, HIDDEN)
    (got,) = run(deferred, {"x": x})
    assert relative_rms(got, norm64(x, gain) @ weight) < (1e-3 if spelling == "cast" else 1e-5)


def test_defer_concatenates_dequantized_and_constant_weights_in_the_graph(rng, max_error):
    """q|k|v: a blocked int4 weight, an int8 one behind a Transpose, and a float Gemm weight with
    alpha and a bias: one FlashNormMatMul3 reading a Concat of the three, the same outputs."""
    from flashnorm import contract

    b = GraphBuilder(21)
    gain = random_gain(rng, HIDDEN)
    y = axes_input(b, "x", gain, EPS)
    outs = []
    for name, code, layout, transposed in (("q", "int4", "blocked-N8", False), ("k", "int8", "per-axis-K", True)):
        kind, k_or_n, block, _ = LAYOUTS[layout]
        w = rng.standard_normal((HIDDEN, 24)) / np.sqrt(HIDDEN)
        stored = w.T if transposed else w
        axis = k_or_n if not transposed else 1 - k_or_n
        codes, scale, _ = quantize_np(stored, code, kind, axis, block, False)
        attrs = {"axis": axis, **({"block_size": block} if kind == "block" else {})}
        weight = b.op("DequantizeLinear", [b.const(codes, f"{name}_q"), b.const(scale, f"{name}_scale")], **attrs)
        outs.append(b.op("MatMul", [y, b.op("Transpose", [weight], perm=[1, 0]) if transposed else weight]))
    v = b.const((rng.standard_normal((16, HIDDEN)) / np.sqrt(HIDDEN)).astype(np.float32), "v_w")
    bias = b.const(rng.standard_normal(16).astype(np.float32), "v_b")
    outs.append(b.op("Gemm", [y, v, bias], transB=1, alpha=0.5))
    model = b.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, ["tokens", HIDDEN])], outs)
    folded, _ = run_passes(gs.import_onnx(model), ["fold"], quant_limit=float("inf"))
    graph, reports = run_passes(gs.import_onnx(model), ["fold", "defer"], quant_limit=float("inf"))
    deferred = gs.export_onnx(graph)
    assert reports[1].count("deferred") == 1, reports[1].to_dict()
    assert len(reports[1].decisions[0].details["dequantized"]) == 2
    (node,) = [n for n in deferred.graph.node if contract.is_deferred_node(n.op_type, n.domain)]
    (concat,) = [n for n in deferred.graph.node if n.op_type == "Concat"]
    assert node.input[1] == concat.output[0] and len(node.output) == 3
    assert _quantized_initializers(deferred) == _quantized_initializers(model)
    assert max_error(gs.export_onnx(folded), deferred) < 1e-5


def _prescaled(model, rng):
    """`model` with a per-channel Mul (ModelOpt awq's pre_quant_scale) between its norm and its projection."""
    graph = gs.import_onnx(model)
    (site,) = find_norm_sites(graph)
    (projection,) = site.consumers
    scaled = gs.Variable("prescaled", dtype=np.float32)
    graph.nodes.append(gs.Node("Mul", name="pre_quant_scale", outputs=[scaled], inputs=[
        site.output, gs.Constant("s", np.exp(rng.uniform(-1, 1, HIDDEN)).astype(np.float32))]))
    projection.inputs[0] = scaled
    return gs.export_onnx(graph)


def test_inspect_names_the_quantized_reason_where_fold_keeps_the_gain(rng):
    """A site the fold leaves alone (above the quant limit, or an activation QuantizeLinear):
    defer's reason is the quantized consumer, which no fold changes, not "run fold first"."""
    from flashnorm.passes.dry_run import inspect_graph

    model, _ = _float_model(rng, widths=(40,))
    blocked, _, _ = dq_model(rng, "int4", "blocked-K32", "kn", False)
    b = GraphBuilder(21)
    y = axes_input(b, "x", random_gain(rng, HIDDEN), EPS)
    scale, zero = b.const(np.array(0.05, np.float32)), b.const(np.array(0, np.int8))
    a = b.op("DequantizeLinear", [b.op("QuantizeLinear", [y, scale, zero]), scale, zero])
    out = b.op("MatMul", [a, b.const((rng.standard_normal((HIDDEN, 8)) / 10).astype(np.float32), "w")])
    activation = b.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", HIDDEN])], [out])
    cases = {"nbits": (ort_nbits(model, 4, 32, True), "dequantizes its weight inside the op"),
             "dq": (blocked, "fold leaves the gain here"),
             "activation": (activation, "quantizes the normalized activation"),
             "prescale": (_prescaled(blocked, rng), "scales the activation in front of a quantized projection")}
    for name, (case, words) in cases.items():
        (site,) = inspect_graph(gs.import_onnx(case), quant_limit=0)["sites"]
        if name != "prescale":  # the prescale Mul takes the gain exactly
            assert not site["fold"]["applies"], name
        assert not site["defer"]["applies"] and words in site["defer"]["reason"], (name, site["defer"]["reason"])
        assert "run fold first" not in site["defer"]["reason"] and "\n" not in site["defer"]["reason"]

def test_external_data_quantized_model_is_streamed(rng, tmp_path, external_reads):
    """An external-data MatMulNBits model: planning reads the quantized weights to measure
    them, the save writes the requantized ones computed once per weight; the input stays."""
    from flashnorm.passes import optimize_file

    model, gain = _float_model(rng, widths=(40, 24))
    quantized = ort_nbits(model, 4, 32, False)
    source, out = tmp_path / "in" / "q.onnx", tmp_path / "q.flashnorm.onnx"
    source.parent.mkdir()
    stored = onnx.ModelProto()
    stored.CopyFrom(quantized)  # onnx.save moves the copy's tensors out to the data file
    onnx.save(stored, str(source), save_as_external_data=True, location="q.bin", size_threshold=64)
    before = (source.parent / "q.bin").read_bytes()
    report = optimize_file(source, out, ("fold",), quant_limit=float("inf"))
    assert report["summary"]["fold.folded"] == 1
    assert (source.parent / "q.bin").read_bytes() == before
    x = x_feed(rng)
    reference = nbits_reference(quantized, x, gain)
    details = report["reports"][0]["sites"][0]["details"]["quantized"]["weights"]
    saved = onnx.load(str(out))
    for got, want in zip(run(saved, {"x": x}), reference):
        assert relative_rms(got, want) < 3 * max(d["rel_error"] for d in details) + 1e-5
    while_saving = [name for name, saving in external_reads if saving]
    quantized_tensors = [name for n in quantized.graph.node if n.op_type == "MatMulNBits" for name in n.input[1:4]]
    for name in quantized_tensors:  # B, scales, zero points: read once while saving, requantized together
        assert while_saving.count(name) == 1, external_reads


def test_matmulnbits_float16_scales_keep_their_type(rng):
    """float16 activations and scales (onnxruntime-genai's fp16 int4 route): the requantized
    scales stay float16, chosen and measured as float16 stores them."""
    model, gain = _float_model(rng, widths=(40,))
    graph = gs.import_onnx(ort_nbits(model, 4, 32, False))
    (node,) = [n for n in graph.nodes if n.op == "MatMulNBits"]
    node.inputs[2] = gs.Constant("scales16", node.inputs[2].values.astype(np.float16))
    x16, y16, out = gs.Variable("x16", dtype=np.float16), gs.Variable("y16", dtype=np.float16), node.outputs[0]
    graph.nodes.append(gs.Node("Cast", inputs=[node.inputs[0]], outputs=[x16], attrs={"to": TensorProto.FLOAT16}))
    graph.nodes.append(gs.Node("Cast", inputs=[y16], outputs=[out], attrs={"to": TensorProto.FLOAT}))
    node.inputs[0], node.outputs = x16, [y16]
    quantized = gs.export_onnx(graph.toposort())
    folded, report = fold_model(quantized, quant_limit=float("inf"))
    assert report.count("folded") == 1, report.to_dict()
    (weight,) = report.decisions[0].details["quantized"]["weights"]
    assert "float16 scales" in weight["format"]
    saved = graph_weights(folded)
    (after,) = [n for n in folded.graph.node if n.op_type == "MatMulNBits"]
    assert saved[after.input[2]].dtype == np.float16
    x = x_feed(rng)
    want = norm64(x, gain) @ nbits_weight(*[graph_weights(quantized)[n] for n in node_inputs(quantized)], 4, HIDDEN, 32)
    (got,) = run(folded, {"x": x})
    assert relative_rms(got, want) < 3 * weight["rel_error"] + 2e-3  # fp16 activations


def node_inputs(model):
    (node,) = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    return node.input[1:4]


@pytest.mark.parametrize("external", [False, True])
@pytest.mark.parametrize("code,layout,asymmetric", [("int4", "blocked-K32", False), ("uint4", "blocked-K32", True),
                                                    ("float8e4m3fn", "per-axis-N", False),
                                                    ("int4", "per-axis-K", False)])
def test_saved_file_holds_the_requantized_codes(code, layout, asymmetric, external, rng, tmp_path):
    """Through optimize_file (modelio.save, inline or with external data): sub-byte codes are
    written packed, fp8 as bytes; ONNX Runtime loads the file and agrees with the report."""
    from flashnorm.passes import optimize_file

    model, gain, weight = dq_model(rng, code, layout, "kn", asymmetric, width=48)
    source, out = tmp_path / "q.onnx", tmp_path / "q.flashnorm.onnx"
    onnx.save(model, str(source), save_as_external_data=external, location="q.bin", size_threshold=16)
    report = optimize_file(source, out, ("fold",), quant_limit=float("inf"), external_data=external)
    (site,) = report["reports"][0]["sites"]
    assert site["action"] == "folded", site
    (details,) = site["details"]["quantized"]["weights"]
    x = x_feed(rng)
    saved = onnx.load(str(out))
    assert op_types(saved) == op_types(model)
    (got,) = run(saved, {"x": x})
    error = relative_rms(got, norm64(x, gain) @ weight)
    assert error < (1e-5 if details["exact"] else 3 * details["rel_error"] + 1e-5), (error, details)


@pytest.mark.parametrize("bits", [4])  # ONNX Runtime's CPU kernel refuses 8 bits with float zero points
def test_matmulnbits_float_zero_points(bits, rng):
    """Zero points of the scales' type (w = (q − zp)·s): recomputed unrounded, type kept."""
    model, gain = _float_model(rng, widths=(40,))
    quantized = ort_nbits(model, bits, 32, False)
    graph = gs.import_onnx(quantized)
    (node,) = [n for n in graph.nodes if n.op == "MatMulNBits"]
    blocks = HIDDEN // 32
    packed = node.inputs[3].values.reshape(40, -1)
    per = 8 // bits
    zeros = np.stack([(packed >> (bits * i)) & ((1 << bits) - 1) for i in range(per)], -1).reshape(40, -1)[:, :blocks]
    node.inputs[3] = gs.Constant("float_zero", (zeros + 0.25).astype(np.float32).reshape(-1))  # off-grid on purpose
    quantized = gs.export_onnx(graph)
    x = x_feed(rng)
    (reference,) = nbits_reference(quantized, x, gain)
    assert relative_rms(run(quantized, {"x": x})[0], reference) < 1e-5  # the test's reading is ORT's
    folded, report = fold_model(quantized, quant_limit=float("inf"))
    assert report.count("folded") == 1, report.to_dict()
    (weight,) = report.decisions[0].details["quantized"]["weights"]
    assert "float zero points" in weight["format"]
    (after,) = [n for n in folded.graph.node if n.op_type == "MatMulNBits"]
    assert graph_weights(folded)[after.input[3]].dtype == np.float32
    error = relative_rms(run(folded, {"x": x})[0], reference)
    assert error < 3 * weight["rel_error"] + 1e-5, (error, weight)
