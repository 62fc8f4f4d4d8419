"""com.microsoft::MatMulNBits: y = A·dequant(B) (+ bias), B quantized in blocks of
`block_size` along K for each output channel n (onnxruntime-genai's and ORT's int4/int8 route).

Layout (ONNX Runtime contrib ops): B uint8 [N, n_blocks, blob_size], each block's `block_size`
codes packed low bits first (`bits` 2, 4 or 8), K padded to a whole block; scales [N·n_blocks]
or [N, n_blocks] in A's float type; zero_points optional, packed uint8 [N, ceil(n_blocks·bits/8)]
(flat or 2-D), or of the scales' type [N·n_blocks] (w = (q − zp)·s, zp not rounded), absent
meaning 2^(bits−1); g_idx (input 4) reorders K (act-order); bias
(input 5) is added after and does not see the gain.

A block spans block_size (≥ 16) input channels whose gains differ, so the fold is never exact
here: the target diag(g)·W is requantized per block (`requantize`), codes, scales and zero
points rewritten in place of the old ones, the node and its attributes unchanged.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from flashnorm.match.quantized import QuantizedUse
from flashnorm.match.queries import constant_array, numpy_dtype, stored_dtype_name
from flashnorm.passes.quantized.edit import LazyParts, NotQuantFoldable, QuantEdit
from flashnorm.passes.quantized.requantize import Grid, RequantizeError, error_from_sums, requantize

_SCALE_DTYPES = frozenset({"float32", "float16", "bfloat16"})


def _input(node: gs.Node, index: int):
    if len(node.inputs) > index and node.inputs[index].name:
        return node.inputs[index]
    return None


def _unpack(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """uint8 [..., B] → codes [..., count] (low bits first)."""
    per = 8 // bits
    shifts = (np.arange(per, dtype=np.uint8) * bits).astype(np.uint8)
    codes = (packed[..., None] >> shifts) & np.uint8((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per)[..., :count]


def _pack(codes: np.ndarray, bits: int, width: int) -> np.ndarray:
    """codes [..., C] (0 ≤ c < 2^bits) → uint8 [..., width] (padding codes 0)."""
    per = 8 // bits
    padded = np.zeros((*codes.shape[:-1], width * per), dtype=np.uint16)
    padded[..., :codes.shape[-1]] = codes
    padded = padded.reshape(*codes.shape[:-1], width, per) << (np.arange(per, dtype=np.uint16) * bits)
    return padded.sum(axis=-1).astype(np.uint8)


class _Layout:
    """A MatMulNBits node's weight tensors, checked against its attributes."""

    def __init__(self, use: QuantizedUse, where: str, hidden: int) -> None:
        node, attrs = use.node, use.node.attrs
        self.op = node.op
        try:
            self.k, self.n = int(attrs["K"]), int(attrs["N"])
            self.bits, self.block = int(attrs.get("bits", 4)), int(attrs["block_size"])
        except KeyError as exc:
            raise NotQuantFoldable(f"{where}: attribute {exc.args[0]} missing") from None
        if self.bits not in (2, 4, 8):
            raise NotQuantFoldable(f"{where}: bits={self.bits}; only 2, 4 and 8 are folded")
        if self.block < 16 or self.block & (self.block - 1):
            raise NotQuantFoldable(f"{where}: block_size {self.block} is not a power of 2 ≥ 16")
        if self.k != hidden:
            raise NotQuantFoldable(f"{where}: K={self.k} does not match the norm's {hidden} channels")
        if _input(node, 4) is not None:
            raise NotQuantFoldable(f"{where}: g_idx (act-order) reorders K; folding it is not supported")
        self.blocks = -(-self.k // self.block)
        self.blob = self.block * self.bits // 8
        self.b, self.scales, self.zero_points = use.codes, use.scales, use.zero_points
        for role, tensor in (("B", self.b), ("scales", self.scales), ("zero_points", self.zero_points)):
            if tensor is not None and not isinstance(tensor, gs.Constant):
                raise NotQuantFoldable(f"{where}: {role} {tensor.name!r} is not a constant initializer")
        if stored_dtype_name(self.b) != "uint8" or tuple(self.b.shape) != (self.n, self.blocks, self.blob):
            raise NotQuantFoldable(f"{where}: B is {stored_dtype_name(self.b)}{list(self.b.shape)}, expected "
                                   f"uint8[{self.n}, {self.blocks}, {self.blob}] for K={self.k}, block_size={self.block}")
        self.scale_dtype = numpy_dtype(self.scales.dtype)
        if stored_dtype_name(self.scales) not in _SCALE_DTYPES:
            raise NotQuantFoldable(f"{where}: scales are {stored_dtype_name(self.scales)}, not a float type")
        if int(np.prod(self.scales.shape)) != self.n * self.blocks or len(self.scales.shape) > 2:
            raise NotQuantFoldable(f"{where}: scales shape {list(self.scales.shape)} does not match N={self.n} × "
                                   f"{self.blocks} blocks of {self.block}")
        self.float_zero = False
        if self.zero_points is not None:
            zp_type = stored_dtype_name(self.zero_points)
            if zp_type == stored_dtype_name(self.scales):
                self.float_zero = True
                if int(np.prod(self.zero_points.shape)) != self.n * self.blocks or len(self.zero_points.shape) > 2:
                    raise NotQuantFoldable(f"{where}: zero_points shape {list(self.zero_points.shape)} does not match "
                                           f"N={self.n} × {self.blocks} blocks")
                return
            if zp_type != "uint8":
                raise NotQuantFoldable(f"{where}: zero points of type {zp_type}, neither packed uint8 nor the scales' "
                                       f"type {stored_dtype_name(self.scales)}")
            self.zp_width = -(-self.blocks * self.bits // 8)
            if int(np.prod(self.zero_points.shape)) != self.n * self.zp_width or len(self.zero_points.shape) > 2:
                raise NotQuantFoldable(f"{where}: zero_points shape {list(self.zero_points.shape)} does not match "
                                       f"N={self.n} × {self.zp_width} bytes")

    @property
    def format(self) -> str:
        zero = "asymmetric" if self.zero_points is not None else "symmetric"
        if self.float_zero:
            zero += " (float zero points)"
        return f"{self.op} uint{self.bits} block {self.block} {zero}, {stored_dtype_name(self.scales)} scales"

    def dequantized(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(W [N, blocks, block] float64 with K padding, scales [N, blocks] float64, zero points [N, blocks])."""
        codes = _unpack(constant_array(self.b), self.bits, self.block).astype(np.float64)
        scales = constant_array(self.scales).astype(np.float64).reshape(self.n, self.blocks)
        if self.zero_points is None:
            zeros = np.full((self.n, self.blocks), float(1 << (self.bits - 1)))
        elif self.float_zero:
            zeros = constant_array(self.zero_points).astype(np.float64).reshape(self.n, self.blocks)
        else:
            packed = constant_array(self.zero_points).reshape(self.n, self.zp_width)
            zeros = _unpack(packed, self.bits, self.blocks).astype(np.float64)
        return (codes - zeros[..., None]) * scales[..., None], scales, zeros

    def requantized(self, gain: np.ndarray) -> tuple[dict[str, np.ndarray], float, float, float, np.ndarray]:
        """(new B, scales, zero points as stored; Σ squared error; ‖T‖²; the original noise variance; clip ratios)."""
        weight, scales, _ = self.dequantized()
        padded = np.zeros(self.blocks * self.block)
        padded[:self.k] = gain
        padded = padded.reshape(self.blocks, self.block)
        target = weight * padded  # [N, blocks, block]
        own_variance = float(((scales ** 2) * (padded ** 2).sum(axis=1)).sum() / 12)
        grid = Grid.integer(self.bits, signed=False)
        result = requantize(target.reshape(-1, self.block), grid, self.scale_dtype,
                            free_zero_point=self.zero_points is not None, fixed_zero=1 << (self.bits - 1),
                            zero_dtype=self.scale_dtype if self.float_zero else None)
        codes = result.codes.reshape(self.n, self.blocks, self.block).astype(np.uint8)
        parts = {"B": _pack(codes, self.bits, self.blob),
                 "scales": result.scale.astype(self.scale_dtype).reshape(self.scales.shape)}
        if self.float_zero:
            parts["zero_points"] = result.zero_point.astype(self.scale_dtype).reshape(self.zero_points.shape)
        elif self.zero_points is not None:
            zeros = result.zero_point.reshape(self.n, self.blocks)
            parts["zero_points"] = _pack(zeros, self.bits, self.zp_width).reshape(self.zero_points.shape)
        return parts, float(result.squared_error.sum()), float((target ** 2).sum()), own_variance, result.ratio


def plan(use: QuantizedUse, activation: gs.Tensor, gain: np.ndarray) -> QuantEdit:
    """The requantizing fold of a MatMulNBits consumer (reads and requantizes its weight once to
    measure the error, keeping nothing), or NotQuantFoldable with the reason."""
    node, where = use.node, use.where
    if node.inputs[use.op.activation] is not activation or any(
            t is activation for i, t in enumerate(node.inputs) if i != use.op.activation):
        raise NotQuantFoldable(f"{where} does not read the normalized tensor as its input A only")
    layout = _Layout(use, where, gain.size)
    try:
        _, squared_error, squared_norm, own_variance, ratio = layout.requantized(gain)
    except RequantizeError as exc:
        raise NotQuantFoldable(f"{where}: {exc}") from None
    readers = {id(n): n for t in (layout.b, layout.scales, layout.zero_points) if t is not None
               for n in t.outputs if n is not node}
    shared = [f"{n.op} {n.name!r}" for n in readers.values()]
    row = use.op

    def write(folded_gain: np.ndarray) -> list[gs.Node]:
        parts = LazyParts(lambda: layout.requantized(folded_gain)[0])
        label = f"{layout.b.name}.folded_for.{activation.name}"
        node.inputs[row.codes] = parts.constant("B", layout.b, label, layout.b.shape, np.uint8)
        node.inputs[row.scales] = parts.constant("scales", layout.scales,
                                                 f"{layout.scales.name}.folded_for.{activation.name}",
                                                 layout.scales.shape, layout.scale_dtype)
        if layout.zero_points is not None:
            node.inputs[row.zero_points] = parts.constant("zero_points", layout.zero_points,
                                                          f"{layout.zero_points.name}.folded_for.{activation.name}",
                                                          layout.zero_points.shape,
                                                          layout.scale_dtype if layout.float_zero else np.uint8)
        return []

    error = error_from_sums(squared_error, squared_norm, own_variance, ratio)
    return QuantEdit(node, layout.b, layout.format, False, error, squared_norm, write, shared)
