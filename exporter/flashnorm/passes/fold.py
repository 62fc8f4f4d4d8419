"""Fold (Proposition 1): RMSNorm(x)·g → W  becomes  x/rms(x) → W* with W* = diag(g)·W.

A LayerNorm, LN(x)·g + b → W, c, folds its gain the same way and its bias into the consumer's
bias, c* = b·W + c (a consumer without one gets an Add, a Gemm a C), and centres W* over K,
W_c = W* − (1/K)·1·(1ᵀW*) (each column minus its mean), all in float64 and cast back once; the
site keeps a gain of ones and a bias of zeros. 1ᵀW_c = 0 changes nothing here (the normalized
input has zero mean) and lets defer drop the mean: (x − μ)·W_c = x·W_c. A LayerNorm whose output
is also the residual stream (post-LN) or feeds a quantized consumer is not folded.

The gain is multiplied in float64 into the weight of every consumer of the normalized
tensor and cast back to the weight's dtype (float32 weights by gains float32 holds exactly:
in float32, which gives the same bits); the site keeps a gain of ones (not an Identity, so
that ONNX Runtime still fuses the norm). A site is folded only if EVERY consumer is a linear
op with a constant float weight; a weight any other node also reads (a tied embedding) is
never changed in place: the site keeps its gain, or with `untie=True` its consumer gets its
own folded copy. A consumer that computes with quantized values (`flashnorm.match.quantized`)
is folded by `passes/quantized/` in its own format, within `quant_limit`, or refused with the
recogniser's reason.

Float32 weights are not read while the pass runs: planning checks shapes and dtypes only,
and each folded weight is a `DerivedValues` that `flashnorm.modelio.saving` computes while
writing it, so a model larger than memory is folded one tensor at a time.

Half-precision weights (float16, bfloat16) are read once while planning, one at a time: the
fold computes g·W in float64 and rounds it once to the weight's type, which is not exact, so
planning measures what that rounding does (`FoldRounding`: the largest relative change of a
folded element and the relative L2 change of the weight, which is also the expected relative
change of the projection's output for inputs uncorrelated with the rounding) and refuses a
site where some |g·W| would round to infinity in that type.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import numpy as np
import onnx_graphsurgeon as gs

from flashnorm.errors import FlashNormError
from flashnorm.modelio.values import DerivedValues
from flashnorm.match import NormSite, find_norm_sites
from flashnorm.match.projection import LinearUse, linear_use, post_norm_reason
from flashnorm.match.quantized import quantized_use
from flashnorm.match.queries import (
    SHAPE_ONLY_OPS,
    constant_array,
    constant_value,
    holding_constant,
    numpy_dtype,
    stored_dtype_name,
    stored_initializer,
)
from flashnorm.match.gain import bias_slot_shape, gain_slot_shape
from flashnorm.passes.edit import WeightEdit
from flashnorm.passes.quantized import DEFAULT_QUANT_LIMIT, NotQuantFoldable, QuantEdit, plan_quantized, site_quant_error
from flashnorm.progress import track
from flashnorm.report import PassReport
from flashnorm.quantization_aware import Candidate, rule
from flashnorm.rounding import round_centred

_FOLDABLE_DTYPES = {"float16", "bfloat16", "float32", "float64", "double", "float"}
# What may sit between a weight and its initializer without changing its values.
_WEIGHT_STORAGE_OPS = frozenset({"Cast", "Identity", "Reshape", "Transpose"})


@dataclasses.dataclass
class FloatEdit(WeightEdit):
    """One float consumer weight to scale: `node.inputs[index]` (directly, or behind `transpose`)."""

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

    label: str
    """Names the folded copy: `<weight>.folded_for.<label>` (the site's name)."""

    transpose: Optional[gs.Node] = None
    shared_with: list[str] = dataclasses.field(default_factory=list)
    rounding: Optional["FoldRounding"] = None
    """What rounding g·W to a half type does to this weight (None for float32 and float64)."""

    use: Optional[LinearUse] = None
    """How the consumer reads the norm: where a LayerNorm's bias goes (its Gemm C or bias Add)."""

    layer_bias: Optional[np.ndarray] = None
    """A LayerNorm's bias b (float64, [K]) to move into the consumer's bias: c* = b·W + c."""

    centre: bool = False
    """A LayerNorm's fold: W* centred over K after the gain (each column minus its mean)."""

    def apply(self, gain: np.ndarray) -> list[gs.Node]:
        """W* = diag(g)·W (a LayerNorm's centred, its bias moved into the consumer's) as new
        initializers, computed when they are saved or read; the old ones are left to whoever else
        reads them. Returns the nodes to add: the Transpose of an untied [N, K] copy, a MatMul's
        new bias Add."""
        shape = [1, 1]
        shape[self.gain_axis] = gain.size
        gain = gain.reshape(shape)
        scale = centring_scaler(gain, self.gain_axis) if self.centre else row_scaler(gain, self.dtype)
        new_nodes = _fold_bias(self) if self.layer_bias is not None and np.any(self.layer_bias) else []
        folded = DerivedValues(self.stored, scale, shape=self.shape, dtype=self.dtype)
        constant = gs.Constant(f"{self.weight.name}.folded_for.{self.label}", folded)
        if self.transpose is None:
            self.node.inputs[self.index] = constant
        elif self.shared_with:
            transposed = gs.Variable(f"{constant.name}.transposed", dtype=self.dtype)
            self.node.inputs[self.index] = transposed
            new_nodes.append(gs.Node("Transpose", name=f"{constant.name}.transpose", attrs={"perm": [1, 0]},
                                     inputs=[constant], outputs=[transposed]))
        else:
            self.transpose.inputs[0] = constant
        return new_nodes

    def float_weight(self) -> tuple[np.ndarray, int]:
        return constant_array(self.stored), self.gain_axis


@dataclasses.dataclass(frozen=True)
class FoldRounding:
    """The error of rounding W* = g·W (float64) once to the weight's half type."""

    max_relative_change: float
    """max over nonzero elements of |round(g·W) − g·W| / |g·W|: at most the type's unit
    roundoff (2⁻¹¹ fp16, 2⁻⁸ bf16) for normal numbers, more where g·W is subnormal."""

    rel_l2_change: float
    """‖round(g·W) − g·W‖_F / ‖g·W‖_F: for inputs uncorrelated with the rounding, the
    expected relative L2 change of the projection's output."""

    largest: float
    """max |g·W|, against the type's largest finite value."""


HALF_DTYPES = frozenset({"float16", "bfloat16"})


def largest_finite(dtype: np.dtype) -> float:
    """The largest finite value of a float dtype (ml_dtypes' bfloat16 included)."""
    if dtype.name == "bfloat16":
        import ml_dtypes

        return float(ml_dtypes.finfo(dtype).max)
    return float(np.finfo(dtype).max)


def measure_rounding(weight: np.ndarray, gain: np.ndarray, where: str,
                     centre_axis: Optional[int] = None) -> FoldRounding:
    """FoldRounding of folding `gain` (float64, broadcasting over `weight`) into `weight`, then
    (a LayerNorm's fold) centring it over `centre_axis`; NotFoldable where some |g·W| rounds to
    infinity in the weight's type."""
    exact = weight.astype(np.float64) * gain
    if centre_axis is not None:
        exact -= exact.mean(axis=centre_axis, keepdims=True)
    largest = float(np.max(np.abs(exact))) if exact.size else 0.0
    limit = largest_finite(weight.dtype)
    with np.errstate(over="ignore"):
        rounded = exact.astype(weight.dtype) if centre_axis is None else round_centred(exact, centre_axis, weight.dtype)
    if not np.all(np.isfinite(rounded.astype(np.float32))):
        raise NotFoldable(f"{where}: |g·W| reaches {largest:.6g}, beyond {weight.dtype.name}'s largest finite "
                          f"value {limit:.6g}: folding would write inf; kept the gain")
    change = rounded.astype(np.float64) - exact
    nonzero = exact != 0
    relative = np.abs(change[nonzero]) / np.abs(exact[nonzero])
    norm = float(np.linalg.norm(exact))
    return FoldRounding(
        max_relative_change=float(relative.max()) if relative.size else 0.0,
        rel_l2_change=float(np.linalg.norm(change)) / norm if norm > 0 else 0.0,
        largest=largest,
    )


def site_rounding(edits: list[WeightEdit]) -> Optional[dict[str, float]]:
    """A site's rounding report over its folded weights (None when no weight is half):
    the largest relative element change, and the relative L2 change of the site's
    projections' outputs together, the estimate of the error the fold adds there."""
    measured = [e for e in edits if isinstance(e, FloatEdit) and e.rounding is not None]
    if not measured:
        return None
    sizes = [float(np.prod(e.shape)) for e in measured]
    # ‖ΔW‖²/‖W‖² of each weight, weighted by its share of the elements (similar scales).
    mean_square = sum(e.rounding.rel_l2_change ** 2 * n for e, n in zip(measured, sizes)) / sum(sizes)
    return {
        "weight_dtype": measured[0].dtype.name,
        "max_relative_change": max(e.rounding.max_relative_change for e in measured),
        "estimated_output_rel_l2": float(np.sqrt(mean_square)),
        "largest_folded_value": max(e.rounding.largest for e in measured),
    }


class NotFoldable(Exception):
    """Why a site's gain cannot be folded (one line); `details` (measured errors) go in the report."""

    def __init__(self, message: str, **details) -> None:
        super().__init__(message)
        self.details = details


def plan_fold(site: NormSite, graph_outputs: frozenset[str], *, untie: bool = False,
              quant_limit: float = DEFAULT_QUANT_LIMIT) -> list[WeightEdit]:
    """The weight edits that fold `site`, or NotFoldable with the reason. Mutates nothing
    (quantized weights are read to measure their requantization error)."""
    if site.gain_node is None and site.bias_node is None:
        raise NotFoldable("already weightless (the norm has no gain)" if site.kind == "rms"
                          else "already weightless (the norm has no gain and no bias)")
    if site.is_weightless:
        raise NotFoldable("already weightless (gain is all ones)" if site.kind == "rms"
                          else "already weightless (gain all ones, bias all zeros)")
    if site.output.name in graph_outputs:
        raise NotFoldable("the normalized tensor is a graph output")
    if site.residual_output is not None and site.output is site.residual_output:
        raise NotFoldable("the normalized tensor is the residual sum")
    consumers = [n for n in site.consumers if n.op not in SHAPE_ONLY_OPS]  # shapes do not change
    if not consumers:
        raise NotFoldable("the normalized tensor has no consumers that read its values")
    if site.kind == "layer":
        _refuse_post_norm(consumers)
    edits = [_weight_edit(site, node, graph_outputs) for node in consumers]
    shared = [e for e in edits if e.shared_with]
    if shared and not untie:
        e = shared[0]
        raise NotFoldable(
            f"weight {e.weight.name!r} of {e.node.op} {e.node.name!r} is shared with "
            f"{', '.join(e.shared_with)} (tied); kept the gain (use --untie to copy and fold)"
        )
    for edit in edits:
        if isinstance(edit, FloatEdit):
            _measure(site, edit)
    quantized = site_quant_error(edits)
    if quantized and quantized["noise_ratio"] > quant_limit:
        worst = max((e for e in edits if isinstance(e, QuantEdit)), key=lambda e: e.error.noise_ratio)
        raise NotFoldable(
            f"consumer {worst.node.op} {worst.node.name!r} ({worst.format}): requantizing adds "
            f"{worst.error.noise_ratio:.3g}× the format's own noise (rel error {worst.error.rel_error:.3g}), "
            f"above the quant limit {quant_limit:g}; kept the gain", quantized=quantized)
    return edits


def _refuse_post_norm(consumers: list[gs.Node]) -> None:
    """A LayerNorm whose output is also the residual stream keeps its gain and bias."""
    for node in consumers:
        reason = post_norm_reason(node)
        if reason:
            raise NotFoldable(reason)


_LAYER_QUANTIZED = "a LayerNorm's bias and centring are not folded into a quantized weight (not exact)"


def _weight_edit(site: NormSite, node: gs.Node, graph_outputs: frozenset[str]) -> WeightEdit:
    where = f"consumer {node.op} {node.name!r}"
    if site.kind == "layer":  # no quantized planner: a bias and a centring have no exact quantized form
        quantized_consumer = quantized_use(node, site.output)
        if quantized_consumer is not None:
            raise NotFoldable(f"{quantized_consumer.where} {quantized_consumer.describe()}: {_LAYER_QUANTIZED}")
    try:
        quantized = None if site.kind == "layer" else plan_quantized(node, site.output, site.gain)
    except NotQuantFoldable as exc:
        raise NotFoldable(str(exc), **exc.details) from None
    if quantized is not None:
        return quantized
    use = linear_use(node, site.output, where, NotFoldable, graph_outputs)
    if use is None:
        raise NotFoldable(f"{where} is not a linear op with a constant weight")
    weight, transpose, transposed = use.stored_weight(where, NotFoldable)
    stored = stored_initializer(weight, through=_WEIGHT_STORAGE_OPS)
    if stored is not None and stored_dtype_name(stored) not in _FOLDABLE_DTYPES:
        what = f"{where}: weight {stored.name!r} is stored as {stored_dtype_name(stored)}"
        raise NotFoldable(f"{what}: {_LAYER_QUANTIZED}" if site.kind == "layer"
                          else f"{what} (quantized or integer); never folded")
    constant = holding_constant(weight)
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
    channels = _effective_gain(site).size
    if shape[gain_axis] != channels:
        raise NotFoldable(f"{where}: weight shape {list(shape)} does not match {channels} channels")
    if site.kind == "layer":
        _check_bias(use, shape[1 - gain_axis], where)
    readers = [n for n in weight.outputs if n is not (transpose or node)]
    if transpose is not None:
        readers += [n for n in transpose.outputs[0].outputs if n is not node]
    shared_with = [f"{n.op} {n.name!r}" for n in readers]
    layer = site.kind == "layer"
    return FloatEdit(node, use.weight_index, weight, constant, shape, dtype, gain_axis, site.name, transpose,
                     shared_with, use=use, centre=layer,
                     layer_bias=np.asarray(site.bias, dtype=np.float64).reshape(-1)
                     if layer and site.bias is not None else None)


def _effective_gain(site: NormSite) -> np.ndarray:
    """The gain a fold multiplies in, float64 [K]: ones for a LayerNorm with a bias and no gain."""
    if site.gain is not None:
        return np.asarray(site.gain, dtype=np.float64).reshape(-1)
    return np.ones(site.bias.size, dtype=np.float64)


def _check_bias(use: LinearUse, columns: int, where: str) -> None:
    """The consumer's bias takes b·W: a constant of one value per output column (or one for all)."""
    if use.bias is None:
        return
    value = constant_value(use.bias)
    if value is None:
        raise NotFoldable(f"{where}: bias {use.bias.name!r} is not a constant")
    if value.ndim and value.shape[-1] not in (1, columns):
        raise NotFoldable(f"{where}: bias {use.bias.name!r} of shape {list(value.shape)} does not broadcast "
                          f"over {columns} output columns")


def _measure(site: NormSite, edit: FloatEdit) -> None:
    """Read a half weight once and measure (and bound) what folding does to it."""
    if edit.dtype.name not in HALF_DTYPES:
        return
    gain = _effective_gain(site)
    gain_shape = [1, 1]
    gain_shape[edit.gain_axis] = gain.size
    where = f"consumer {edit.node.op} {edit.node.name!r}"
    centre_axis = edit.gain_axis if site.kind == "layer" else None
    edit.rounding = measure_rounding(constant_array(edit.stored), gain.reshape(gain_shape), where, centre_axis)


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


def centring_scaler(gain: np.ndarray, axis: int) -> Callable[[np.ndarray], np.ndarray]:
    """The function that turns a weight W into W* = W · gain centred over `axis` (K: each
    output column minus its mean, so that 1ᵀW_c = 0), computed in float64 and rounded once, in
    half precision so that the rounded columns still sum to zero (`flashnorm.rounding`)."""
    def scale_and_centre(w: np.ndarray) -> np.ndarray:
        wide = w.astype(np.float64)
        np.multiply(wide, gain, out=wide)
        return round_centred(wide, axis, w.dtype)

    return scale_and_centre


def apply_fold(site: NormSite, edits: list[WeightEdit]) -> list[gs.Node]:
    """Apply each consumer's edit (new constants computed when they are saved or read; the old
    ones are left to whoever else reads them), then give the site a gain of ones (a LayerNorm also
    a bias of zeros). Returns the nodes the caller must add to the graph (a Transpose of an untied
    copy, a copied chain, a LayerNorm consumer's new bias Add)."""
    gain = _effective_gain(site)
    new_nodes = [node for edit in edits for node in edit.apply(gain)]
    if site.gain_node is not None:
        ones = np.ones(gain_slot_shape(site), dtype=site.gain_dtype)  # same shape: same broadcast
        site.gain_node.inputs[site.gain_index] = gs.Constant(f"{site.name}.flashnorm_unit_gain", ones)
    if site.bias_node is not None:
        zeros = np.zeros(bias_slot_shape(site), dtype=site.bias_dtype)
        site.bias_node.inputs[site.bias_index] = gs.Constant(f"{site.name}.flashnorm_zero_bias", zeros)
    return new_nodes


def _fold_bias(edit: FloatEdit) -> list[gs.Node]:
    """Give the consumer the bias c* = b·W + c (a Gemm: C' = β·C + α·b·W, β set to 1), computed
    in float64 from the weight as it is stored when saved or read; a MatMul without a bias gets
    an Add of it. Returns the nodes to add."""
    node, use = edit.node, edit.use
    bias = edit.layer_bias
    columns = edit.shape[1 - edit.gain_axis]
    c = None if use.bias is None else constant_value(use.bias)
    scale_c, scale_bw = 1.0, 1.0
    if node.op == "Gemm":
        scale_c, scale_bw = float(node.attrs.get("beta", 1.0)), float(node.attrs.get("alpha", 1.0))
    shape = (columns,) if c is None else np.broadcast_shapes(c.shape, (columns,))
    dtype = edit.dtype if c is None else c.dtype

    def biased(weight: np.ndarray) -> np.ndarray:
        bw = weight.astype(np.float64).T @ bias if edit.gain_axis == 0 else weight.astype(np.float64) @ bias
        total = scale_bw * bw if c is None else scale_c * c.astype(np.float64) + scale_bw * bw
        return np.broadcast_to(total, shape).astype(dtype)

    label = f"{use.output.name}.flashnorm_bias_for.{edit.label}"
    constant = gs.Constant(label, DerivedValues(edit.stored, biased, shape=shape, dtype=dtype))
    if node.op == "Gemm":
        if len(node.inputs) > 2:
            node.inputs[2] = constant
        else:
            node.inputs.append(constant)
        node.attrs["beta"] = 1.0
        return []
    if use.bias_add is not None:
        add = use.bias_add
        add.inputs[1 if add.inputs[0] is node.outputs[0] else 0] = constant
        return []
    product = node.outputs[0]
    unbiased = gs.Variable(f"{product.name}.flashnorm_unbiased", dtype=product.dtype, shape=product.shape)
    node.outputs[0] = unbiased
    return [gs.Node("Add", name=f"{label}.add", inputs=[unbiased, constant], outputs=[product])]


def fold(graph: gs.Graph, *, untie: bool = False, quant_limit: float = DEFAULT_QUANT_LIMIT,
         for_quantization: Optional[str] = None) -> tuple[gs.Graph, PassReport]:
    """Fold every foldable site's gain into its consumers' weights (quantized ones within
    `quant_limit`). With `for_quantization` (a `flashnorm.quantization_aware.FORMATS` name), only
    the sites the selection picks for that later quantizer; a graph already quantized is refused
    then (FlashNormError: the selection judges float weights a quantizer has yet to see)."""
    selection_rule = rule(for_quantization)
    report = PassReport("fold")
    graph_outputs = frozenset(t.name for t in graph.outputs)
    sites = find_norm_sites(graph)
    if selection_rule is not None:
        _refuse_quantized(sites, for_quantization)
    planned: list[tuple[NormSite, Optional[list[WeightEdit]], Optional[NotFoldable]]] = []
    for site in track(sites, "fold: sites checked", total=len(sites)):
        try:
            planned.append((site, plan_fold(site, graph_outputs, untie=untie, quant_limit=quant_limit), None))
        except NotFoldable as exc:
            planned.append((site, None, exc))
    kept: dict[str, str] = {}
    estimates: dict[str, float] = {}
    if selection_rule is not None:
        candidates = [Candidate(site.name, _effective_gain(site),
                                functools.partial(_float_weights, edits))
                      for site, edits, _ in planned if edits is not None]
        selection = selection_rule.select(track(candidates, f"fold: {for_quantization} error predicted",
                                                total=len(candidates)))
        kept, estimates = selection.kept, selection.estimates
    for site, edits, reason in planned:  # decisions in the order of the sites
        if reason is not None:
            report.add(site.name, "skipped", str(reason), **reason.details)
            continue
        if site.name in kept:
            report.add(site.name, "skipped", kept[site.name], predicted_error_ratio=estimates[site.name])
            continue
        graph.nodes.extend(apply_fold(site, edits))
        untied = [e.weight.name for e in edits if e.shared_with]
        rounding = site_rounding(edits)
        quantized = site_quant_error(edits)
        report.add(site.name, "folded", "", spelling=site.spelling, kind=site.kind, gain_convention=site.gain_convention,
                   consumers=[f"{e.node.op} {e.node.name}" for e in edits], untied=untied,
                   **({"rounding": rounding} if rounding else {}), **({"quantized": quantized} if quantized else {}),
                   **({"predicted_error_ratio": estimates[site.name]} if site.name in estimates else {}))
    graph.cleanup().toposort()
    return graph, report


def _float_weights(edits: list[WeightEdit]) -> list[tuple[np.ndarray, int]]:
    """What a later quantizer would quantize of a site's consumers (a prescale Mul's projection
    keeps its weight: the gain goes into the scale)."""
    return [weight for weight in (e.float_weight() for e in edits) if weight is not None]


def _refuse_quantized(sites: list[NormSite], for_quantization: str) -> None:
    """One line where a norm's consumer is quantized already: the selection predicts what a
    quantizer run after the fold does to float weights, and this graph has none to give it."""
    uses = [use for site in sites for node in site.consumers if (use := quantized_use(node, site.output))]
    if uses:
        raise FlashNormError(
            f"--for-quantization {for_quantization} selects the norms to fold before a quantizer runs, but the model "
            f"is quantized already ({len(uses)} of its norms' consumers, e.g. {uses[0].where} {uses[0].describe()}): "
            "fold it without --for-quantization (--quant-limit bounds requantization)")
