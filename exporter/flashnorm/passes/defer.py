"""Defer (Proposition 2): (x/rms(x))·W* = (x·W*)·(1/rms(x)), one node per norm site.

After folding, a weightless norm whose consumers are all projections (MatMul with a constant
[K,N] weight, or the same weight behind a Transpose or Gemm transB=1; Shape readers move to
the norm's input, which has the same shape) becomes one
`flashnorm::FlashNormMatMul` node: inputs x and the consumers' weights concatenated along N,
one output per consumer. A Gemm bias stays a separate Add after the node (scale first, then
bias: exact). The node carries what TensorRT's parser needs to pick the FlashNorm plugin
(`plugin_version`, `plugin_namespace`; `eps` FLOAT and `splits` INTS become the plugin
fields eps FLOAT32 and splits INT32) and the model carries a model-local ONNX function of the
same name with the reference decomposition, so ONNX Runtime (and TensorRT without the
plugin, within the limits docs/TENSORRT.md gives) runs the same file.

Weights are not read while the pass runs: planning checks shapes and dtypes, and the
concatenated weight is an `io.DerivedValues` that `io.save` assembles while writing it, one
consumer weight at a time.

One function per output count: ONNX fixes a function's outputs, and a q|k|v node has three
while a gate|up node has two. The functions are overloads (ONNX IR 10) of one name;
onnx-graphsurgeon does not model overloads, so `add_reference_functions` writes them into the
exported ModelProto (`flashnorm.io` calls it on every save).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import helper
from onnx_graphsurgeon.ir.tensor import LazyValues

from flashnorm.io import DerivedValues
from flashnorm.match import NormSite, find_norm_sites
from flashnorm.match.constants import constant_value, numpy_dtype, stored_dtype_name, through_transpose
from flashnorm.progress import track
from flashnorm.report import PassReport

DOMAIN = "flashnorm"
OP_TYPE = "FlashNormMatMul"
PLUGIN_VERSION = "1"
PLUGIN_NAMESPACE = "flashnorm"
DOMAIN_VERSION = 1
MAX_OUTPUTS = 8  # FLASHNORM_MAX_OUTPUTS in flashnorm/flashnorm.h
MIN_OPSET = 15  # the reference function uses CastLike
MIN_IR_VERSION = 10  # function overloads

_FLOAT_NAMES = {"float16", "bfloat16", "float32"}  # the plugin's types


class NotDeferrable(Exception):
    """Why a site cannot become a FlashNormMatMul (one line)."""


@dataclasses.dataclass
class Projection:
    """One consumer of the normalized tensor, as the deferred node will compute it."""

    node: gs.Node
    weight: gs.Constant
    """The stored weight, [K, N_i] or, with `transposed`, [N_i, K]; not read by planning."""

    transposed: bool
    alpha: float
    """Gemm's alpha, multiplied into the weight (in float64, cast back)."""

    output: gs.Variable
    bias: Optional[np.ndarray] = None
    """Gemm's beta·C, added after the node; None without a bias."""

    @property
    def shape(self) -> tuple[int, int]:
        """[K, N_i]: the weight as the deferred node reads it."""
        rows, columns = (int(d) for d in self.weight.shape)
        return (columns, rows) if self.transposed else (rows, columns)

    def matrix(self, stored: np.ndarray) -> np.ndarray:
        """The [K, N_i] weight in its own dtype (transposed, alpha applied) from the stored values."""
        weight = stored.T if self.transposed else stored
        if self.alpha != 1.0:
            weight = (weight.astype(np.float64) * self.alpha).astype(stored.dtype)
        return weight


def _constant_matrix(tensor: gs.Tensor, where: str) -> tuple[gs.Constant, bool]:
    """A weight as a constant and whether it sat behind a Transpose([1, 0]). An initializer is
    returned as it is (its values stay unread); a weight computed from constants (Constant
    node, Cast, ...) is evaluated into a new in-memory constant."""
    tensor, transpose = through_transpose(tensor, where, NotDeferrable)
    transposed = transpose is not None
    if isinstance(tensor, gs.Constant):
        constant = tensor
    else:
        value = constant_value(tensor)
        if value is None:
            raise NotDeferrable(f"{where}: weight {tensor.name!r} is not a constant")
        constant = gs.Constant(tensor.name, value)
    rank = len(constant.shape)
    if rank != 2:
        raise NotDeferrable(f"{where}: weight {tensor.name!r} has rank {rank}, not 2")
    dtype = stored_dtype_name(constant)
    if dtype not in _FLOAT_NAMES:
        raise NotDeferrable(f"{where}: weight {tensor.name!r} has dtype {dtype} (quantized or integer)")
    return constant, transposed


