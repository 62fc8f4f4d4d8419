"""How a node consumes a norm's output, and where its weight is: the one answer fold, cancel
and defer share. Each pass keeps only its own refusal rules (fold: a constant float weight no
one else reads; cancel: no bias on the path; defer: a [K, N] weight of the activation's dtype).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import onnx_graphsurgeon as gs

from flashnorm.match.queries import through_transpose

# Ops that read the normalized tensor as the left operand of x·W.
LINEAR_OPS = frozenset({"MatMul", "Gemm"})


@dataclasses.dataclass(frozen=True)
class LinearUse:
    """A MatMul or Gemm reading the normalized tensor as its left operand A (transA=0)."""

    node: gs.Node
    weight: gs.Tensor
    """What the node reads as its weight (input 1)."""

    trans_b: bool
    """Gemm transB=1: the node reads its weight as [N, K]."""

    bias: Optional[gs.Tensor]
    """Gemm's C, when given."""

    weight_index: int = 1

    def stored_weight(self, where: str, error: type[Exception]) -> tuple[gs.Tensor, Optional[gs.Node], bool]:
        """(the tensor that stores the weight, the Transpose([1, 0]) in between or None, whether
        that tensor is [N, K] rather than [K, N]). Another perm raises `error` with the reason."""
        stored, transpose = through_transpose(self.weight, where, error)
        return stored, transpose, (transpose is not None) != self.trans_b


def linear_use(node: gs.Node, tensor: gs.Tensor, where: str, error: type[Exception]) -> Optional[LinearUse]:
    """How `node` reads `tensor` as x in x·W: None when `node` is no MatMul or Gemm; `error`
    with the reason when it reads `tensor` other than as its left operand only, or with transA=1."""
    if node.op not in LINEAR_OPS:
        return None
    if node.inputs[0] is not tensor or any(t is tensor for t in node.inputs[1:]):
        raise error(f"{where} does not read the normalized tensor as its left operand only")
    if node.op == "Gemm" and int(node.attrs.get("transA", 0)) != 0:
        raise error(f"{where} does not read the normalized tensor as A (transA=0)")
    trans_b = node.op == "Gemm" and int(node.attrs.get("transB", 0)) == 1
    bias = node.inputs[2] if node.op == "Gemm" and len(node.inputs) > 2 and node.inputs[2].name else None
    return LinearUse(node, node.inputs[1], trans_b, bias)
