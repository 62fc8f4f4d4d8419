"""The reference decomposition of FlashNormMatMul<N> as model-local ONNX functions, which let
ONNX Runtime (and TensorRT without the plugin) run a deferred model: the op's definition,
kept apart from the pass that writes such nodes (`flashnorm.contract` names them).

One function per output count, named like the node's op type; onnx-graphsurgeon keeps them in
`graph.functions` and writes them with the model.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import helper
from onnx_graphsurgeon.importers.onnx_importer import OnnxImporter

from flashnorm import contract


def reference_function(num_outputs: int, opset: int) -> onnx.FunctionProto:
    """FlashNormMatMul<num_outputs>(x, W, bias), attributes eps (FLOAT), splits (INTS) and
    statistic (INT, `contract.STATISTIC_*`), in float32: c = x − statistic·mean(x, -1) (x itself
    for the RMS), y = (x·W)/sqrt(mean(c², -1) + eps) + bias, split along the last axis, each part
    CastLike x. One body for both statistics: W of a LayerNorm is centred (1ᵀW = 0), so x·W
    needs no mean."""
    def reduce_mean(source: str, output: str) -> onnx.NodeProto:
        if opset >= 18:
            return helper.make_node("ReduceMean", [source, "last_axis"], [output], keepdims=1)
        return helper.make_node("ReduceMean", [source], [output], axes=[-1], keepdims=1)

    nodes = [
        helper.make_node("Cast", ["x"], ["x32"], to=onnx.TensorProto.FLOAT),
        helper.make_node("Cast", ["W"], ["w32"], to=onnx.TensorProto.FLOAT),
        helper.make_node("Cast", ["bias"], ["bias32"], to=onnx.TensorProto.FLOAT),
    ]
    if opset >= 18:
        nodes.append(helper.make_node("Constant", [], ["last_axis"], value_ints=[-1]))
    statistic = helper.make_node("Constant", [], ["statistic"])
    statistic.attribute.append(_attribute_ref("value_int", "statistic", onnx.AttributeProto.INT))
    eps = helper.make_node("Constant", [], ["eps"])
    eps.attribute.append(_attribute_ref("value_float", "eps", onnx.AttributeProto.FLOAT))
    splits = helper.make_node("Constant", [], ["splits"])
    splits.attribute.append(_attribute_ref("value_ints", "splits", onnx.AttributeProto.INTS))
    outputs = [f"y{i}" for i in range(num_outputs)]
    nodes += [
        statistic,
        helper.make_node("Cast", ["statistic"], ["subtracts_mean"], to=onnx.TensorProto.FLOAT),
        reduce_mean("x32", "mean"),
        helper.make_node("Mul", ["subtracts_mean", "mean"], ["subtracted"]),
        helper.make_node("Sub", ["x32", "subtracted"], ["centred"]),
        helper.make_node("Mul", ["centred", "centred"], ["squares"]),
        reduce_mean("squares", "mean_square"),
        eps,
        helper.make_node("Add", ["mean_square", "eps"], ["variance"]),
        helper.make_node("Sqrt", ["variance"], ["deviation"]),
        helper.make_node("MatMul", ["x32", "w32"], ["projected"]),
        helper.make_node("Div", ["projected", "deviation"], ["scaled"]),
        helper.make_node("Add", ["scaled", "bias32"], ["biased"]),
        splits,
        # Split in float32, then round each part: the same values as rounding before the Split,
        # but a backend that runs a part's consumer in float32 can drop that part's rounding, as
        # ONNX Runtime's CPU provider does for gate and up in the unfolded model
        # (docs/HALF_PRECISION.md).
        helper.make_node("Split", ["biased", "splits"], [f"biased{i}" for i in range(num_outputs)], axis=-1),
        *(helper.make_node("CastLike", [f"biased{i}", "x"], [output]) for i, output in enumerate(outputs)),
    ]
    return helper.make_function(
        contract.DOMAIN, contract.op_type(num_outputs), ["x", "W", "bias"], outputs, nodes,
        [helper.make_opsetid("", opset)], attributes=["eps", "splits", "statistic"],
        doc_string="FlashNorm deferred RMSNorm or LayerNorm + projection, reference decomposition: "
                   "c = x − statistic·mean(x, axis=-1); (x·W) / sqrt(mean(c², axis=-1) + eps) + bias, "
                   "split by `splits` along the last axis.",
    )


def _attribute_ref(name: str, ref: str, attribute_type: int) -> onnx.AttributeProto:
    attribute = onnx.AttributeProto()
    attribute.name, attribute.ref_attr_name, attribute.type = name, ref, attribute_type
    return attribute


def add_reference_functions(graph: gs.Graph) -> gs.Graph:
    """Give `graph` the reference function of every FlashNormMatMul<N> node it has and lacks
    one for (onnx-graphsurgeon keeps them in `graph.functions` and writes them on export). Where
    a file written before the bias input (two-input nodes and functions) gains three-input nodes
    of the same name, its old nodes get a bias of zeros and the RMS statistic, and the name the
    three-input function: TensorRT's parser finds a function by name alone."""
    if (graph.opset or 0) < contract.MIN_OPSET:
        raise ValueError(f"model opset {graph.opset} < {contract.MIN_OPSET} (the reference function needs CastLike)")
    present = {(f.domain, f.name): f for f in graph.functions}
    deferred = [n for n in graph.nodes if contract.is_deferred_node(n.op, n.domain)]
    for arity in sorted({len(n.outputs) for n in deferred}):
        nodes = [n for n in deferred if len(n.outputs) == arity]
        function = present.get((contract.DOMAIN, contract.op_type(arity)))
        if function is not None and len(function.inputs) < 3 and any(len(n.inputs) == 3 for n in nodes):
            _add_bias_inputs(nodes)
            graph.functions.remove(function)
            function = None
        if function is None:
            graph.functions.append(OnnxImporter.import_function(reference_function(arity, graph.opset),
                                                                model_opset=graph.opset))
    if deferred:
        graph.ir_version = max(graph.ir_version or 0, contract.MIN_IR_VERSION)
    return graph


def _add_bias_inputs(nodes: list[gs.Node]) -> None:
    """Two-input nodes (written before the bias input) as three-input ones computing the same."""
    for node in nodes:
        if len(node.inputs) == 2:
            columns = sum(int(n) for n in node.attrs["splits"])
            node.inputs.append(gs.Constant(f"{node.name}.flashnorm_zero_bias", np.zeros(columns, contract.BIAS_DTYPE)))
            node.attrs.setdefault("statistic", contract.STATISTIC_RMS)