def _projection(site: NormSite, node: gs.Node, dtype: str, hidden: Optional[int]) -> Projection:
    where = f"consumer {node.op} {node.name!r}"
    bias = None
    if node.op == "MatMul":
        if node.inputs[0] is not site.output or node.inputs[1] is site.output:
            raise NotDeferrable(f"{where} does not read the normalized tensor as its left operand only")
        weight, transposed = _constant_matrix(node.inputs[1], where)
        alpha = 1.0
    elif node.op == "Gemm":
        if node.inputs[0] is not site.output or int(node.attrs.get("transA", 0)) != 0:
            raise NotDeferrable(f"{where} does not read the normalized tensor as A (transA=0)")
        if node.inputs[1] is site.output or (len(node.inputs) > 2 and node.inputs[2] is site.output):
            raise NotDeferrable(f"{where} reads the normalized tensor as B or C")
        weight, transposed = _constant_matrix(node.inputs[1], where)
        transposed = transposed != (int(node.attrs.get("transB", 0)) == 1)
        alpha = float(node.attrs.get("alpha", 1.0))
        if len(node.inputs) > 2 and node.inputs[2].name:
            c = constant_value(node.inputs[2])
            if c is None:
                raise NotDeferrable(f"{where}: bias {node.inputs[2].name!r} is not a constant")
            beta = float(node.attrs.get("beta", 1.0))
            bias = c if beta == 1.0 else (c.astype(np.float64) * beta).astype(c.dtype)
    else:
        raise NotDeferrable(f"{where} is not a projection (MatMul or Gemm with a constant weight)")
    if stored_dtype_name(weight) != dtype:
        raise NotDeferrable(f"{where}: weight dtype {stored_dtype_name(weight)} differs from the activation's {dtype}")
    projection = Projection(node, weight, transposed, alpha, node.outputs[0], bias)
    if hidden is not None and projection.shape[0] != hidden:
        raise NotDeferrable(f"{where}: weight has {projection.shape[0]} rows, the norm has {hidden} channels")
    output = node.outputs[0]
    if output.dtype is not None and stored_dtype_name(output) != dtype:
        raise NotDeferrable(f"{where}: output dtype {stored_dtype_name(output)} differs from the activation's {dtype}")
    return projection


def _hidden_size(site: NormSite) -> Optional[int]:
    if site.hidden_size:
        return int(site.hidden_size)
    shape = getattr(site.input, "shape", None)
    if shape and isinstance(shape[-1], (int, np.integer)) and int(shape[-1]) > 0:
        return int(shape[-1])
    return None


@dataclasses.dataclass
class DeferPlan:
    projections: list[Projection]
    shape_readers: list[gs.Node]
    """Shape nodes that read the normalized tensor; they will read the norm's input."""


