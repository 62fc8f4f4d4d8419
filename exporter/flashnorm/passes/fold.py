"""Fold (Proposition 1): RMSNorm(x)·g → W  becomes  x/rms(x) → W* with W* = diag(g)·W.

The gain is multiplied in float64 into the weight of every consumer of the normalized
tensor and cast back to the weight's dtype (float32 weights by gains float32 holds exactly:
in float32, which gives the same bits); the site keeps a gain of ones (not an Identity, so
that ONNX Runtime still fuses the norm). A site is folded only if EVERY consumer is a linear
op with a constant float weight; a weight any other node also reads (a tied embedding) is
never changed in place: the site keeps its gain, or with `untie=True` its consumer gets its
own folded copy. Quantized weights are never folded.

Weights are not read while the pass runs: planning checks shapes and dtypes only, and each
folded weight is an `io.DerivedValues` that `io.save` computes while writing it, so a model
larger than memory is folded one tensor at a time.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import numpy as np
import onnx_graphsurgeon as gs

from flashnorm.io import DerivedValues
from flashnorm.match import NormSite, find_norm_sites
from flashnorm.match.constants import SHAPE_ONLY_OPS, numpy_dtype, producer, stored_dtype_name, through_transpose
from flashnorm.match.gain import gain_slot_shape
from flashnorm.progress import track
from flashnorm.report import PassReport

_QUANTIZED_OPS = {"MatMulNBits", "MatMulInteger", "QLinearMatMul", "MatMulIntegerToFloat", "DynamicQuantizeMatMul",
                  "MatMulBnb4", "GatherBlockQuantized", "QGemm"}
_DEQUANTIZE_OPS = {"DequantizeLinear", "DynamicQuantizeLinear", "QuantizeLinear"}
_FOLDABLE_DTYPES = {"float16", "bfloat16", "float32", "float64", "double", "float"}


@dataclasses.dataclass
class WeightEdit:
    """One consumer weight to scale: `node.inputs[index]` (directly, or behind `transpose`)."""

    node: gs.Node
    index: int
    weight: gs.Tensor
    stored: gs.Constant
    """The constant holding the weight's values (`weight` itself, or a Constant node's value);
    never read by planning."""

    shape: tuple[int, ...]
    dtype: np.dtype
    gain_axis: int
    """Axis of the weight that runs over the normalized channels (0: [K,N] rows, 1: [N,K] columns)."""

    transpose: Optional[gs.Node] = None
    shared_with: list[str] = dataclasses.field(default_factory=list)


class NotFoldable(Exception):
    """Why a site's gain cannot be folded (one line)."""


def plan_fold(site: NormSite, graph_outputs: frozenset[str], *, untie: bool = False) -> list[WeightEdit]:
    """The weight edits that fold `site`, or NotFoldable with the reason. Mutates nothing."""
    if site.gain is None or site.gain_node is None:
        raise NotFoldable("already weightless (the norm has no gain)")
    if site.is_weightless:
        raise NotFoldable("already weightless (gain is all ones)")
    if site.output.name in graph_outputs:
        raise NotFoldable("the normalized tensor is a graph output")
    if site.residual_output is not None and site.output is site.residual_output:
        raise NotFoldable("the normalized tensor is the residual sum")
    consumers = [n for n in site.consumers if n.op not in SHAPE_ONLY_OPS]  # shapes do not change
    if not consumers:
        raise NotFoldable("the normalized tensor has no consumers that read its values")
    edits = [_weight_edit(site, node) for node in consumers]
    shared = [e for e in edits if e.shared_with]
    if shared and not untie:
        e = shared[0]
        raise NotFoldable(
            f"weight {e.weight.name!r} of {e.node.op} {e.node.name!r} is shared with "
            f"{', '.join(e.shared_with)} (tied); kept the gain (use --untie to copy and fold)"
        )
    return edits


def _weight_edit(site: NormSite, node: gs.Node) -> WeightEdit:
    where = f"consumer {node.op} {node.name!r}"
    if node.op in _QUANTIZED_OPS:
        raise NotFoldable(f"{where} has a quantized weight (fold needs dequantize → fold → requantize)")
    if node.op == "MatMul":
        if node.inputs[0] is not site.output or node.inputs[1] is site.output:
            raise NotFoldable(f"{where} reads the normalized tensor as its right-hand operand")
        index, transposed = 1, False
    elif node.op == "Gemm":
        if node.inputs[0] is not site.output or int(node.attrs.get("transA", 0)) != 0:
            raise NotFoldable(f"{where} does not read the normalized tensor as A (transA=0)")
        index, transposed = 1, int(node.attrs.get("transB", 0)) == 1
    else:
        raise NotFoldable(f"{where} is not a linear op with a constant weight")
    weight, transpose = through_transpose(node.inputs[index], where, NotFoldable)
    if transpose is not None:
        transposed = not transposed
    source = producer(weight)
    if source is not None and source.op in _DEQUANTIZE_OPS:
        raise NotFoldable(f"{where} has a quantized weight ({source.op}); fold needs dequantize → fold → requantize")
    stored = _stored_weight(weight)
    if stored is not None and stored_dtype_name(stored) not in _FOLDABLE_DTYPES:
        raise NotFoldable(f"{where}: weight {stored.name!r} is stored as {stored_dtype_name(stored)} "
                          "(quantized or integer); never folded")
    constant = _weight_constant(weight)
    if constant is None:
        raise NotFoldable(f"{where}: weight {weight.name!r} is not a constant")
    dtype = numpy_dtype(constant.dtype)
    if dtype is None or dtype.name not in _FOLDABLE_DTYPES:
        raise NotFoldable(f"{where}: weight {weight.name!r} has dtype {stored_dtype_name(constant)} "
                          "(quantized or integer)")
    shape = tuple(int(d) for d in constant.shape)
    if len(shape) != 2:
        raise NotFoldable(f"{where}: weight {weight.name!r} has rank {len(shape)}, not 2")
    gain_axis = 1 if transposed else 0
    if shape[gain_axis] != site.gain.size:
        raise NotFoldable(f"{where}: weight shape {list(shape)} does not match {site.gain.size} channels")
    readers = [n for n in weight.outputs if n is not (transpose or node)]
    if transpose is not None:
        readers += [n for n in transpose.outputs[0].outputs if n is not node]
    shared_with = [f"{n.op} {n.name!r}" for n in readers]
    return WeightEdit(node, index, weight, constant, shape, dtype, gain_axis, transpose, shared_with)


