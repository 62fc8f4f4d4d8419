"""flashnorm.match.projection: how a node reads the norm output and where its weight is."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
import pytest

from flashnorm.match.projection import linear_use


class Refused(Exception):
    pass


def _weight(rows: int, columns: int) -> gs.Constant:
    return gs.Constant("w", np.zeros((rows, columns), np.float32))


def _transposed(weight: gs.Tensor, perm: list[int]) -> gs.Variable:
    out = gs.Variable("w_t", dtype=np.float32)
    gs.Node("Transpose", attrs={"perm": perm}, inputs=[weight], outputs=[out])
    return out


@pytest.mark.parametrize("trans_b, behind_transpose, stored_nk", [(0, False, False), (1, False, True),
                                                                  (0, True, True), (1, True, False)])
def test_gemm_transb_and_a_transpose_cancel_out(trans_b, behind_transpose, stored_nk):
    x = gs.Variable("x", dtype=np.float32)
    weight = _weight(4, 4)
    read = _transposed(weight, [1, 0]) if behind_transpose else weight
    node = gs.Node("Gemm", attrs={"transB": trans_b}, inputs=[x, read], outputs=[gs.Variable("y")])
    use = linear_use(node, x, "here", Refused)
    stored, transpose, transposed = use.stored_weight("here", Refused)
    assert stored is weight and (transpose is not None) == behind_transpose and transposed == stored_nk
    assert use.bias is None and use.weight is read


def test_bias_and_refusals():
    x = gs.Variable("x", dtype=np.float32)
    bias = gs.Constant("c", np.zeros(4, np.float32))
    gemm = gs.Node("Gemm", inputs=[x, _weight(4, 4), bias], outputs=[gs.Variable("y")])
    assert linear_use(gemm, x, "here", Refused).bias is bias
    right = gs.Node("MatMul", inputs=[_weight(4, 4), x], outputs=[gs.Variable("z")])
    with pytest.raises(Refused, match="left operand only"):
        linear_use(right, x, "here", Refused)
    trans_a = gs.Node("Gemm", attrs={"transA": 1}, inputs=[x, _weight(4, 4)], outputs=[gs.Variable("t")])
    with pytest.raises(Refused, match="transA=0"):
        linear_use(trans_a, x, "here", Refused)
    assert linear_use(gs.Node("Add", inputs=[x, x], outputs=[gs.Variable("s")]), x, "here", Refused) is None
    odd = gs.Node("MatMul", inputs=[x, _transposed(_weight(4, 4), [0, 1])], outputs=[gs.Variable("u")])
    with pytest.raises(Refused, match=r"perm \[0, 1\] is not \[1, 0\]"):
        linear_use(odd, x, "here", Refused).stored_weight("here", Refused)


def _matmul_add(bias_value: np.ndarray, *, bias_first: bool = False, extra_reader: bool = False):
    x = gs.Variable("x", dtype=np.float32, shape=["n", 4])
    product = gs.Variable("p", dtype=np.float32, shape=["n", 4])
    matmul = gs.Node("MatMul", inputs=[x, _weight(4, 4)], outputs=[product])
    bias = gs.Constant("c", bias_value)
    add = gs.Node("Add", inputs=[bias, product] if bias_first else [product, bias], outputs=[gs.Variable("y")])
    if extra_reader:
        gs.Node("Relu", inputs=[product], outputs=[gs.Variable("r")])
    return x, matmul, add, bias


@pytest.mark.parametrize("bias_first", [False, True])
def test_matmul_then_add_of_a_constant_vector_is_the_bias(bias_first):
    x, matmul, add, bias = _matmul_add(np.ones(4, np.float32), bias_first=bias_first)
    use = linear_use(matmul, x, "here", Refused)
    assert use.bias is bias and use.bias_add is add and use.output is add.outputs[0]


@pytest.mark.parametrize("case", ["graph output", "second reader", "rank grows", "other width"])
def test_an_add_that_is_not_the_projections_bias(case):
    value = {"rank grows": np.ones((1, 1, 4), np.float32), "other width": np.ones(3, np.float32)}.get(
        case, np.ones(4, np.float32))
    x, matmul, add, _ = _matmul_add(value, extra_reader=case == "second reader")
    outputs = frozenset({"p"}) if case == "graph output" else frozenset()
    use = linear_use(matmul, x, "here", Refused, outputs)
    assert use.bias is None and use.bias_add is None and use.output is matmul.outputs[0]


def test_post_norm_reason_names_the_residual_add():
    from flashnorm.match.projection import post_norm_reason

    x = gs.Variable("x", dtype=np.float32)
    residual = gs.Node("Add", name="residual", inputs=[x, gs.Variable("h")], outputs=[gs.Variable("s")])
    assert "post-LN" in post_norm_reason(residual) and "'residual'" in post_norm_reason(residual)
    assert post_norm_reason(gs.Node("MatMul", inputs=[x, _weight(4, 4)], outputs=[gs.Variable("y")])) is None
