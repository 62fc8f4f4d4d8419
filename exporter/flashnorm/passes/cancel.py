"""Cancel (Proposition 3): RMSNorm((x/rms(x))·W*) = RMSNorm(x·W*).

A norm's division is redundant when EVERY path from its output reaches a downstream RMSNorm
through bias-free, positively homogeneous ops: each such op maps s·t to s·f(t) for the
per-token scalar s = 1/rms(x), and the downstream norm divides s back out. The site's gain is
kept (after `fold` it is ones and lives in W*); only the division goes. With eps the result is
approximate: per token the kept norm's output is the cancelled one times

    ρ = sqrt((M(b)+ε₂) / (M(b) + ε₂·(M(a)+ε₁))),   ρ−1 ≈ ε(1−M(a)) / (2·M(b))

with M = mean of squares, a the cancelled norm's input, b the downstream norm's input.

Homogeneity is proved op by op, tracking which axes index tokens: the downstream norm must
reduce over an axis that holds one token's channels, never across tokens. Ops accepted:
MatMul/Gemm and the quantized x·W ops of `flashnorm.match.quantized` (MatMulNBits, MatMulBnb4)
with a constant weight and no bias; Reshape that keeps the token axes;
Transpose; Slice; Split; Expand; Squeeze/Unsqueeze; float Cast; Identity; Neg; Mul/Div by a constant;
RotaryEmbedding (a rotation per token whose angles do not depend on the site).

LayerNorm sites are never cancelled, nor does a path end at one: see `LAYER_NORM_REASON`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import onnx_graphsurgeon as gs
from onnx import TensorProto

from flashnorm.match import NormSite, find_norm_sites
from flashnorm.match.shapes import inferred_shapes
from flashnorm.match.gain import gain_slot_shape
from flashnorm.match.projection import LINEAR_OPS, linear_use
from flashnorm.match.quantized import QUANTIZED_OPS
from flashnorm.match.queries import SHAPE_ONLY_OPS, constant_value, is_constant_expression, onnx_to_numpy_dtype, tensor_rank
from flashnorm.report import PassReport

TOKEN, CHANNEL = "token", "channel"
Layout = Optional[list[str]]  # one flag per axis; None: rank unknown, only the last axis is a channel
_FLOAT_TYPES = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE}
_SAME_LAYOUT_OPS = {"Identity", "Neg", "Slice", "Split"}
_SKIP = "SkipSimplifiedLayerNormalization"


class NotCancellable(Exception):
    """Why a site's division must stay (one line)."""


LAYER_NORM_REASON = ("a LayerNorm: cancel (Proposition 3) removes an RMSNorm's division; a LayerNorm's bias is not "
                     "divided by σ, so without the division its output is no per-token multiple of the normalized one")


@dataclasses.dataclass
class CancelPlan:
    site: NormSite
    downstream: list[NormSite]


def cancel_error_factor(mean_square_a, mean_square_b, eps: float, downstream_eps: Optional[float] = None):
    """ρ per token: the kept pipeline's output divided by the cancelled one's. Arrays allowed."""
    eps2 = eps if downstream_eps is None else downstream_eps
    a, b = np.asarray(mean_square_a, np.float64), np.asarray(mean_square_b, np.float64)
    return np.sqrt((b + eps2) / (b + eps2 * (a + eps)))


def error_bound_text(eps: float, downstream_eps: list[float]) -> str:
    eps2 = ", ".join(f"{e:.3g}" for e in sorted(set(downstream_eps)))
    return (f"per token output × ρ, ρ = sqrt((M(b)+ε₂)/(M(b)+ε₂·(M(a)+ε₁))), ρ−1 ≈ ε·(1−M(a))/(2·M(b)); "
            f"ε₁={eps:.3g}, ε₂={eps2}; M(a), M(b): mean squares of this norm's input and the downstream norm's input")


def plan_cancel(site: NormSite, all_sites: list[NormSite], graph_outputs: frozenset[str]) -> CancelPlan:
    """The downstream norms that make `site`'s division redundant, or NotCancellable."""
    if site.kind == "layer":
        raise NotCancellable(LAYER_NORM_REASON)
    if site.output.name in graph_outputs:
        raise NotCancellable("the normalized tensor is a graph output")
    if not site.consumers:
        raise NotCancellable("the normalized tensor has no consumers")
    by_node = {id(node): other for other in all_sites if other is not site for node in other.nodes}
    walker = _Walker(site, by_node, graph_outputs)
    walker.walk()
    if not walker.downstream:
        raise NotCancellable("no downstream RMSNorm")
    return CancelPlan(site, list(walker.downstream.values()))


