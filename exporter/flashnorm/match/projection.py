"""How a node consumes a norm's output, and where its weight and bias are: the one answer fold,
cancel and defer share. Each pass keeps only its own refusal rules (fold: a constant float weight
no one else reads; cancel: no bias on the path; defer: a [K, N] weight of the activation's dtype).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import onnx_graphsurgeon as gs

from flashnorm.match.queries import constant_value, last_dim, tensor_rank, through_transpose

# Ops that read the normalized tensor as the left operand of x·W.
LINEAR_OPS = frozenset({"MatMul", "Gemm"})
# Ops that add the normalized tensor to another tensor: in a post-LN block, the residual stream.
_SUM_OPS = frozenset({"Add", "Sum", "SkipLayerNormalization", "SkipSimplifiedLayerNormalization"})


@dataclasses.dataclass(frozen=True)
class LinearUse:
    """A MatMul or Gemm reading the normalized tensor as its left operand A (transA=0)."""

    node: gs.Node
    weight: gs.Tensor
    """What the node reads as its weight (input 1)."""

    trans_b: bool
    """Gemm transB=1: the node reads its weight as [N, K]."""

    bias: Optional[gs.Tensor]
    """The consumer's bias c: Gemm's C, or the constant a MatMul's only reader (`bias_add`) adds."""

    weight_index: int = 1

    bias_add: Optional[gs.Node] = None
    """The Add of a constant per-column vector right after a MatMul, which writes the consumer's
    output; None for a Gemm (C is its input 2) and for a MatMul without a bias."""

    @property
    def output(self) -> gs.Tensor:
        """The consumer's output: x·W, plus the bias where `bias_add` adds it."""
        return (self.bias_add or self.node).outputs[0]

    def stored_weight(self, where: str, error: type[Exception]) -> tuple[gs.Tensor, Optional[gs.Node], bool]:
        """(the tensor that stores the weight, the Transpose([1, 0]) in between or None, whether
        that tensor is [N, K] rather than [K, N]). Another perm raises `error` with the reason."""
        stored, transpose = through_transpose(self.weight, where, error)
        return stored, transpose, (transpose is not None) != self.trans_b


def linear_use(node: gs.Node, tensor: gs.Tensor, where: str, error: type[Exception],
               graph_outputs: frozenset[str] = frozenset()) -> Optional[LinearUse]:
    """How `node` reads `tensor` as x in x·W: None when `node` is no MatMul or Gemm; `error`
    with the reason when it reads `tensor` other than as its left operand only, or with transA=1.
    `graph_outputs` names the graph's outputs: a MatMul output the user reads takes no bias."""
    if node.op not in LINEAR_OPS:
        return None
    if node.inputs[0] is not tensor or any(t is tensor for t in node.inputs[1:]):
        raise error(f"{where} does not read the normalized tensor as its left operand only")
    if node.op == "Gemm" and int(node.attrs.get("transA", 0)) != 0:
        raise error(f"{where} does not read the normalized tensor as A (transA=0)")
    trans_b = node.op == "Gemm" and int(node.attrs.get("transB", 0)) == 1
    if node.op == "Gemm":
        bias = node.inputs[2] if len(node.inputs) > 2 and node.inputs[2].name else None
        return LinearUse(node, node.inputs[1], trans_b, bias)
    add = _bias_add(node, graph_outputs)
    return LinearUse(node, node.inputs[1], trans_b, None if add is None else _other(add, node.outputs[0]), bias_add=add)


def _bias_add(matmul: gs.Node, graph_outputs: frozenset[str]) -> Optional[gs.Node]:
    """The Add that is the only reader of `matmul`'s output and adds a constant vector along its
    last axis (shape [N], or [1, ..., 1, N] of no higher rank than the output), else None."""
    product = matmul.outputs[0]
    readers = list(product.outputs)
    if product.name in graph_outputs or len(readers) != 1 or readers[0].op != "Add" or len(readers[0].inputs) != 2:
        return None
    add = readers[0]
    value = constant_value(_other(add, product))
    if value is None or value.ndim == 0 or any(d != 1 for d in value.shape[:-1]):
        return None
    if value.ndim > 1 and value.ndim > (tensor_rank(product) or tensor_rank(matmul.inputs[0]) or 0):
        return None  # it would broadcast the output to a higher rank
    columns = last_dim(matmul.inputs[1])
    if columns is not None and value.shape[-1] not in (1, columns):
        return None
    return add


def _other(node: gs.Node, tensor: gs.Tensor) -> gs.Tensor:
    return node.inputs[1] if node.inputs[0] is tensor else node.inputs[0]


def post_norm_reason(node: gs.Node) -> Optional[str]:
    """Why a LayerNorm read by `node` cannot lose its output, or None: `node` adds the normalized
    tensor to another (the residual stream of a post-LN block: BERT, RoBERTa, MiniLM), so the
    normalized tensor itself, gain and bias included, is needed there."""
    if node.op in _SUM_OPS:
        return f"post-LN: the normalized tensor is also the residual stream (feeds {node.op} {node.name!r})"
    return None
