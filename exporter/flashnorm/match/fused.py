"""RMSNorm as one node: opset-23 `RMSNormalization`, ONNX Runtime's
`SimplifiedLayerNormalization` (default or com.microsoft domain) and
`SkipSimplifiedLayerNormalization` (com.microsoft; also computes the residual sum)."""

from __future__ import annotations

import onnx_graphsurgeon as gs

from flashnorm.match.queries import last_dim, tensor_rank
from flashnorm.match.gain import read_gain
from flashnorm.match.rejection import Rejected
from flashnorm.match.site import NormSite

# op type → (input index of the scale, number of data inputs before it)
FUSED_OPS: dict[str, tuple[int, int]] = {
    "RMSNormalization": (1, 1),
    "SimplifiedLayerNormalization": (1, 1),
    "SkipSimplifiedLayerNormalization": (2, 2),
}


def is_candidate(node: gs.Node) -> bool:
    return node.op in FUSED_OPS


def match(node: gs.Node, graph_outputs: frozenset[str] = frozenset()) -> NormSite:
    scale_index, data_count = FUSED_OPS[node.op]
    if len(node.inputs) <= scale_index:
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
    gain = read_gain(node.inputs[scale_index])
    if gain is None:
        raise Rejected(f"{node.op} scale is not a constant per-channel vector")
    output, output_cast, nodes = node.outputs[0], None, [node]
    consumers = list(output.outputs)
    if output.name not in graph_outputs and len(consumers) == 1 and consumers[0].op == "Cast":
        nodes.append(consumers[0])
        output, output_cast = consumers[0].outputs[0], int(consumers[0].attrs["to"])
    residual = None
    if node.op == "SkipSimplifiedLayerNormalization" and len(node.outputs) > 3 and node.outputs[3].name:
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
        gain_index=scale_index,
        gain_dtype=gain.dtype,
        data_inputs=list(node.inputs[:data_count]),
        residual_output=residual,
        output_cast=output_cast,
    )
