"""flashnorm.match.quantized: every quantized spelling ONNX Runtime and TensorRT run is recognised,
with its codes, scales and zero points found and its fold and defer reasons one line each."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto

from flashnorm.match import quantized
from flashnorm.match.quantized import QUANTIZED_OPS, dequantized_weight, quantized_use


def _tensor(name: str, dtype=np.float32) -> gs.Variable:
    return gs.Variable(name, dtype=dtype)


def _node(op: str, inputs: list, outputs: int = 1, **attrs) -> tuple[gs.Node, list[gs.Variable]]:
    outs = [_tensor(f"{op}_out{i}") for i in range(outputs)]
    return gs.Node(op, name=op.lower(), attrs=attrs, inputs=inputs, outputs=outs), outs


def _codes(shape=(8, 4), dtype=np.int8) -> gs.Constant:
    return gs.Constant("codes", np.zeros(shape, dtype))


def _scale(shape=(4,)) -> gs.Constant:
    return gs.Constant("scale", np.ones(shape, np.float32))


def _zero(shape=(4,), dtype=np.int8) -> gs.Constant:
    return gs.Constant("zero", np.zeros(shape, dtype))


def test_every_row_names_inputs_the_op_has():
    for name, row in QUANTIZED_OPS.items():
        assert row.role in (quantized.WEIGHT, quantized.DYNAMIC, quantized.INTEGER, quantized.QUANTIZE,
                            quantized.DYNAMIC_QUANTIZE, quantized.DEQUANTIZE, quantized.GATHER), name
        indices = [i for i in (row.activation, row.codes, row.scales, row.zero_points, row.bias) if i is not None]
        assert len(indices) == len(set(indices)), name
    # What ONNX Runtime and TensorRT run, as the issue lists it: one table.
    for name in ("MatMulNBits", "MatMulBnb4", "DequantizeLinear", "QuantizeLinear", "QGemm", "QLinearMatMul",
                 "MatMulInteger", "MatMulIntegerToFloat", "DynamicQuantizeMatMul", "DynamicQuantizeLinear",
                 "GatherBlockQuantized"):
        assert quantized.is_quantized_op(name)
    assert not quantized.is_quantized_op("MatMul")


@pytest.mark.parametrize("name,quantized_type", [("int8", True), ("float8_e4m3fn", True), ("float8e4m3fn", True),
                                                 ("uint4", True), ("float32", False), ("bfloat16", False)])
def test_quantized_storage(name, quantized_type):
    assert quantized.is_quantized_storage(name) == quantized_type


def _chain(spelling: str):
    """x → MatMul/Gemm whose weight is DequantizeLinear(codes, scale, zero) in `spelling`."""
    codes = _codes((4, 8) if spelling in ("transpose", "gemm") else (8, 4))
    dq, (weight,) = _node("DequantizeLinear", [codes, _scale(), _zero()], axis=1)
    tail = weight
    if spelling == "transpose":
        _, (tail,) = _node("Transpose", [tail], perm=[1, 0])
    elif spelling == "cast":
        _, (half,) = _node("Cast", [tail], to=TensorProto.FLOAT16)
        _, (tail,) = _node("Cast", [half], to=TensorProto.FLOAT)
    elif spelling == "reshape":
        _, (tail,) = _node("Reshape", [tail, gs.Constant("shape", np.array([8, 4]))])
    x = _tensor("x")
    op = "Gemm" if spelling == "gemm" else "MatMul"
    node, _ = _node(op, [x, tail], **({"transB": 1} if spelling == "gemm" else {}))
    return node, x, codes, dq


@pytest.mark.parametrize("spelling,between", [("kn", []), ("transpose", ["Transpose"]), ("gemm", []),
                                              ("cast", ["Cast", "Cast"]), ("reshape", ["Reshape"])])
def test_a_weight_the_graph_dequantizes(spelling, between):
    node, x, codes, dq = _chain(spelling)
    use = quantized_use(node, x)
    assert use.kind == quantized.DEQUANTIZED_WEIGHT and use.edit == "dequantize_linear"
    assert use.codes is codes and use.scales is dq.inputs[1] and use.zero_points is dq.inputs[2]
    assert use.weight.dequantize is dq and [n.op for n in use.weight.between] == between
    assert use.weight.quantize is None and use.weight.axis == 1 and use.weight.block_size == 0
    assert str(use.weight) == "DequantizeLinear int8 → float32"
    assert use.defer_reason() is None
    assert "dequantized in the graph (DequantizeLinear int8 → float32)" in use.describe()


def test_the_type_written_is_the_nearest_cast_where_the_tensor_has_none():
    codes = _codes()
    _, (weight,) = _node("DequantizeLinear", [codes, _scale()], axis=1)
    cast = gs.Variable("cast_out")  # no dtype recorded
    gs.Node("Cast", attrs={"to": TensorProto.FLOAT16}, inputs=[weight], outputs=[cast])
    assert dequantized_weight(cast).written == "float16"


def test_fake_quantization_is_a_float_weight_behind_q_and_dq():
    w = gs.Constant("w", np.zeros((8, 4), np.float32))
    q, (q_out,) = _node("QuantizeLinear", [w, _scale(), _zero()], axis=1)
    _, (weight,) = _node("DequantizeLinear", [q_out, _scale(), _zero()], axis=1)
    x = _tensor("x")
    node, _ = _node("MatMul", [x, weight])
    use = quantized_use(node, x)
    assert use.weight.quantize is q and use.weight.float_weight is w and use.weight.code_type == "int8"
    assert "fake quantization" in str(use.weight)


@pytest.mark.parametrize("op,kind,codes,edit", [
    ("MatMulNBits", quantized.WEIGHT, 1, "matmulnbits"),
    ("MatMulBnb4", quantized.WEIGHT, 1, None),
    ("DynamicQuantizeMatMul", quantized.DYNAMIC, 1, None),
    ("QuantizeLinear", quantized.QUANTIZE, None, None),
    ("DynamicQuantizeLinear", quantized.DYNAMIC_QUANTIZE, None, None),
    ("MatMulInteger", quantized.INTEGER, 1, None),
    ("QLinearMatMul", quantized.INTEGER, 3, None),
    ("QGemm", quantized.INTEGER, 3, None),
    ("MatMulIntegerToFloat", quantized.INTEGER, 1, None),
])
def test_ops_that_compute_with_quantized_values(op, kind, codes, edit):
    x = _tensor("x")
    inputs = [x] + [gs.Constant(f"in{i}", np.zeros(2, np.uint8)) for i in range(1, 9)]
    node, _ = _node(op, inputs, outputs=3 if op == "DynamicQuantizeLinear" else 1)
    use = quantized_use(node, x)
    assert use.kind == kind and use.edit == edit
    assert (use.codes is None) if codes is None else (use.codes is inputs[codes])
    for reason in (use.fold_reason(), use.defer_reason()):
        assert reason.startswith(f"consumer {op} '{node.name}'") and "\n" not in reason


def test_reasons_name_the_quantized_activation_and_the_route():
    x = _tensor("x")
    static, _ = _node("QuantizeLinear", [x, _scale(()), _zero(())])
    assert quantized_use(static, x).fold_reason().endswith(
        "quantizes the normalized activation with a static scale calibrated on x̂·g; folding would change the range "
        "it was calibrated for (route: fold first, then quantize)")
    dynamic, (codes, scale, zero) = _node("DynamicQuantizeLinear", [x], outputs=3)
    integer, _ = _node("MatMulInteger", [codes, gs.Constant("b", np.zeros((8, 4), np.uint8)), zero])
    reason = quantized_use(dynamic, x).fold_reason()
    assert "quantizes the normalized activation with a scale computed at run time, for MatMulInteger " \
           "'matmulinteger'" in reason and "route: fold first, then quantize" in reason
    assert "not a linear op" not in reason
    assert quantized_use(dynamic, x).defer_reason().endswith(
        "quantizes the normalized activation at run time; the plugin reads it in float (defer does not apply)")


def test_a_prescale_mul_in_front_of_a_quantized_projection():
    x = _tensor("x")
    mul, (scaled,) = _node("Mul", [x, gs.Constant("s", np.ones(8, np.float32))])
    nbits, _ = _node("MatMulNBits", [scaled, gs.Constant("b", np.zeros((4, 1, 4), np.uint8)), _scale()])
    use = quantized_use(mul, x)
    assert use.kind == quantized.PRESCALE and use.behind.node is nbits and use.edit == "prescale"
    assert use.defer_reason() == ("consumer Mul 'mul' scales the activation in front of a quantized projection: "
                                  "consumer MatMulNBits 'matmulnbits' dequantizes its weight inside the op; the plugin "
                                  "takes float weights (defer does not apply)")
    float_mul, (out,) = _node("Mul", [x, gs.Constant("s2", np.ones(8, np.float32))])
    _node("MatMul", [out, gs.Constant("w", np.zeros((8, 4), np.float32))])
    assert quantized_use(float_mul, x) is None


def test_float_consumers_are_not_quantized():
    x = _tensor("x")
    for node, _ in (_node("MatMul", [x, gs.Constant("w", np.zeros((8, 4), np.float32))]),
                    _node("Gemm", [x, gs.Constant("w2", np.zeros((4, 8), ml_dtypes.bfloat16))], transB=1),
                    _node("Add", [x, x])):
        assert quantized_use(node, x) is None


def test_op_counts():
    assert quantized.quantized_op_counts(["MatMul", "MatMulNBits", "MatMulNBits", "QGemm", "Add"]) == {
        "MatMulNBits": 2, "QGemm": 1}
