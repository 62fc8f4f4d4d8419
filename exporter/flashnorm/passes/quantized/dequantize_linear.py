"""A MatMul/Gemm weight written by ONNX DequantizeLinear: W = (x − z)·s, per tensor, per axis or
in blocks (opset 21 block_size), codes int4, uint4, int8, uint8 or float8e4m3fn.

The weight may reach the projection as a [K, N] tensor, or as [N, K] behind Transpose([1, 0]) or
Gemm transB=1, with Cast/Identity between (ModelOpt casts to fp16). Which axis of the stored
codes runs over the norm's channels decides:

- every quantization group within one input channel (scale per K, blocks along N, block_size 1
  along K): exact, the scales take g (s' = s·g; where g < 0 the codes are negated when the
  format can hold the negation, otherwise the scale turns negative, reported);
- otherwise (per tensor, scale per output channel, blocks along K): the target diag(g)·W is
  requantized per group in the same format (`requantize`).

Fake quantization: codes written at run time by QuantizeLinear from a float initializer
(ModelOpt's weights; TensorRT folds the pair at build). The gain goes into the float
initializer, and the QuantizeLinear/DequantizeLinear scale is recomputed the way the
producer computes it: amax of |g·W| per group over the largest code (127, 7, 448).

The chain from the quantized codes to the projection (QuantizeLinear, DequantizeLinear, Cast,
Transpose) is copied for the folded consumer, so a tensor anyone else reads is never changed.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import onnx_graphsurgeon as gs

from flashnorm.match.projection import linear_use
from flashnorm.match.quantized import QuantizedUse
from flashnorm.match.queries import constant_array, holding_constant, numpy_dtype, producer, stored_dtype_name
from flashnorm.modelio.values import DerivedValues
from flashnorm.passes.quantized.edit import LazyParts, NotQuantFoldable, QuantEdit
from flashnorm.passes.quantized.requantize import (
    FP8_E4M3FN,
    FP8_MAX,
    Grid,
    RequantizeError,
    error_from_sums,
    fp8_round,
    fp8_ulp,
    requantize,
)

_CODE_TYPES = {"int4": (4, True), "uint4": (4, False), "int8": (8, True), "uint8": (8, False)}
_FP8_NAMES = frozenset({"float8e4m3fn", "float8_e4m3fn"})
_SCALE_DTYPES = frozenset({"float32", "float16", "bfloat16"})
_FLOAT_WEIGHTS = frozenset({"float32", "float16", "bfloat16", "float64"})
_PASS_THROUGH = frozenset({"Cast", "Identity", "Transpose"})


def _grid(type_name: str) -> Optional[Grid]:
    if type_name in _FP8_NAMES:
        return FP8_E4M3FN
    if type_name in _CODE_TYPES:
        return Grid.integer(*_CODE_TYPES[type_name])
    return None


def _code_dtype(type_name: str) -> np.dtype:
    import ml_dtypes

    return np.dtype({"int4": ml_dtypes.int4, "uint4": ml_dtypes.uint4, "int8": np.int8, "uint8": np.uint8,
                     "float8e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e4m3fn": ml_dtypes.float8_e4m3fn}[type_name])


@dataclasses.dataclass
class _Groups:
    """How a 2-D weight [A0, A1] splits into quantization groups, and the [G, L] view of it."""

    shape: tuple[int, int]
    scale_shape: tuple[int, ...]
    kind: str  # "tensor", "axis", "block"
    axis: int = 0
    block: int = 0

    def describe(self) -> str:
        if self.kind == "tensor":
            return "per-tensor"
        if self.kind == "axis":
            return f"per-axis({self.axis})"
        return f"blocked({self.axis}, {self.block})"

    def one_channel(self, gain_axis: int) -> bool:
        """Whether every group lies in one input channel (the exact case)."""
        if self.kind == "tensor":
            return self.shape[gain_axis] == 1
        if self.kind == "axis":
            return self.axis == gain_axis
        return self.axis != gain_axis or self.block == 1

    def full(self, per_group: np.ndarray) -> np.ndarray:
        """A scale-shaped array expanded to the weight's shape."""
        if self.kind == "tensor":
            return np.broadcast_to(per_group.reshape(1, 1), self.shape)
        if self.kind == "axis":
            return np.broadcast_to(per_group.reshape((-1, 1) if self.axis == 0 else (1, -1)), self.shape)
        return np.repeat(per_group, self.block, axis=self.axis)[:self.shape[0], :self.shape[1]]

    def to_groups(self, weight: np.ndarray) -> np.ndarray:
        if self.kind == "tensor":
            return weight.reshape(1, -1)
        if self.kind == "axis":
            return weight if self.axis == 0 else weight.T
        rows = weight.T if self.axis == 0 else weight  # [other, blocked axis]
        blocks = -(-rows.shape[1] // self.block)
        padded = np.zeros((rows.shape[0], blocks * self.block), dtype=weight.dtype)
        padded[:, :rows.shape[1]] = rows
        return padded.reshape(-1, self.block)

    def from_groups(self, groups: np.ndarray) -> np.ndarray:
        if self.kind == "tensor":
            return groups.reshape(self.shape)
        if self.kind == "axis":
            return groups if self.axis == 0 else groups.T
        other = self.shape[1 - self.axis]
        rows = groups.reshape(other, -1)[:, :self.shape[self.axis]]
        return rows.T if self.axis == 0 else rows

    def scale_to_groups(self, scale: np.ndarray) -> np.ndarray:
        return scale.T.reshape(-1) if self.kind == "block" and self.axis == 0 else scale.reshape(-1)

    def scale_from_groups(self, values: np.ndarray) -> np.ndarray:
        if self.kind == "block" and self.axis == 0:
            return values.reshape(self.scale_shape[1], self.scale_shape[0]).T
        return values.reshape(self.scale_shape)


def _layout(where: str, op: str, shape: tuple[int, int], scale_shape: tuple[int, ...], axis: int,
            block: int) -> _Groups:
    if block < 0:
        raise NotQuantFoldable(f"{where}: {op} block_size {block} is negative")
    if block == 0 and int(np.prod(scale_shape)) == 1 and len(scale_shape) <= 1:
        return _Groups(shape, scale_shape, "tensor")
    if block == 0:
        if scale_shape != (shape[axis],):
            raise NotQuantFoldable(f"{where}: scale shape {list(scale_shape)} does not match axis {axis} of the "
                                   f"weight {list(shape)}")
        return _Groups(shape, scale_shape, "axis", axis)
    expected = list(shape)
    expected[axis] = -(-shape[axis] // block)
    if list(scale_shape) != expected:
        raise NotQuantFoldable(f"{where}: scale shape {list(scale_shape)} does not match block_size {block} along axis "
                               f"{axis} of the weight {list(shape)} (expected {expected})")
    return _Groups(shape, scale_shape, "block", axis, block)


def plan(use: QuantizedUse, activation: gs.Tensor, gain: np.ndarray) -> QuantEdit:
    """The fold of a projection whose weight DequantizeLinear writes (`use.weight`, the
    recogniser's chain: DequantizeLinear, then Cast, Identity or Transpose); NotQuantFoldable
    with the reason when it cannot be folded."""
    node, where = use.node, use.where
    linear = linear_use(node, activation, where, NotQuantFoldable)
    chain, quantize, dq = list(use.weight.chain), use.weight.quantize, use.weight.dequantize
    if any(n.op not in _PASS_THROUGH for n in use.weight.between):  # a Reshape
        ops = " → ".join(n.op for n in chain)
        raise NotQuantFoldable(f"{where}: weight {use.weight.tensor.name!r} is dequantized through {ops}; only Cast, "
                               "Identity and Transpose([1, 0]) between it and the projection are folded")
    transposes = sum(n.op == "Transpose" for n in chain)
    if any(n.op == "Transpose" and list(n.attrs.get("perm", [1, 0])) != [1, 0] for n in chain):
        raise NotQuantFoldable(f"{where}: weight Transpose perm is not [1, 0]")
    transposed = (transposes % 2 == 1) != linear.trans_b
    codes, scale, zero = use.codes, holding_constant(use.scales), use.zero_points
    shape = tuple(int(d) for d in (getattr(codes, "shape", None) or ()))
    if len(shape) != 2 or any(d <= 0 for d in shape):
        raise NotQuantFoldable(f"{where}: quantized weight {codes.name!r} has shape {list(shape)}, not 2-D")
    gain_axis = 1 if transposed else 0
    if shape[gain_axis] != gain.size:
        raise NotQuantFoldable(f"{where}: weight shape {list(shape)} does not match {gain.size} channels")
    if scale is None:
        raise NotQuantFoldable(f"{where}: {dq.op} scale {use.scales.name!r} is not a constant")
    if stored_dtype_name(scale) not in _SCALE_DTYPES:
        raise NotQuantFoldable(f"{where}: {dq.op} scale is {stored_dtype_name(scale)}, not a float type")
    axis = use.weight.axis + 2 if use.weight.axis < 0 else use.weight.axis
    groups = _layout(where, dq.op, shape, tuple(int(d) for d in scale.shape), axis, use.weight.block_size)
    zero_constant = None
    if zero is not None:
        zero_constant = holding_constant(zero)
        if zero_constant is None:
            raise NotQuantFoldable(f"{where}: {dq.op} zero point {zero.name!r} is not a constant")
        if stored_dtype_name(zero_constant) != stored_dtype_name(codes):
            raise NotQuantFoldable(f"{where}: zero point of type {stored_dtype_name(zero_constant)}, the weight's codes "
                                   f"are {stored_dtype_name(codes)}")
        if tuple(int(d) for d in zero_constant.shape) != tuple(int(d) for d in scale.shape):
            raise NotQuantFoldable(f"{where}: zero point shape {list(zero_constant.shape)} differs from the scale's "
                                   f"{list(scale.shape)}")
    if quantize is not None:
        return _plan_fake(use, activation, gain, scale, zero_constant, groups, gain_axis, linear.weight_index)
    code_type = use.weight.code_type
    grid = _grid(code_type)
    if grid is None:
        raise NotQuantFoldable(f"{where}: {dq.op} codes of type {code_type or 'unknown'} are not folded "
                               "(int4, uint4, int8, uint8, float8e4m3fn are)")
    stored_codes = holding_constant(codes)
    if stored_codes is None:
        what = "a graph input" if producer(codes) is None else f"written by {producer(codes).op}"
        raise NotQuantFoldable(f"{where}: quantized weight {codes.name!r} is not a constant initializer ({what})")
    weight = _DQWeight(stored_codes, scale, zero_constant, grid, groups, gain_axis, code_type)
    label = f"{code_type} {groups.describe()}"
    try:
        parts, squared_error, squared_norm, own_variance, ratio, negative = weight.folded(gain)
    except RequantizeError as exc:
        raise NotQuantFoldable(f"{where}: {exc}") from None
    exact = groups.one_channel(gain_axis)
    error = error_from_sums(squared_error, squared_norm, own_variance, ratio)
    if exact:
        error = dataclasses.replace(error, noise_ratio=0.0)
    shared = _shared(chain, node, [stored_codes, scale, zero_constant])

    def write(folded_gain: np.ndarray) -> list[gs.Node]:
        lazy = LazyParts(lambda: weight.folded(folded_gain)[0])
        suffix = f"folded_for.{activation.name}"
        row = use.weight.op
        inputs = {row.codes: lazy.constant("codes", stored_codes, f"{stored_codes.name}.{suffix}", shape,
                                           _code_dtype(code_type)),
                  row.scales: lazy.constant("scale", scale, f"{scale.name}.{suffix}", scale.shape,
                                            numpy_dtype(scale.dtype))}
        if zero_constant is not None:
            inputs[row.zero_points] = lazy.constant("zero", zero_constant, f"{zero_constant.name}.{suffix}", zero_constant.shape,
                                      _code_dtype(code_type))
        return _copy_chain(chain, node, linear.weight_index, {id(dq): inputs}, suffix)

    edit = QuantEdit(node, stored_codes, f"{dq.op} {label}", exact, error, squared_norm, write, shared)
    if negative:
        edit.format += f", {negative} negative scales"
    return edit


@dataclasses.dataclass
class _DQWeight:
    codes: gs.Constant
    scale: gs.Constant
    zero: Optional[gs.Constant]
    grid: Grid
    groups: _Groups
    gain_axis: int
    code_type: str

    def folded(self, gain: np.ndarray):
        """(new codes/scale/zero as stored; Σ squared error; ‖T‖²; original noise variance; clip ratios; negative scales)."""
        codes = constant_array(self.codes).astype(np.float64)
        scale_stored = constant_array(self.scale)
        scale_dtype = scale_stored.dtype
        scale = scale_stored.astype(np.float64)
        zero = np.zeros(scale.shape) if self.zero is None else constant_array(self.zero).astype(np.float64)
        if self.grid.fp8 and np.any(zero != 0):
            raise RequantizeError("float8 zero points other than 0 are not folded")
        full_scale, full_zero = self.groups.full(scale), self.groups.full(zero)
        weight = (codes - full_zero) * full_scale
        g = gain.reshape((-1, 1) if self.gain_axis == 0 else (1, -1))
        target = weight * g
        step = np.abs(full_scale) * (fp8_ulp(codes) if self.grid.fp8 else 1.0)
        own_variance = float(((step * g) ** 2).sum() / 12)
        squared_norm = float((target ** 2).sum())
        if self.groups.one_channel(self.gain_axis):
            return self._exact(codes, scale, zero, scale_dtype, gain, target, squared_norm, own_variance)
        result = requantize(self.groups.to_groups(target), self.grid, scale_dtype,
                            free_zero_point=self.zero is not None and not self.grid.fp8)
        new_codes = self.groups.from_groups(result.codes.astype(np.float64))
        new_scale = self.groups.scale_from_groups(result.scale)
        parts = {"codes": new_codes.astype(_code_dtype(self.code_type)), "scale": new_scale.astype(scale_dtype)}
        if self.zero is not None:
            new_zero = (self.groups.scale_from_groups(result.zero_point.astype(np.float64))
                        if result.zero_point is not None else zero)
            parts["zero"] = new_zero.astype(_code_dtype(self.code_type))
        return parts, float(result.squared_error.sum()), squared_norm, own_variance, result.ratio, 0

    def _exact(self, codes, scale, zero, scale_dtype, gain, target, squared_norm, own_variance):
        """Every group in one input channel: the scales take g; rows with g < 0 negate their codes
        where the format holds the negation (fp8 always; integers around their zero point)."""
        g_shape = [1] * max(scale.ndim, 1)
        if self.groups.kind == "axis":
            g_shape = [-1]
        elif self.groups.kind == "block":
            g_shape = [-1, 1] if self.gain_axis == 0 else [1, -1]
        flip = np.zeros(gain.size, dtype=bool)
        new_codes = codes.copy()
        full_zero = self.groups.full(zero)
        for k in np.flatnonzero(gain < 0):
            row = (slice(k, k + 1), slice(None)) if self.gain_axis == 0 else (slice(None), slice(k, k + 1))
            if self.grid.fp8:
                new_codes[row] = -codes[row]
                flip[k] = True
                continue
            z = full_zero[row]
            negated = 2 * z - codes[row]
            if np.all((negated >= self.grid.qmin) & (negated <= self.grid.qmax)):
                new_codes[row] = negated
                flip[k] = True
        applied = np.where(flip, -gain, gain)
        with np.errstate(over="ignore"):
            new_scale = (scale * applied.reshape(g_shape)).astype(scale_dtype)
        if not np.all(np.isfinite(new_scale.astype(np.float64))):
            raise RequantizeError(f"s·g leaves {scale_dtype.name}'s range")
        values = (new_codes - self.groups.full(zero)) * self.groups.full(new_scale.astype(np.float64))
        parts = {"codes": new_codes.astype(_code_dtype(self.code_type)), "scale": new_scale}
        if self.zero is not None:
            parts["zero"] = constant_array(self.zero)
        negative = int(np.count_nonzero(new_scale.astype(np.float64) < 0))
        return parts, float(((values - target) ** 2).sum()), squared_norm, own_variance, np.ones(0), negative


def _shared(chain: list[gs.Node], node: gs.Node, constants: list) -> list[str]:
    """Readers outside this consumer's chain of the chain's inputs and intermediate tensors."""
    inside = {id(n) for n in chain} | {id(node)}
    tensors = [t for t in constants if t is not None] + [n.outputs[0] for n in chain]
    readers = {id(r): r for t in tensors for r in t.outputs if id(r) not in inside}
    return [f"{r.op} {r.name!r}" for r in readers.values()]


def _copy_chain(chain: list[gs.Node], node: gs.Node, weight_index: int,
                replaced: dict[int, dict[int, gs.Tensor]], suffix: str) -> list[gs.Node]:
    """Copies of the chain's nodes for this consumer (inputs replaced where given, by node id), the consumer
    reading the last copy; the originals stay for anyone else (cleanup removes them otherwise)."""
    new_nodes, previous = [], None
    for original in chain:
        inputs = list(original.inputs)
        if previous is not None:
            inputs[0] = previous
        for index, tensor in replaced.get(id(original), {}).items():
            inputs[index] = tensor
        output = original.outputs[0]
        previous = gs.Variable(f"{output.name}.{suffix}", dtype=output.dtype, shape=output.shape)
        new_nodes.append(gs.Node(original.op, name=f"{original.name}.{suffix}", domain=original.domain,
                                 attrs=dict(original.attrs), inputs=inputs, outputs=[previous]))
    node.inputs[weight_index] = previous
    return new_nodes


def _plan_fake(use: QuantizedUse, activation, gain, scale, zero, groups, gain_axis, linear_index) -> QuantEdit:
    """Fake quantization: float W → QuantizeLinear → DequantizeLinear. W takes the gain; the
    scale is recomputed from amax per group, as the producer computes it."""
    node, where, chain, quantize = use.node, use.where, list(use.weight.chain), use.weight.quantize
    dq = chain[0]
    source = holding_constant(use.weight.float_weight)
    if source is None:
        raise NotQuantFoldable(f"{where}: {quantize.op} input {use.weight.float_weight.name!r} is not a constant "
                               "initializer")
    if stored_dtype_name(source) not in _FLOAT_WEIGHTS:
        raise NotQuantFoldable(f"{where}: {quantize.op} input is {stored_dtype_name(source)}, not float")
    q_scale = holding_constant(use.weight.quantize_scales)
    same_layout = (int(quantize.attrs.get("axis", 1)) == int(dq.attrs.get("axis", 1))
                   and int(quantize.attrs.get("block_size", 0)) == int(dq.attrs.get("block_size", 0)))
    if q_scale is None or not same_layout or (q_scale is not scale and not np.array_equal(
            constant_array(q_scale), constant_array(scale))):
        raise NotQuantFoldable(f"{where}: {quantize.op} and {dq.op} disagree on the scale or its layout")
    q_zero = use.weight.quantize_zero_points
    q_zero_constant = holding_constant(q_zero) if q_zero is not None else None
    for z in (zero, q_zero_constant):
        if z is not None and np.any(constant_array(z).astype(np.float64) != 0):
            raise NotQuantFoldable(f"{where}: asymmetric fake quantization (zero point ≠ 0) is not folded")
    if q_zero is not None and q_zero_constant is None:
        raise NotQuantFoldable(f"{where}: {quantize.op} zero point {q_zero.name!r} is not a constant")
    code_type = use.weight.code_type
    grid = _grid(code_type)
    if grid is None or (not grid.fp8 and grid.qmin == 0):
        raise NotQuantFoldable(f"{where}: fake quantization to {code_type} is not folded (int4, int8 and "
                               "float8e4m3fn, symmetric, are)")
    weight = _FakeWeight(source, scale, grid, groups, gain_axis)
    try:
        parts, squared_error, squared_norm, own_variance = weight.folded(gain)
    except RequantizeError as exc:
        raise NotQuantFoldable(f"{where}: {exc}") from None
    exact = groups.one_channel(gain_axis)
    error = error_from_sums(squared_error, squared_norm, own_variance)
    # Scales per input channel: amax(|g·W|) = |g|·amax(|W|), the same codes up to ties and
    # saturation at the negative end, whose measured (tiny) error is reported as it is.
    shared = _shared([quantize, *chain], node, [source, scale, q_scale])
    fold_chain = [quantize, *chain]

    def write(folded_gain: np.ndarray) -> list[gs.Node]:
        suffix = f"folded_for.{activation.name}"
        g = folded_gain.reshape((-1, 1) if gain_axis == 0 else (1, -1))
        dtype = numpy_dtype(source.dtype)
        folded = gs.Constant(f"{source.name}.{suffix}", DerivedValues(
            source, lambda w: (w.astype(np.float64) * g).astype(dtype), dtype=dtype))
        lazy = LazyParts(lambda: {"scale": weight.folded(folded_gain)[0]["scale"]})
        new_scale = lazy.constant("scale", scale, f"{scale.name}.{suffix}", scale.shape, numpy_dtype(scale.dtype))
        replaced = {id(quantize): {0: folded, use.weight.quantize_op.scales: new_scale},
                    id(dq): {use.weight.op.scales: new_scale}}
        return _copy_chain(fold_chain, node, linear_index, replaced, suffix)

    return QuantEdit(node, source, f"{quantize.op}→{dq.op} {code_type} {groups.describe()} (fake quant)",
                     exact, error, squared_norm, write, shared)


@dataclasses.dataclass
class _FakeWeight:
    source: gs.Constant
    scale: gs.Constant
    grid: Grid
    groups: _Groups
    gain_axis: int

    def _quantized(self, weight: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        full = self.groups.full(scale)
        safe = np.where(full == 0, 1.0, full)
        if self.grid.fp8:
            codes = fp8_round(weight / safe)
        else:
            codes = np.clip(np.round(weight / safe), self.grid.qmin, self.grid.qmax)
        return codes, codes * full

    def folded(self, gain: np.ndarray):
        weight = constant_array(self.source).astype(np.float64)
        scale_stored = constant_array(self.scale)
        scale = scale_stored.astype(np.float64)
        g = gain.reshape((-1, 1) if self.gain_axis == 0 else (1, -1))
        codes, values = self._quantized(weight, scale)
        target = values * g
        step = np.abs(self.groups.full(scale)) * (fp8_ulp(codes) if self.grid.fp8 else 1.0)
        own_variance = float(((step * g) ** 2).sum() / 12)
        scaled = weight * g
        amax = np.abs(self.groups.to_groups(scaled)).max(axis=1)
        largest = FP8_MAX if self.grid.fp8 else float(self.grid.qmax)
        with np.errstate(over="ignore"):
            new_scale = self.groups.scale_from_groups(np.where(amax > 0, amax / largest, 1.0)).astype(scale_stored.dtype)
        if not np.all(np.isfinite(new_scale.astype(np.float64))):
            raise RequantizeError(f"amax(|g·W|) leaves {scale_stored.dtype.name}'s range")
        _, new_values = self._quantized(scaled, new_scale.astype(np.float64))
        return ({"scale": new_scale}, float(((new_values - target) ** 2).sum()), float((target ** 2).sum()),
                own_variance)
