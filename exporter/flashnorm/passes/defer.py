"""Defer (Proposition 2): (x/rms(x))·W* = (x·W*)·(1/rms(x)), one node per norm site; for a
LayerNorm, (x − μ)/σ·W_c + c* = (x·W_c)·(1/σ) + c* since the fold centred W_c (1ᵀW_c = 0).

After folding, a weightless norm whose consumers are all projections (MatMul with a constant
[K,N] weight, or the same weight behind a Transpose or Gemm transB=1; Shape readers move to
the norm's input, which has the same shape) becomes one
`flashnorm::FlashNormMatMul<N>` node: inputs x, the consumers' weights concatenated along N and
their biases (a Gemm's beta·C, the constant [N] vector a MatMul's Add adds: float32 [ΣN], zeros
where a consumer has none; scale first, then bias: exact), one output per consumer. The node's
`statistic` says what the row scale divides by: the RMS, or for a LayerNorm the standard
deviation, whose weight is re-centred in float64 as it is written (a no-op after fold's
centring, up to one rounding; what makes the node exact whatever produced the weights).
A weight the graph dequantizes to the activation's type
(DequantizeLinear, then Cast or Identity) stays quantized in the file: the node reads the
dequantized tensor, through a Transpose and a Concat in the graph where the layout needs them
(RMSNorm only: such a weight cannot be centred). The node carries what TensorRT's parser needs
to pick the FlashNorm plugin (`plugin_version`, `plugin_namespace`; `eps` FLOAT, `splits` INTS,
`strategy` INT and `statistic` INT become the plugin fields of `contract.PLUGIN_FIELDS`) and the
model carries a model-local ONNX function of the same name with the reference decomposition, so
ONNX Runtime (and TensorRT without the plugin, within the limits docs/TENSORRT.md gives) runs
the same file. A model at opset 13 or 14 (torch.onnx's decomposed LayerNorm) is raised to
opset 15 for the function's CastLike: no operator it holds changed meaning between them.

Weights are not read while the pass runs: planning checks shapes and dtypes, and the
concatenated weight is a `DerivedValues` that `flashnorm.modelio.saving` assembles while
writing it, one consumer weight at a time.

One op type per output count (`FlashNormMatMul3` for q|k|v, `FlashNormMatMul2` for gate|up;
flashnorm.contract says why), each with its function (`flashnorm.reference_functions`) in the
graph's model-local functions.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import onnx_graphsurgeon as gs
from onnx import TensorProto
from onnx_graphsurgeon.ir.tensor import LazyValues

from flashnorm import contract
from flashnorm.match import NormSite, find_norm_sites
from flashnorm.match.projection import LinearUse, linear_use, post_norm_reason
from flashnorm.match.quantized import DequantizedWeight, dequantized_weight, quantized_use
from flashnorm.match.queries import constant_value, numpy_dtype, producer, stored_dtype_name
from flashnorm.modelio.values import DerivedValues, stored_values
from flashnorm.progress import track
from flashnorm.reference_functions import add_reference_functions
from flashnorm.report import PassReport
from flashnorm.rounding import round_centred

class NotDeferrable(Exception):
    """Why a site cannot become a FlashNormMatMul (one line)."""


class GainKept(NotDeferrable):
    """The norm still has its gain: defer needs fold to have taken it."""


@dataclasses.dataclass
class Projection:
    """One consumer of the normalized tensor, as the deferred node will compute it."""

    node: gs.Node
    weight: gs.Tensor
    """The stored weight, [K, N_i] or, with `transposed`, [N_i, K]: a constant (not read by
    planning) or, with `dequantized`, the tensor the graph's DequantizeLinear chain writes."""

    transposed: bool
    alpha: float
    """Gemm's alpha, multiplied into the weight (in float64, cast back); 1 for a dequantized weight."""

    output: gs.Variable
    bias: Optional[np.ndarray] = None
    """The consumer's bias per output column, float64 [N_i] (Gemm's beta·C, or the constant a
    MatMul's Add adds), added by the node after its row scale; None without a bias."""

    dequantized: Optional[DequantizedWeight] = None
    """How the graph dequantizes the weight (DequantizeLinear, then Cast or Identity); None for a constant."""

    bias_node: Optional[gs.Node] = None
    """The Add that adds a MatMul's bias and writes `output`; the node takes its place."""

    @property
    def shape(self) -> tuple[int, int]:
        """[K, N_i]: the weight as the deferred node reads it."""
        stored = self.dequantized.codes if self.dequantized else self.weight
        rows, columns = (int(d) for d in stored.shape)
        return (columns, rows) if self.transposed else (rows, columns)

    def matrix(self, stored: np.ndarray) -> np.ndarray:
        """The [K, N_i] weight in its own dtype (transposed, alpha applied) from the stored values."""
        weight = stored.T if self.transposed else stored
        if self.alpha != 1.0:
            weight = (weight.astype(np.float64) * self.alpha).astype(stored.dtype)
        return weight

    def centred_matrix(self, stored: np.ndarray) -> np.ndarray:
        """`matrix`, each column minus its mean over K, computed in float64 and rounded once (in
        half precision with the columns' rounded sums kept at zero: `flashnorm.rounding`; a no-op
        on a weight the fold centred so)."""
        weight = (stored.T if self.transposed else stored).astype(np.float64) * self.alpha
        return round_centred(weight, 0, stored.dtype)