def plan_defer(site: NormSite, graph_outputs: frozenset[str]) -> DeferPlan:
    """The projections one FlashNormMatMul replaces, or NotDeferrable with the reason.
    Mutates nothing."""
    if site.spelling == "SkipSimplifiedLayerNormalization":
        raise NotDeferrable("the norm's input is a residual sum computed inside the fused Skip node")
    if not site.is_weightless:
        raise NotDeferrable("the norm has a gain (run fold first)")
    if site.axis != -1:
        raise NotDeferrable(f"normalized axis {site.axis} is not the last")
    if site.output.name in graph_outputs:
        raise NotDeferrable("the normalized tensor is a graph output")
    dtype = stored_dtype_name(site.input) or stored_dtype_name(site.output)
    if not dtype:
        raise NotDeferrable("the activation dtype is unknown (run shape inference)")
    if dtype not in _FLOAT_NAMES:
        raise NotDeferrable(f"activation dtype {dtype} is not float32, float16 or bfloat16")
    if site.output.dtype is not None and stored_dtype_name(site.output) != dtype:
        raise NotDeferrable(f"the norm changes dtype ({dtype} → {stored_dtype_name(site.output)})")
    shape_readers = [n for n in site.consumers if _reads_only_shape(site, n)]
    consumers = [n for n in site.consumers if n not in shape_readers]
    if not consumers:
        raise NotDeferrable("the normalized tensor has no consumers that read its values")
    if shape_readers and not _keeps_shape(site):
        raise NotDeferrable("a Shape node reads the normalized tensor and the gain may broadcast it to another shape")
    if len(consumers) > MAX_OUTPUTS:
        raise NotDeferrable(f"{len(consumers)} consumers; the plugin takes at most {MAX_OUTPUTS}")
    hidden = _hidden_size(site)
    projections = [_projection(site, node, dtype, hidden) for node in consumers]
    if len({p.shape[0] for p in projections}) != 1:
        raise NotDeferrable("the consumers' weights disagree on K")
    return DeferPlan(projections, shape_readers)


def _reads_only_shape(site: NormSite, node: gs.Node) -> bool:
    """Shape (exporters read batch and sequence length off the normalized tensor) needs no
    values: it can read the norm's input instead, which has the same shape."""
    return node.op == "Shape" and node.inputs[0] is site.output


def _keeps_shape(site: NormSite) -> bool:
    """The normalized tensor has the input's shape: a gain of rank ≤ 1 cannot broadcast x."""
    gain = site.gain_tensor
    if gain is None or len(getattr(gain, "shape", None) or ()) <= 1:
        return True
    shape_in, shape_out = getattr(site.input, "shape", None), getattr(site.output, "shape", None)
    return shape_in is not None and shape_out is not None and len(shape_in) == len(shape_out)


def apply_defer(graph: gs.Graph, site: NormSite, plan: DeferPlan) -> gs.Node:
    """Replace the projections by one FlashNormMatMul reading the norm's input; the norm's own
    nodes become dead and go at the next cleanup."""
    for reader in plan.shape_readers:
        reader.inputs[0] = site.input
    projections = plan.projections
    weight_constant = gs.Constant(f"{site.name}.flashnorm_deferred_weight", _concatenated(projections))
    outputs, bias_nodes = [], []
    for p in projections:
        p.node.outputs.clear()  # the consumer's output tensor is now written by the new node
        if p.bias is None:
            outputs.append(p.output)
            continue
        unbiased = gs.Variable(f"{p.output.name}.flashnorm_unbiased", dtype=p.output.dtype, shape=p.output.shape)
        outputs.append(unbiased)
        bias = gs.Constant(f"{p.output.name}.flashnorm_bias", p.bias)
        bias_nodes.append(gs.Node("Add", name=f"{p.output.name}.flashnorm_bias_add",
                                  inputs=[unbiased, bias], outputs=[p.output]))
    node = gs.Node(
        OP_TYPE,
        name=f"{site.name}.flashnorm_matmul",
        domain=DOMAIN,
        attrs={
            "plugin_version": PLUGIN_VERSION,
            "plugin_namespace": PLUGIN_NAMESPACE,
            "eps": float(site.eps),
            "splits": [p.shape[1] for p in projections],
        },
        inputs=[site.input, weight_constant],
        outputs=outputs,
    )
    graph.nodes.append(node)
    graph.nodes.extend(bias_nodes)
    return node


def _concatenated(projections: list[Projection]) -> DerivedValues:
    """The projections' [K, N_i] weights side by side, [K, ΣN_i], computed when saved or read:
    each weight is read and copied into its columns in turn, so assembling it holds the
    result and one consumer weight, never all of them twice."""
    first = projections[0]
    # Each weight's values object as it is now, as DerivedValues keeps its own source's.
    sources = [p.weight._values for p in projections]
    widths = [p.shape[1] for p in projections]
    rows, columns = first.shape[0], sum(widths)
    dtype = numpy_dtype(first.weight.dtype)  # planning checked that every weight has the activation's dtype

    def assemble(first_values: np.ndarray) -> np.ndarray:
        result = np.empty((rows, columns), dtype=dtype)
        start = 0
        for i, (projection, width) in enumerate(zip(projections, widths)):
            stored = first_values if i == 0 else _read(sources[i])
            result[:, start:start + width] = projection.matrix(stored)
            start += width
        return result

    return DerivedValues(first.weight, assemble, shape=(rows, columns), dtype=dtype)