def _stored_weight(weight: gs.Tensor) -> Optional[gs.Tensor]:
    """The initializer behind Cast/Identity/Reshape chains, if any."""
    for _ in range(4):
        if isinstance(weight, gs.Constant):
            return weight
        node = producer(weight)
        if node is None or node.op not in ("Cast", "Identity", "Reshape", "Transpose"):
            return None
        weight = node.inputs[0]
    return None


def _weight_constant(weight: gs.Tensor) -> Optional[gs.Constant]:
    """The constant that holds `weight`'s values: an initializer or a Constant node's value."""
    if isinstance(weight, gs.Constant):
        return weight
    node = producer(weight)
    if node is not None and node.op == "Constant" and isinstance(node.attrs.get("value"), gs.Constant):
        return node.attrs["value"]
    return None


def row_scaler(gain: np.ndarray, dtype: np.dtype) -> Callable[[np.ndarray], np.ndarray]:
    """The function that turns a weight W of `dtype` into (W · gain) rounded once to `dtype`,
    `gain` (float64) broadcasting over W's rows or columns.

    A float32 weight and a gain that float32 holds exactly are multiplied in float32, in
    place on the freshly read array: the float64 product of two float32 numbers is exact
    (24 + 24 significant bits fit in 53, and the exponent range too), so both ways round the
    same real number once and give the same bits. Everything else is computed in float64
    and cast back."""
    with np.errstate(over="ignore"):  # a gain beyond float32's range is simply not held exactly
        narrow = gain.astype(np.float32)
    if dtype == np.float32 and np.array_equal(narrow.astype(np.float64), gain):
        return lambda w: np.multiply(w, narrow, out=w)

    def scale_in_float64(w: np.ndarray) -> np.ndarray:
        wide = w.astype(np.float64)
        np.multiply(wide, gain, out=wide)
        return wide.astype(w.dtype)

    return scale_in_float64


def apply_fold(site: NormSite, edits: list[WeightEdit]) -> list[gs.Node]:
    """Write W* = diag(g)·W into each consumer (a new initializer, computed when it is saved
    or read; the old one is left to whoever else reads it), then give the site a gain of
    ones. Returns the nodes the caller must add to the graph (a Transpose of an untied copy)."""
    new_nodes = []
    for edit in edits:
        shape = [1, 1]
        shape[edit.gain_axis] = site.gain.size
        gain = np.asarray(site.gain, dtype=np.float64).reshape(shape)
        folded = DerivedValues(edit.stored, row_scaler(gain, edit.dtype), shape=edit.shape, dtype=edit.dtype)
        constant = gs.Constant(f"{edit.weight.name}.folded_for.{site.name}", folded)
        if edit.transpose is None:
            edit.node.inputs[edit.index] = constant
        elif edit.shared_with:
            transposed = gs.Variable(f"{constant.name}.transposed", dtype=edit.dtype)
            edit.node.inputs[edit.index] = transposed
            new_nodes.append(gs.Node("Transpose", name=f"{constant.name}.transpose", attrs={"perm": [1, 0]},
                                      inputs=[constant], outputs=[transposed]))
        else:
            edit.transpose.inputs[0] = constant
    ones = np.ones(gain_slot_shape(site), dtype=site.gain_dtype)  # same shape: same broadcast
    site.gain_node.inputs[site.gain_index] = gs.Constant(f"{site.name}.flashnorm_unit_gain", ones)
    return new_nodes


def fold(graph: gs.Graph, *, untie: bool = False) -> tuple[gs.Graph, PassReport]:
    """Fold every foldable site's gain into its consumers' weights."""
    report = PassReport("fold")
    graph_outputs = frozenset(t.name for t in graph.outputs)
    sites = find_norm_sites(graph)
    for site in track(sites, "fold", total=len(sites)):
        try:
            edits = plan_fold(site, graph_outputs, untie=untie)
        except NotFoldable as exc:
            report.add(site.name, "skipped", str(exc))
            continue
        graph.nodes.extend(apply_fold(site, edits))
        untied = [e.weight.name for e in edits if e.shared_with]
        report.add(site.name, "folded", "", spelling=site.spelling, gain_convention=site.gain_convention,
                   consumers=[f"{e.node.op} {e.node.name}" for e in edits], untied=untied)
    graph.cleanup().toposort()
    return graph, report