def _stored_matrix(use: LinearUse, where: str) -> tuple[gs.Tensor, bool, Optional[DequantizedWeight]]:
    """A weight, whether it is stored [N, K], and how the graph dequantizes it: a weight the
    graph dequantizes is returned as the tensor its chain writes; an initializer as it is (its
    values stay unread); a weight computed otherwise from constants (Constant node, Cast, ...)
    is evaluated into a new in-memory constant."""
    tensor, _, transposed = use.stored_weight(where, NotDeferrable)
    dequantized = dequantized_weight(tensor)
    if dequantized is not None:
        _check_readable(dequantized, where)
        return tensor, transposed, dequantized
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
    if dtype not in contract.FLOAT_TYPES:
        raise NotDeferrable(f"{where}: weight {tensor.name!r} has dtype {dtype} (quantized or integer)")
    return constant, transposed, None


def _check_readable(weight: DequantizedWeight, where: str) -> None:
    """The node reads a dequantized weight as the graph writes it: stored 2-D codes, then at most
    a change of type (Cast, Identity) before the projection's own Transpose; other chains say why."""
    name = weight.tensor.name
    if weight.op.domain:
        raise NotDeferrable(f"{where}: weight {name!r} is dequantized by {weight.dequantize.op} ({weight.op.domain} "
                            "domain); defer reads weights ONNX's own dequantizer writes")
    if weight.quantize is not None:
        raise NotDeferrable(f"{where}: weight {name!r} is quantized at run time ({weight}); defer reads weights "
                            "whose codes are stored")
    others = [n.op for n in weight.between if n.op not in ("Cast", "Identity")]
    if others:
        raise NotDeferrable(f"{where}: weight {name!r} is dequantized in the graph ({weight}) through "
                            f"{', '.join(others)}; defer reads one dequantized through Cast or Identity only")
    if not isinstance(weight.codes, gs.Constant):
        raise NotDeferrable(f"{where}: weight {name!r} is dequantized in the graph ({weight}) from codes that are "
                            "not stored")
    rank = len(weight.codes.shape or ())
    if rank != 2:
        raise NotDeferrable(f"{where}: dequantized weight {name!r} has rank {rank}, not 2")


def _quantized_consumer(node: gs.Node, tensor: gs.Tensor) -> Optional[str]:
    """Why `node`, reading `tensor`, keeps the site from deferring because it computes with
    quantized values (the recogniser's reason), or None. The plugin takes float activations and
    float weights, so no fold changes this: plan_defer asks it first, and inspect names the
    quantized sites as such rather than "run fold first" where fold left the gain. A weight the
    graph dequantizes is a float tensor the node can read (_projection)."""
    use = quantized_use(node, tensor)
    return use.defer_reason() if use is not None else None