def _read(values: object) -> np.ndarray:
    """A constant's values, read from disk if they are lazy (without caching them on the constant)."""
    return values.load() if isinstance(values, LazyValues) else np.asarray(values)


def defer(graph: gs.Graph) -> tuple[gs.Graph, PassReport]:
    """Turn every deferrable weightless norm and its projections into one FlashNormMatMul."""
    report = PassReport("defer")
    sites = find_norm_sites(graph)
    opset = graph.opset or 0
    if opset < MIN_OPSET:
        for site in sites:
            report.add(site.name, "skipped", f"model opset {opset} < {MIN_OPSET} (the reference function needs CastLike)")
        return graph, report
    graph_outputs = frozenset(t.name for t in graph.outputs)
    for site in track(sites, "defer", total=len(sites)):
        try:
            plan = plan_defer(site, graph_outputs)
        except NotDeferrable as exc:
            report.add(site.name, "skipped", str(exc))
            continue
        node = apply_defer(graph, site, plan)
        report.add(site.name, "deferred", "", node=node.name, eps=float(site.eps), splits=node.attrs["splits"],
                   consumers=[f"{p.node.op} {p.node.name}" for p in plan.projections],
                   biases=sum(p.bias is not None for p in plan.projections),
                   shape_readers=len(plan.shape_readers))
    if report.count("deferred"):
        graph.ir_version = max(graph.ir_version or 0, MIN_IR_VERSION)
    graph.cleanup().toposort()
    return graph, report


# --------------------------------------------------------------------------------------------
# The reference decomposition, as model-local ONNX functions


def overload_name(num_outputs: int) -> str:
    return f"outputs{num_outputs}"


def reference_function(num_outputs: int, opset: int) -> onnx.FunctionProto:
    """FlashNormMatMul with `num_outputs` outputs, attributes eps (FLOAT) and splits (INTS):
    y = CastLike((x·W)/sqrt(mean(x², -1) + eps) in float32, x), split along the last axis."""
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
        helper.make_node("CastLike", ["scaled", "x"], ["y"]),
        splits,
        helper.make_node("Split", ["y", "splits"], outputs, axis=-1),
    ]
    function = helper.make_function(
        DOMAIN, OP_TYPE, ["x", "W"], outputs, nodes, [helper.make_opsetid("", opset)], attributes=["eps", "splits"],
        doc_string="FlashNorm deferred RMSNorm + projection, reference decomposition: "
                   "(x·W) / sqrt(mean(x², axis=-1) + eps), split by `splits` along the last axis.",
    )
    function.overload = overload_name(num_outputs)
    return function


def _attribute_ref(name: str, ref: str, attribute_type: int) -> onnx.AttributeProto:
    attribute = onnx.AttributeProto()
    attribute.name, attribute.ref_attr_name, attribute.type = name, ref, attribute_type
    return attribute


def add_reference_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    """Give every FlashNormMatMul node of `model` its overload and the model the matching
    reference functions and opset import. Idempotent; a model without such nodes is left as
    it is."""
    arities = set()
    for node in model.graph.node:
        if node.op_type == OP_TYPE and node.domain == DOMAIN:
            node.overload = overload_name(len(node.output))
            arities.add(len(node.output))
    if not arities:
        return model
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset is None:
        raise ValueError("model has no default-domain opset import")
    kept = [f for f in model.functions if not (f.domain == DOMAIN and f.name == OP_TYPE)]
    del model.functions[:]
    model.functions.extend(kept)
    model.functions.extend(reference_function(n, opset) for n in sorted(arities))
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, DOMAIN_VERSION))
    model.ir_version = max(model.ir_version, MIN_IR_VERSION)
    return model
