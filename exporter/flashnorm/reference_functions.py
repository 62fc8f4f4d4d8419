"""The reference decomposition of FlashNormMatMul<N> as model-local ONNX functions, which let
ONNX Runtime (and TensorRT without the plugin) run a deferred model: the op's definition,
kept apart from the pass that writes such nodes (`flashnorm.contract` names them).

One function per output count, named like the node's op type; onnx-graphsurgeon keeps them in
`graph.functions` and writes them with the model.
"""

from __future__ import annotations

import onnx
import onnx_graphsurgeon as gs
from onnx import helper
from onnx_graphsurgeon.importers.onnx_importer import OnnxImporter

from flashnorm import contract


def reference_function(num_outputs: int, opset: int) -> onnx.FunctionProto:
    """FlashNormMatMul<num_outputs>, attributes eps (FLOAT) and splits (INTS):
    (x·W)/sqrt(mean(x², -1) + eps) in float32, split along the last axis, each part CastLike x."""
    nodes = [
        helper.make_node("Cast", ["x"], ["x32"], to=onnx.TensorProto.FLOAT),
        helper.make_node("Cast", ["W"], ["w32"], to=onnx.TensorProto.FLOAT),
        helper.make_node("Mul", ["x32", "x32"], ["squares"]),
    ]
    if opset >= 18:
        nodes += [
            helper.make_node("Constant", [], ["last_axis"], value_ints=[-1]),
            helper.make_node("ReduceMean", ["squares", "last_axis"], ["mean_square"], keepdims=1),
        ]
    else:
        nodes.append(helper.make_node("ReduceMean", ["squares"], ["mean_square"], axes=[-1], keepdims=1))
    eps = helper.make_node("Constant", [], ["eps"])
    eps.attribute.append(_attribute_ref("value_float", "eps", onnx.AttributeProto.FLOAT))
    splits = helper.make_node("Constant", [], ["splits"])
    splits.attribute.append(_attribute_ref("value_ints", "splits", onnx.AttributeProto.INTS))
    outputs = [f"y{i}" for i in range(num_outputs)]
    nodes += [
        eps,
        helper.make_node("Add", ["mean_square", "eps"], ["variance"]),
        helper.make_node("Sqrt", ["variance"], ["rms"]),
        helper.make_node("MatMul", ["x32", "w32"], ["projected"]),
        helper.make_node("Div", ["projected", "rms"], ["scaled"]),
        splits,
        # Split in float32, then round each part: the same values as rounding before the Split,
        # but a backend that runs a part's consumer in float32 can drop that part's rounding, as
        # ONNX Runtime's CPU provider does for gate and up in the unfolded model
        # (docs/HALF_PRECISION.md).
        helper.make_node("Split", ["scaled", "splits"], [f"scaled{i}" for i in range(num_outputs)], axis=-1),
        *(helper.make_node("CastLike", [f"scaled{i}", "x"], [output]) for i, output in enumerate(outputs)),
    ]
    return helper.make_function(
        contract.DOMAIN, contract.op_type(num_outputs), ["x", "W"], outputs, nodes, [helper.make_opsetid("", opset)],
        attributes=["eps", "splits"],
        doc_string="FlashNorm deferred RMSNorm + projection, reference decomposition: "
                   "(x·W) / sqrt(mean(x², axis=-1) + eps), split by `splits` along the last axis.",
    )


def _attribute_ref(name: str, ref: str, attribute_type: int) -> onnx.AttributeProto:
    attribute = onnx.AttributeProto()
    attribute.name, attribute.ref_attr_name, attribute.type = name, ref, attribute_type
    return attribute


def add_reference_functions(graph: gs.Graph) -> gs.Graph:
    """Give `graph` the reference function of every FlashNormMatMul<N> node it has and lacks
    one for (onnx-graphsurgeon keeps them in `graph.functions` and writes them on export)."""
    if (graph.opset or 0) < contract.MIN_OPSET:
        raise ValueError(f"model opset {graph.opset} < {contract.MIN_OPSET} (the reference function needs CastLike)")
    present = {(f.domain, f.name) for f in graph.functions}
    arities = sorted({len(n.outputs) for n in graph.nodes if contract.is_deferred_node(n.op, n.domain)})
    for arity in arities:
        if (contract.DOMAIN, contract.op_type(arity)) not in present:
            graph.functions.append(OnnxImporter.import_function(reference_function(arity, graph.opset),
                                                                model_opset=graph.opset))
    if arities:
        graph.ir_version = max(graph.ir_version or 0, contract.MIN_IR_VERSION)
    return graph