def _projection(site: NormSite, node: gs.Node, dtype: str, graph_outputs: frozenset[str]) -> Projection:
    where = f"consumer {node.op} {node.name!r}"
    use = linear_use(node, site.output, where, NotDeferrable, graph_outputs)
    if use is None:
        raise NotDeferrable(f"{where} is not a projection (MatMul or Gemm with a constant weight)")
    weight, transposed, dequantized = _stored_matrix(use, where)
    if dequantized and site.kind == "layer":
        raise NotDeferrable(f"{where}: weight {weight.name!r} is dequantized in the graph ({dequantized}); a "
                            "LayerNorm's deferred weight must be centred, which a quantized weight cannot be")
    alpha = float(node.attrs.get("alpha", 1.0)) if node.op == "Gemm" else 1.0
    if dequantized and alpha != 1.0:
        raise NotDeferrable(f"{where}: Gemm alpha {alpha:g} on a weight dequantized in the graph ({dequantized})")
    weight_dtype = dequantized.written if dequantized else stored_dtype_name(weight)
    if weight_dtype != dtype:
        raise NotDeferrable(f"{where}: weight dtype {weight_dtype} differs from the activation's {dtype}")
    projection = Projection(node, weight, transposed, alpha, use.output, None, dequantized, use.bias_add)
    if site.hidden_size and projection.shape[0] != site.hidden_size:
        raise NotDeferrable(f"{where}: weight has {projection.shape[0]} rows, the norm has {site.hidden_size} channels")
    if use.bias is not None:
        beta = float(node.attrs.get("beta", 1.0)) if node.op == "Gemm" else 1.0
        projection.bias = _bias_columns(use.bias, beta, projection.shape[1], where)
    output = use.output
    if output.dtype is not None and stored_dtype_name(output) != dtype:
        raise NotDeferrable(f"{where}: output dtype {stored_dtype_name(output)} differs from the activation's {dtype}")
    return projection


def _bias_columns(bias: gs.Tensor, beta: float, columns: int, where: str) -> np.ndarray:
    """beta·c as one float64 value per output column: c must be a constant [N] (or [1, N], or
    one value for all columns); a Gemm C with a row per token is no per-column bias."""
    c = constant_value(bias)
    if c is None:
        raise NotDeferrable(f"{where}: bias {bias.name!r} is not a constant")
    if c.size not in (1, columns) or (c.ndim and c.shape[-1] not in (1, columns)):
        raise NotDeferrable(f"{where}: bias {bias.name!r} of shape {list(c.shape)} is not one value per output column")
    return np.broadcast_to(c.astype(np.float64).reshape(-1) * beta, (columns,))


def deferred_input(site: NormSite) -> gs.Tensor:
    """The tensor the FlashNormMatMul node reads: the norm's input or, where the norm casts a
    half-precision input up to float32 and its output back down (transformers computes every
    RMSNorm in fp32), that half input: the node computes the RMS in fp32 itself."""
    source = site.input
    for _ in range(2):  # Cast(half → fp32), possibly followed by an fp32 → fp32 Cast
        node = producer(source)
        if node is None or node.op != "Cast" or int(node.attrs.get("to", 0)) != TensorProto.FLOAT:
            return site.input
        source = node.inputs[0]
        if stored_dtype_name(source) in ("float16", "bfloat16"):
            return source if stored_dtype_name(site.output) == stored_dtype_name(source) else site.input
    return site.input


@dataclasses.dataclass
class DeferPlan:
    activation: gs.Tensor
    """What the node reads: `deferred_input(site)`."""

    projections: list[Projection]
    shape_readers: list[gs.Node]
    """Shape nodes that read the normalized tensor; they will read the norm's input."""

    def dequantized_weights(self) -> list[str]:
        """'MatMul name: DequantizeLinear int4 → float32' for each weight the graph dequantizes."""
        return [f"{p.node.op} {p.node.name}: {p.dequantized}" for p in self.projections if p.dequantized]