class _Walker:
    """Follows every path from a site's output; raises NotCancellable at the first path that
    is not bias-free positively homogeneous or does not end at a downstream RMSNorm."""

    def __init__(self, site: NormSite, by_node: dict[int, NormSite], graph_outputs: frozenset[str]) -> None:
        self.site, self.by_node, self.graph_outputs = site, by_node, graph_outputs
        self.downstream: dict[str, NormSite] = {}
        self._reached: set[int] = set()

    def walk(self) -> None:
        rank = tensor_rank(self.site.output) or tensor_rank(self.site.input)
        stack: list[tuple[gs.Tensor, Layout]] = [(self.site.output, _initial_layout(rank))]
        visited: set[tuple[int, int]] = set()
        while stack:
            tensor, layout = stack.pop()
            if layout is None and tensor_rank(tensor):
                layout = _initial_layout(tensor_rank(tensor))
            if tensor.name in self.graph_outputs:
                raise NotCancellable(f"path reaches graph output {tensor.name!r} without a downstream RMSNorm")
            for node in tensor.outputs:
                key = (id(node), id(tensor))
                if key in visited:
                    continue
                visited.add(key)
                if node.op in SHAPE_ONLY_OPS:
                    continue  # reads the shape only, which the cancellation does not change
                other = self.by_node.get(id(node))
                if other is not None:
                    self._arrive(other, tensor, layout)
                else:
                    stack.extend(self._step(node, tensor, layout))

    def _arrive(self, other: NormSite, tensor: gs.Tensor, layout: Layout) -> None:
        if other.spelling == _SKIP:
            raise NotCancellable(f"path reaches {_SKIP} {other.name!r}, which adds a residual first")
        if other.kind == "layer":
            raise NotCancellable(f"path reaches LayerNorm {other.name!r}: Proposition 3 and its eps bound are proved "
                                 "for a downstream RMSNorm")
        if tensor is not other.input:
            raise NotCancellable(f"path enters norm {other.name!r} other than through its normalized input")
        if layout is not None and layout[-1] == TOKEN:
            raise NotCancellable(f"downstream norm {other.name!r} would reduce over a token axis")
        self.downstream[other.name] = other

    def _step(self, node: gs.Node, tensor: gs.Tensor, layout: Layout) -> list[tuple[gs.Tensor, Layout]]:
        where = f"{node.op} {node.name!r}"
        first = node.inputs[0] is tensor and all(t is not tensor for t in node.inputs[1:])
        op = node.op
        if op in LINEAR_OPS or _homogeneous_quantized(node):
            return [(node.outputs[0], self._linear(node, tensor, where, first, layout))]
        if op == "Reshape" and first:
            return [(node.outputs[0], _reshape_layout(node, tensor, layout, where))]
        if op == "Transpose":
            if layout is None:
                raise NotCancellable(f"{where}: rank unknown, cannot track token axes through a Transpose")
            perm = node.attrs.get("perm") or list(reversed(range(len(layout))))
            return [(node.outputs[0], [layout[p] for p in perm])]
        if op in _SAME_LAYOUT_OPS and first:
            return [(out, layout) for out in node.outputs if out.name]
        if op == "Cast" and int(node.attrs["to"]) in _FLOAT_TYPES:
            return [(node.outputs[0], layout)]
        if op == "Expand" and first:
            return [(node.outputs[0], _expand_layout(node, layout, where))]
        if op in ("Squeeze", "Unsqueeze") and first:
            return [(node.outputs[0], _squeeze_layout(node, layout, where))]
        if op in ("Mul", "Div") and len(node.inputs) == 2:
            other = node.inputs[1] if node.inputs[0] is tensor else node.inputs[0]
            if op == "Div" and node.inputs[1] is tensor:
                raise NotCancellable(f"{where} divides by the normalized path (not homogeneous)")
            if other is tensor or not is_constant_expression(other):
                raise NotCancellable(f"{where} multiplies by a non-constant: not proven positively homogeneous")
            rank = tensor_rank(other) if constant_value(other) is None else constant_value(other).ndim
            if rank is None or (rank > 1 and (layout is None or rank > len(layout))):
                raise NotCancellable(f"{where}: constant operand may broadcast new axes")
            return [(node.outputs[0], layout)]
        if op == "RotaryEmbedding" and first:
            if any(self._depends_on_site(t) for t in node.inputs[1:] if t.name):
                raise NotCancellable(f"{where}: rotation angles depend on the normalized path")
            return [(node.outputs[0], layout)]
        if op in ("Add", "Sub"):
            raise NotCancellable(f"{where} adds a bias or residual: breaks positive homogeneity")
        raise NotCancellable(f"{where} is not a bias-free positively homogeneous op")

    def _linear(self, node: gs.Node, tensor: gs.Tensor, where: str, first: bool, layout: Layout) -> Layout:
        use = linear_use(node, tensor, where, NotCancellable)
        if use is None:  # x·W with a quantized weight (MatMulNBits): the table says where its inputs are
            row = QUANTIZED_OPS[node.op]
            if node.inputs[row.activation] is not tensor or not first:
                raise NotCancellable(f"{where} does not read the normalized path as its left operand only")
            if row.bias is not None and len(node.inputs) > row.bias and node.inputs[row.bias].name:
                raise NotCancellable(f"{where} has a bias")
            weight = node.inputs[row.codes]
        elif use.bias is not None:
            raise NotCancellable(f"{where} has a bias")
        else:
            weight = use.weight
        if not is_constant_expression(weight):
            raise NotCancellable(f"{where} weight {weight.name!r} is not a constant")
        if node.op == "MatMul":
            # The rank from the shape: reading a (lazily loaded or folded) weight's values
            # only to count its axes would load it into memory for good.
            rank = tensor_rank(weight)
            if rank is None:
                value = constant_value(weight)
                rank = None if value is None else value.ndim
            if rank != 2:
                raise NotCancellable(f"{where} weight rank is {rank}, not 2")
        return layout

    def _depends_on_site(self, tensor: gs.Tensor) -> bool:
        if not self._reached:
            frontier = [self.site.output]
            while frontier:
                current = frontier.pop()
                for node in current.outputs:
                    for out in node.outputs:
                        if id(out) not in self._reached:
                            self._reached.add(id(out))
                            frontier.append(out)
            self._reached.add(id(self.site.output))
        return id(tensor) in self._reached


