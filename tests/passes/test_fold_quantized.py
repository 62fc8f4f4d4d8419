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
from synthetic import GraphBuilder, axes_input, random_gain, run

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
    else:
        zp = zero_points.reshape(n, -1)
        zeros = np.stack([(zp >> (bits * i)) & ((1 << bits) - 1) for i in range(per)], axis=-1).reshape(n, -1)[:, :blocks]
    w = (codes[..., :block] - zeros[..., None].astype(np.float64)) * scales.reshape(n, blocks, 1).astype(np.float64)
    return w.reshape(n, -1)[:, :k].T


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