def plan_defer(site: NormSite, graph_outputs: frozenset[str]) -> DeferPlan:
    """The projections one FlashNormMatMul replaces, or NotDeferrable with the reason.
    Mutates nothing."""
    for node in site.consumers:
        quantized = _quantized_consumer(node, site.output)
        if quantized:
            raise NotDeferrable(quantized)
    if len(site.data_inputs) > 1:
        raise NotDeferrable("the norm's input is a residual sum computed inside the fused Skip node")
    if site.kind == "layer":
        for node in site.consumers:
            reason = post_norm_reason(node)
            if reason:
                raise NotDeferrable(reason)
    if not site.is_weightless:
        raise GainKept("the norm has a gain (run fold first)" if site.kind == "rms"
                       else "the norm has a gain or a bias (run fold first)")
    if site.axis != -1:
        raise NotDeferrable(f"normalized axis {site.axis} is not the last")
    if site.output.name in graph_outputs:
        raise NotDeferrable("the normalized tensor is a graph output")
    activation = deferred_input(site)
    dtype = stored_dtype_name(activation) or stored_dtype_name(site.output)
    if not dtype:
        raise NotDeferrable("the activation dtype is unknown (run shape inference)")
    if dtype not in contract.FLOAT_TYPES:
        raise NotDeferrable(f"activation dtype {dtype} is not float32, float16 or bfloat16")
    if site.output.dtype is not None and stored_dtype_name(site.output) != dtype:
        raise NotDeferrable(f"the norm changes dtype ({dtype} → {stored_dtype_name(site.output)})")
    shape_readers = [n for n in site.consumers if _reads_only_shape(site, n)]
    consumers = [n for n in site.consumers if n not in shape_readers]
    if not consumers:
        raise NotDeferrable("the normalized tensor has no consumers that read its values")
    if shape_readers and not _keeps_shape(site):
        raise NotDeferrable("a Shape node reads the normalized tensor and the gain may broadcast it to another shape")
    if len(consumers) > contract.MAX_OUTPUTS:
        raise NotDeferrable(f"{len(consumers)} consumers; the plugin takes at most {contract.MAX_OUTPUTS}")
    projections = [_projection(site, node, dtype, graph_outputs) for node in consumers]
    if len({p.shape[0] for p in projections}) != 1:
        raise NotDeferrable("the consumers' weights disagree on K")
    return DeferPlan(activation, projections, shape_readers)


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
        reader.inputs[0] = plan.activation
    projections = plan.projections
    layer = site.kind == "layer"
    if any(p.dequantized for p in projections):
        weight = _weight_in_graph(graph, site, plan)
    else:
        weight = gs.Constant(f"{site.name}.flashnorm_deferred_weight", _concatenated(projections, centred=layer))
    biases = [p.bias if p.bias is not None else np.zeros(p.shape[1]) for p in projections]
    bias = gs.Constant(f"{site.name}.flashnorm_deferred_bias", np.concatenate(biases).astype(contract.BIAS_DTYPE))
    for p in projections:  # each consumer's output tensor is now written by the new node
        p.node.outputs.clear()
        if p.bias_node is not None:
            p.bias_node.outputs.clear()
    node = gs.Node(
        contract.op_type(len(projections)),
        name=f"{site.name}.flashnorm_matmul",
        domain=contract.DOMAIN,
        attrs={
            "plugin_version": contract.PLUGIN_VERSION,
            "plugin_namespace": contract.PLUGIN_NAMESPACE,
            "eps": float(site.eps),
            "splits": [p.shape[1] for p in projections],
            "strategy": contract.STRATEGY_AUTO,
            "statistic": contract.STATISTIC_VARIANCE if layer else contract.STATISTIC_RMS,
        },
        inputs=[plan.activation, weight, bias],
        outputs=[p.output for p in projections],
    )
    graph.nodes.append(node)
    return node


def _weight_in_graph(graph: gs.Graph, site: NormSite, plan: DeferPlan) -> gs.Tensor:
    """The node's [K, ΣN_i] weight computed by the graph from the consumers' weights as they
    are (dequantized ones stay quantized in the file): each through a Transpose where it is
    stored [N_i, K], then one Concat along N."""
    dtype = plan.activation.dtype if plan.activation.dtype is not None else site.output.dtype
    parts: list[gs.Tensor] = []
    for i, p in enumerate(plan.projections):
        if not p.dequantized:  # a constant: transposed and scaled by alpha as it is written
            parts.append(gs.Constant(f"{site.name}.flashnorm_weight_{i}", _concatenated([p])))
        elif p.transposed:
            part = gs.Variable(f"{site.name}.flashnorm_weight_{i}", dtype=dtype, shape=list(p.shape))
            graph.nodes.append(gs.Node("Transpose", name=f"{part.name}.transpose", attrs={"perm": [1, 0]},
                                       inputs=[p.weight], outputs=[part]))
            parts.append(part)
        else:
            parts.append(p.weight)
    if len(parts) == 1:
        return parts[0]
    rows = plan.projections[0].shape[0]
    weight = gs.Variable(f"{site.name}.flashnorm_deferred_weight", dtype=dtype,
                         shape=[rows, sum(p.shape[1] for p in plan.projections)])
    graph.nodes.append(gs.Node("Concat", name=f"{weight.name}.concat", attrs={"axis": 1}, inputs=parts, outputs=[weight]))
    return weight