def _homogeneous_quantized(node: gs.Node) -> bool:
    """x·W with a weight the op dequantizes itself (`flashnorm.match.quantized`'s table)."""
    row = QUANTIZED_OPS.get(node.op)
    return row is not None and row.homogeneous


def _initial_layout(rank: Optional[int]) -> Layout:
    return None if not rank else [TOKEN] * (rank - 1) + [CHANNEL]


def _reshape_layout(node: gs.Node, tensor: gs.Tensor, layout: Layout, where: str) -> list[str]:
    """Layout after a Reshape proven to keep every token axis (a prefix) unchanged."""
    if layout is None:
        raise NotCancellable(f"{where}: rank unknown, cannot prove the Reshape keeps tokens apart")
    tokens = layout.count(TOKEN)
    if layout[:tokens] != [TOKEN] * tokens:
        raise NotCancellable(f"{where}: token axes are not leading, cannot prove the Reshape keeps tokens apart")
    target = constant_value(node.inputs[1])
    in_shape, out_shape = tensor.shape, node.outputs[0].shape
    out_rank = len(target) if target is not None else (len(out_shape) if out_shape is not None else None)
    if out_rank is None or out_rank < tokens:
        raise NotCancellable(f"{where}: output rank unknown")
    kept = False
    if target is not None and int(node.attrs.get("allowzero", 0)) == 0 and all(int(v) == 0 for v in target[:tokens]):
        kept = True  # 0 copies the input dimension
    elif in_shape is not None and out_shape is not None and len(out_shape) >= tokens:
        kept = all(in_shape[i] is not None and in_shape[i] == out_shape[i] for i in range(tokens))
    if not kept and target is not None and in_shape is not None:
        kept = all(isinstance(in_shape[i], (int, np.integer)) and int(target[i]) == int(in_shape[i])
                   for i in range(tokens))
    if not kept:
        raise NotCancellable(f"{where}: cannot prove the Reshape keeps the {tokens} token axes unchanged")
    return [TOKEN] * tokens + [CHANNEL] * (out_rank - tokens)


def _expand_layout(node: gs.Node, layout: Layout, where: str) -> Layout:
    """Expand copies elements (GQA's repeat_kv); new leading axes are copies, not tokens."""
    target = constant_value(node.inputs[1])
    out_rank = len(target) if target is not None else tensor_rank(node.outputs[0])
    if layout is None or out_rank is None:
        raise NotCancellable(f"{where}: rank unknown, cannot track token axes through an Expand")
    return [CHANNEL] * (out_rank - len(layout)) + layout


