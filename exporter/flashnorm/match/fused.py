"""Norms as one node. RMSNorm: opset-23 `RMSNormalization`, ONNX Runtime's
`SimplifiedLayerNormalization` (default or com.microsoft domain) and
`SkipSimplifiedLayerNormalization` (com.microsoft; also computes the residual sum). LayerNorm:
opset-17 `LayerNormalization` and ONNX Runtime's `SkipLayerNormalization` (com.microsoft; also
computes the residual sum)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import onnx_graphsurgeon as gs

from flashnorm.match.queries import last_dim, tensor_rank
from flashnorm.match.gain import read_gain
from flashnorm.match.rejection import Rejected
from flashnorm.match.site import NormSite


@dataclasses.dataclass(frozen=True)
class FusedOp:
    """Where a one-node norm keeps its inputs."""

    kind: str
    """'rms' or 'layer'."""

    scale: int
    """Input index of the gain."""

    data: int
    """Number of data inputs before it (2: input and skip, summed inside the node)."""

    bias: Optional[int] = None
    """Input index of a LayerNorm's output bias (beta), if the op has one."""

    sum_bias: Optional[int] = None
    """Input index of the bias a Skip form adds to input + skip before normalizing."""


FUSED_OPS: dict[str, FusedOp] = {
    "RMSNormalization": FusedOp("rms", 1, 1),
    "SimplifiedLayerNormalization": FusedOp("rms", 1, 1),
    "SkipSimplifiedLayerNormalization": FusedOp("rms", 2, 2, sum_bias=3),
    "LayerNormalization": FusedOp("layer", 1, 1, bias=2),
    "SkipLayerNormalization": FusedOp("layer", 2, 2, bias=3, sum_bias=4),
}
# Outputs of a LayerNormalization beyond Y (Mean, InvStdDev): a site whose graph reads them
# cannot lose its node.
_STATISTIC_OUTPUTS = {"LayerNormalization": (1, 2), "SkipLayerNormalization": (1, 2)}


def is_candidate(node: gs.Node) -> bool:
    return node.op in FUSED_OPS


def match(node: gs.Node, graph_outputs: frozenset[str] = frozenset()) -> NormSite:
    op = FUSED_OPS[node.op]
    if len(node.inputs) <= op.scale:
        raise Rejected(f"{node.op} has no scale input")
    x = node.inputs[0]
    axis = int(node.attrs.get("axis", -1))
    if axis >= 0:
        rank = tensor_rank(x)
        if rank is None:
            raise Rejected(f"{node.op} axis {axis} with unknown input rank: cannot prove it is the last axis")
        axis -= rank
    if axis != -1:
        raise Rejected(f"{node.op} normalizes from axis {axis}, not over the last axis only")
    gain = read_gain(node.inputs[op.scale])
    if gain is None:
        raise Rejected(f"{node.op} scale is not a constant per-channel vector")
    bias = None
    if op.bias is not None and len(node.inputs) > op.bias and node.inputs[op.bias].name:
        bias = read_gain(node.inputs[op.bias])
        if bias is None:
            raise Rejected(f"{node.op} bias is not a constant per-channel vector")
    for index in _STATISTIC_OUTPUTS.get(node.op, ()):
        if len(node.outputs) > index and (node.outputs[index].outputs or node.outputs[index].name in graph_outputs):
            raise Rejected(f"{node.op} output {index} ({node.outputs[index].name!r}, a per-row statistic) is read")
    output, output_cast, nodes = node.outputs[0], None, [node]
    consumers = list(output.outputs)
    if output.name not in graph_outputs and len(consumers) == 1 and consumers[0].op == "Cast":
        nodes.append(consumers[0])
        output, output_cast = consumers[0].outputs[0], int(consumers[0].attrs["to"])
    residual = None
    if op.data > 1 and len(node.outputs) > 3 and node.outputs[3].name:
        residual = node.outputs[3]
    return NormSite(
        name=output.name,
        spelling=node.op,
        input=x,
        output=output,
        nodes=nodes,
        eps=float(node.attrs.get("epsilon", 1e-5)),
        axis=-1,
        gain=gain.value,
        gain_convention=gain.convention,
        gain_tensor=gain.tensor,
        hidden_size=last_dim(x) or int(gain.value.size),
        gain_node=node,
        gain_index=op.scale,
        gain_dtype=gain.dtype,
        data_inputs=list(node.inputs[:op.data]),
        residual_output=residual,
        output_cast=output_cast,
        kind=op.kind,
        bias=None if bias is None else bias.value,
        bias_tensor=None if bias is None else bias.tensor,
        bias_node=None if bias is None else node,
        bias_index=None if bias is None else op.bias,
        bias_dtype=None if bias is None else bias.dtype,
    )