def _concatenated(projections: list[Projection], centred: bool = False) -> DerivedValues:
    """The projections' [K, N_i] weights side by side, [K, ΣN_i] (`centred`: each column minus
    its mean over K, in float64), computed when saved or read: each weight is read and copied
    into its columns in turn, so assembling it holds the result and one consumer weight, never
    all of them twice."""
    first = projections[0]
    # Each weight's values object as it is now, as DerivedValues keeps its own source's.
    sources = [stored_values(p.weight) for p in projections]
    widths = [p.shape[1] for p in projections]
    rows, columns = first.shape[0], sum(widths)
    dtype = numpy_dtype(first.weight.dtype)  # planning checked that every weight has the activation's dtype

    def assemble(first_values: np.ndarray) -> np.ndarray:
        result = np.empty((rows, columns), dtype=dtype)
        start = 0
        for i, (projection, width) in enumerate(zip(projections, widths)):
            stored = first_values if i == 0 else _read(sources[i])
            result[:, start:start + width] = projection.centred_matrix(stored) if centred else projection.matrix(stored)
            start += width
        return result

    return DerivedValues(first.weight, assemble, shape=(rows, columns), dtype=dtype)


def _read(values: object) -> np.ndarray:
    """A constant's values, read from disk if they are lazy (without caching them on the constant)."""
    return values.load() if isinstance(values, LazyValues) else np.asarray(values)


# The lowest opset raised to MIN_OPSET for the reference function: from 13 to 15 no operator
# changed meaning (14 and 15 add types, optional attributes with the old defaults and new ops),
# while 13 itself changed many (axes of Squeeze, Unsqueeze, ReduceSum, Split became inputs).
_RAISABLE_OPSET = 13


def _raise_opset(graph: gs.Graph, opset: int) -> None:
    """Import the default domain at `opset`, in the graph and its import list alike."""
    graph.opset = opset
    for entry in graph.import_domains or []:
        if entry.domain in ("", "ai.onnx"):
            entry.version = opset


def defer(graph: gs.Graph) -> tuple[gs.Graph, PassReport]:
    """Turn every deferrable weightless norm and its projections into one FlashNormMatMul."""
    report = PassReport("defer")
    sites = find_norm_sites(graph)
    opset = graph.opset or 0
    if opset < contract.MIN_OPSET and (opset < _RAISABLE_OPSET or graph.functions):
        for site in sites:
            report.add(site.name, "skipped", f"model opset {opset} < {contract.MIN_OPSET} (the reference function needs CastLike)")
        return graph, report
    graph_outputs = frozenset(t.name for t in graph.outputs)
    for site in track(sites, "defer: sites checked", total=len(sites)):
        try:
            plan = plan_defer(site, graph_outputs)
        except NotDeferrable as exc:
            report.add(site.name, "skipped", str(exc))
            continue
        node = apply_defer(graph, site, plan)
        report.add(site.name, "deferred", "", node=node.name, kind=site.kind, eps=float(site.eps),
                   splits=node.attrs["splits"],
                   consumers=[f"{p.node.op} {p.node.name}" for p in plan.projections],
                   biases=sum(p.bias is not None for p in plan.projections),
                   shape_readers=len(plan.shape_readers),
                   dequantized=plan.dequantized_weights())
    if report.count("deferred"):
        if opset < contract.MIN_OPSET:
            _raise_opset(graph, contract.MIN_OPSET)
        add_reference_functions(graph)
    graph.cleanup().toposort()
    return graph, report