def _squeeze_layout(node: gs.Node, layout: Layout, where: str) -> list[str]:
    if layout is None:
        raise NotCancellable(f"{where}: rank unknown, cannot track axes")
    if "axes" in node.attrs:
        axes = [int(a) for a in node.attrs["axes"]]
    elif len(node.inputs) > 1 and node.inputs[1].name and constant_value(node.inputs[1]) is not None:
        axes = [int(a) for a in constant_value(node.inputs[1]).reshape(-1)]
    else:
        raise NotCancellable(f"{where}: axes not constant")
    if node.op == "Squeeze":
        axes = sorted(a % len(layout) for a in axes)
        return [flag for i, flag in enumerate(layout) if i not in axes]
    out_rank = len(layout) + len(axes)
    result, source = [], iter(layout)
    normalized = {a % out_rank for a in axes}
    for i in range(out_rank):
        result.append(CHANNEL if i in normalized else next(source))  # a size-1 axis mixes no tokens
    return result


def apply_cancel(graph: gs.Graph, plan: CancelPlan) -> None:
    """Rewire the site's consumers to its undivided input (cast and gain kept)."""
    site = plan.site
    tag = f"{site.name}.flashnorm_cancelled"
    if site.spelling == _SKIP:
        node = site.nodes[0]
        replacement = gs.Variable(f"{tag}.sum", dtype=site.input.dtype)
        graph.nodes.append(gs.Node("Add", name=f"{tag}.add", inputs=[node.inputs[0], node.inputs[1]], outputs=[replacement]))
        if len(node.inputs) > 3 and node.inputs[3].name:
            with_bias = gs.Variable(f"{tag}.sum_bias", dtype=site.input.dtype)
            graph.nodes.append(gs.Node("Add", name=f"{tag}.bias", inputs=[replacement, node.inputs[3]], outputs=[with_bias]))
            replacement = with_bias
        if site.residual_output is not None:
            _replace_tensor(graph, site.residual_output, replacement)
    else:
        replacement = site.input
    dtype = site.input.dtype
    if site.output_cast is not None:
        dtype = onnx_to_numpy_dtype(site.output_cast)
        cast = gs.Variable(f"{tag}.cast", dtype=dtype)
        graph.nodes.append(gs.Node("Cast", name=f"{tag}.cast", attrs={"to": site.output_cast},
                                   inputs=[replacement], outputs=[cast]))
        replacement = cast
    slot_shape = gain_slot_shape(site) if site.gain is not None else (1,)
    if not site.is_weightless or len(slot_shape) > 1:  # a [1, 1, D] gain may also broadcast the rank
        gain_dtype = dtype if site.output_cast is not None else site.gain_dtype
        gain = gs.Constant(f"{tag}.gain", site.gain.reshape(slot_shape).astype(gain_dtype))
        scaled = gs.Variable(f"{tag}.scaled", dtype=gain_dtype)
        graph.nodes.append(gs.Node("Mul", name=f"{tag}.gain_mul", inputs=[replacement, gain], outputs=[scaled]))
        replacement = scaled
    for consumer in list(site.output.outputs):
        for i, tensor in enumerate(consumer.inputs):
            if tensor is site.output:
                consumer.inputs[i] = replacement


def _replace_tensor(graph: gs.Graph, old: gs.Variable, new: gs.Variable) -> None:
    """Every reader of `old` reads `new`; a graph output keeps its name."""
    for consumer in list(old.outputs):
        for i, tensor in enumerate(consumer.inputs):
            if tensor is old:
                consumer.inputs[i] = new
    for i, output in enumerate(graph.outputs):
        if output is old:
            name = old.name
            old.name = f"{name}.flashnorm_replaced"
            new.name, new.shape = name, old.shape
            graph.outputs[i] = new


def cancel(graph: gs.Graph) -> tuple[gs.Graph, PassReport]:
    """Remove the division of every site whose every consumer path reaches a downstream
    RMSNorm through bias-free positively homogeneous ops."""
    report = PassReport("cancel")
    graph_outputs = frozenset(t.name for t in graph.outputs)
    sites = find_norm_sites(graph)
    outcomes: list[CancelPlan | str] = []
    with inferred_shapes(graph):  # token axes are tracked through Reshape/Transpose by shape
        for site in sites:
            try:
                outcomes.append(plan_cancel(site, sites, graph_outputs))
            except NotCancellable as exc:
                outcomes.append(str(exc))
    for site, outcome in zip(sites, outcomes):
        if isinstance(outcome, str):
            report.add(site.name, "skipped", outcome)
            continue
        apply_cancel(graph, outcome)
        eps2 = [d.eps for d in outcome.downstream]
        report.add(site.name, "cancelled", "", downstream=[d.name for d in outcome.downstream],
                   eps=site.eps, downstream_eps=eps2, error_bound=error_bound_text(site.eps, eps2),
                   gain_kept=not site.is_weightless)
    graph.cleanup().toposort()
    return graph, report


__all__ = ["CancelPlan", "NotCancellable", "apply_cancel", "cancel", "cancel_error_factor", "plan_cancel"]
