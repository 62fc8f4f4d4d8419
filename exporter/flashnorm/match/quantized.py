"""Is this consumer quantized, how, and where are its codes, scales and zero points: the one
answer fold, defer, cancel, inspect, the quantized budget (validate/likelihood.py) and
fold-checkpoint share.

`QUANTIZED_OPS` is the table: one row per op type that ONNX Runtime or TensorRT runs on
quantized values, saying what it does with them (`role`), which of its inputs hold the
activation, the codes, the scales and the zero points, whether it is x·W in its activation
(cancel's positive homogeneity), and which module under `passes/quantized/` folds a gain into
it (`edit`; None: nothing does). A new quantized op is one row here.

Two spellings are not one op and are read from the graph around the consumer:

- a MatMul/Gemm weight written by a dequantizer (DequantizeLinear or TensorRT's), directly or
  through Cast, Identity, Transpose and Reshape, its codes stored (int4, uint4, int8, uint8,
  fp8; per tensor, per axis or blocked) or computed at run time by QuantizeLinear from a float
  initializer (fake quantization, as ModelOpt writes weights for TensorRT): `dequantized_weight`;
- a prescale Mul (ModelOpt's AWQ `pre_quant_scale`, SmoothQuant's smoothing scales) in front of
  a quantized consumer.

`quantized_use(node, tensor)` says how `node`, reading the normalized `tensor`, computes with
quantized values (None: it does not), where its codes, scales and zero points are, and why fold
or defer cannot take it, in one line each.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional

import onnx
import onnx_graphsurgeon as gs

from flashnorm.match.projection import LINEAR_OPS
from flashnorm.match.queries import holding_constant, onnx_to_numpy_dtype, producer, stored_dtype_name

# What an op does with quantized values (QuantizedOp.role).
WEIGHT = "weight"
"""Multiplies its float input by a weight it dequantizes itself."""
DYNAMIC = "dynamic"
"""Quantizes its float input at run time, then multiplies it by its quantized weight."""
INTEGER = "integer"
"""Computes on inputs that are already quantized (integer activations and weights)."""
QUANTIZE = "quantize"
"""Quantizes its input with a stored (static, calibrated) scale."""
DYNAMIC_QUANTIZE = "dynamic quantize"
"""Quantizes its input with a scale computed from it at run time."""
DEQUANTIZE = "dequantize"
"""Turns codes back into floats: (codes − zero point) · scale."""
GATHER = "gather"
"""Gathers rows of a quantized table (an embedding) and dequantizes them."""

# How a consumer of the normalized tensor computes with quantized values, beyond its op's role.
DEQUANTIZED_WEIGHT = "dequantized weight"
"""A MatMul/Gemm whose weight the graph dequantizes (`DequantizedWeight`)."""
PRESCALE = "prescale"
"""A Mul scaling the activation per channel in front of a quantized consumer."""


@dataclasses.dataclass(frozen=True)
class QuantizedOp:
    """One op type that runs on quantized values: what it does, and which inputs hold what."""

    role: str
    activation: Optional[int]
    """The input that reads the activation (float or already quantized); None: it reads none."""

    codes: Optional[int]
    """The input holding the quantized values (a weight's codes, or a dequantizer's input)."""

    scales: Optional[int]
    zero_points: Optional[int]
    bias: Optional[int] = None
    homogeneous: bool = False
    """y = x·W (+ bias) for a float x: positively homogeneous in x (cancel's test)."""

    edit: Optional[str] = None
    """The module under `passes/quantized/` that folds a gain into it; None: nothing does."""

    domain: str = ""
    """Where the op is defined: '' (ONNX), 'com.microsoft' (ONNX Runtime), 'trt' (TensorRT)."""


QUANTIZED_OPS: dict[str, QuantizedOp] = {
    # ONNX
    "QuantizeLinear": QuantizedOp(QUANTIZE, activation=0, codes=None, scales=1, zero_points=2),
    "DequantizeLinear": QuantizedOp(DEQUANTIZE, activation=None, codes=0, scales=1, zero_points=2,
                                    edit="dequantize_linear"),
    "DynamicQuantizeLinear": QuantizedOp(DYNAMIC_QUANTIZE, activation=0, codes=None, scales=None, zero_points=None),
    "MatMulInteger": QuantizedOp(INTEGER, activation=0, codes=1, scales=None, zero_points=3),
    "QLinearMatMul": QuantizedOp(INTEGER, activation=0, codes=3, scales=4, zero_points=5),
    # ONNX Runtime contrib ops (com.microsoft)
    "MatMulNBits": QuantizedOp(WEIGHT, activation=0, codes=1, scales=2, zero_points=3, bias=5, homogeneous=True,
                               edit="matmulnbits",
                               domain="com.microsoft"),
    "MatMulBnb4": QuantizedOp(WEIGHT, activation=0, codes=1, scales=2, zero_points=None, homogeneous=True,
                              domain="com.microsoft"),
    "DynamicQuantizeMatMul": QuantizedOp(DYNAMIC, activation=0, codes=1, scales=2, zero_points=3, bias=4,
                                         domain="com.microsoft"),
    "MatMulIntegerToFloat": QuantizedOp(INTEGER, activation=0, codes=1, scales=3, zero_points=5, bias=6,
                                        domain="com.microsoft"),
    "QGemm": QuantizedOp(INTEGER, activation=0, codes=3, scales=4, zero_points=5, bias=6, domain="com.microsoft"),
    "QAttention": QuantizedOp(INTEGER, activation=0, codes=1, scales=4, zero_points=7, bias=2, domain="com.microsoft"),
    "GatherBlockQuantized": QuantizedOp(GATHER, activation=None, codes=0, scales=2, zero_points=3,
                                        domain="com.microsoft"),
    # TensorRT's custom Q/DQ (ModelOpt writes them for fp8 and int4 engines)
    "TRT_FP8QuantizeLinear": QuantizedOp(QUANTIZE, activation=0, codes=None, scales=1, zero_points=None, domain="trt"),
    "TRT_FP8DequantizeLinear": QuantizedOp(DEQUANTIZE, activation=None, codes=0, scales=1, zero_points=None,
                                           domain="trt"),
    "TRT_INT4QuantizeLinear": QuantizedOp(QUANTIZE, activation=0, codes=None, scales=1, zero_points=None, domain="trt"),
    "TRT_INT4DequantizeLinear": QuantizedOp(DEQUANTIZE, activation=None, codes=0, scales=1, zero_points=None,
                                            domain="trt"),
}
"""Every op type that runs on quantized values, by name (domains differ, names do not collide)."""

QUANTIZED_STORAGE = frozenset({
    "int2", "uint2", "int4", "uint4", "int8", "uint8", "float4e2m1",
    "float8e4m3fn", "float8e4m3fnuz", "float8e5m2", "float8e5m2fnuz", "float8e8m0",
})
"""Element types a weight is stored in when it is quantized (ONNX's names without underscores)."""

# What may sit between a dequantizer and the projection without changing which values it reads.
_DEQUANTIZED_PASS_THROUGH = frozenset({"Cast", "Identity", "Transpose", "Reshape"})
_CHAIN_DEPTH = 8


def is_quantized_op(op_type: str) -> bool:
    return op_type in QUANTIZED_OPS


def is_quantized_storage(dtype_name: str) -> bool:
    """Whether a stored element type ('int8', 'float8_e4m3fn', 'float8e4m3fn', ...) is a quantized one."""
    return dtype_name.replace("_", "").lower() in QUANTIZED_STORAGE


def quantized_op_counts(op_types: Iterable[str]) -> dict[str, int]:
    """{op type: count} of the quantized ops among `op_types` (a model's nodes)."""
    counts: dict[str, int] = {}
    for op_type in op_types:
        if op_type in QUANTIZED_OPS:
            counts[op_type] = counts.get(op_type, 0) + 1
    return counts


def _input(node: gs.Node, index: Optional[int]) -> Optional[gs.Tensor]:
    if index is None or len(node.inputs) <= index or not node.inputs[index].name:
        return None
    return node.inputs[index]


def _named(node: gs.Node) -> str:
    return f"{node.op} {node.name!r}"


@dataclasses.dataclass(frozen=True)
class DequantizedWeight:
    """A weight the graph computes from quantized values: a dequantizer, then the pass-through
    ops between it and the tensor asked about."""

    tensor: gs.Tensor
    chain: tuple[gs.Node, ...]
    """The dequantizer first, then every node from it to `tensor`, in data order."""

    quantize: Optional[gs.Node] = None
    """The QuantizeLinear writing the dequantizer's codes at run time (fake quantization), else None."""

    @property
    def dequantize(self) -> gs.Node:
        return self.chain[0]

    @property
    def op(self) -> QuantizedOp:
        return QUANTIZED_OPS[self.dequantize.op]

    @property
    def codes(self) -> gs.Tensor:
        """The quantized values (for fake quantization, written at run time by `quantize`)."""
        return self.dequantize.inputs[self.op.codes]

    @property
    def scales(self) -> Optional[gs.Tensor]:
        return _input(self.dequantize, self.op.scales)

    @property
    def zero_points(self) -> Optional[gs.Tensor]:
        return _input(self.dequantize, self.op.zero_points)

    @property
    def quantize_op(self) -> Optional[QuantizedOp]:
        return QUANTIZED_OPS[self.quantize.op] if self.quantize is not None else None

    @property
    def quantize_scales(self) -> Optional[gs.Tensor]:
        """Fake quantization: the scales QuantizeLinear divides by."""
        return _input(self.quantize, self.quantize_op.scales) if self.quantize is not None else None

    @property
    def quantize_zero_points(self) -> Optional[gs.Tensor]:
        return _input(self.quantize, self.quantize_op.zero_points) if self.quantize is not None else None

    @property
    def float_weight(self) -> Optional[gs.Tensor]:
        """Fake quantization: the float tensor QuantizeLinear quantizes."""
        return _input(self.quantize, self.quantize_op.activation) if self.quantize is not None else None

    @property
    def between(self) -> tuple[gs.Node, ...]:
        """The pass-through nodes after the dequantizer."""
        return self.chain[1:]

    @property
    def axis(self) -> int:
        return int(self.dequantize.attrs.get("axis", 1))

    @property
    def block_size(self) -> int:
        return int(self.dequantize.attrs.get("block_size", 0))

    @property
    def code_type(self) -> str:
        """The codes' element type ('int4', 'float8e4m3fn', ...); for fake quantization the one
        QuantizeLinear writes (its zero point's, its output_dtype, else uint8 as ONNX says)."""
        if self.quantize is None:
            return stored_dtype_name(self.codes)
        zero = self.quantize_zero_points
        stored = holding_constant(zero) if zero is not None else None
        if stored is not None:
            return stored_dtype_name(stored)
        if int(self.quantize.attrs.get("output_dtype", 0)):
            return onnx.TensorProto.DataType.Name(int(self.quantize.attrs["output_dtype"])).lower()
        return "uint8"

    @property
    def written(self) -> str:
        """The float type the chain writes ('float32', 'float16', ...): the tensor's own when
        known, else the Cast nearest it, else the dequantizer's output_dtype or its scales' type."""
        if stored_dtype_name(self.tensor):
            return stored_dtype_name(self.tensor)
        casts = [n for n in self.between if n.op == "Cast"]
        if casts:
            return onnx_to_numpy_dtype(int(casts[-1].attrs["to"])).name
        output_dtype = int(self.dequantize.attrs.get("output_dtype", 0))
        if output_dtype:
            return onnx_to_numpy_dtype(output_dtype).name
        return stored_dtype_name(self.scales) if self.scales is not None else ""

    def __str__(self) -> str:
        if self.quantize is not None:
            return f"{self.quantize.op} → {self.dequantize.op} {self.code_type} → {self.written} (fake quantization)"
        return f"{self.dequantize.op} {self.code_type or 'codes'} → {self.written}"


def dequantized_weight(tensor: gs.Tensor) -> Optional[DequantizedWeight]:
    """How the graph dequantizes `tensor`: a dequantizer (DequantizeLinear or TensorRT's), then
    Cast, Identity, Transpose or Reshape; None when no dequantizer writes it that way."""
    chain: list[gs.Node] = []
    source = tensor
    for _ in range(_CHAIN_DEPTH):
        node = producer(source)
        if node is None:
            return None
        chain.insert(0, node)
        if node.op in QUANTIZED_OPS and QUANTIZED_OPS[node.op].role == DEQUANTIZE:
            writer = producer(node.inputs[QUANTIZED_OPS[node.op].codes])
            quantizes = writer is not None and writer.op in QUANTIZED_OPS and QUANTIZED_OPS[writer.op].role == QUANTIZE
            return DequantizedWeight(tensor, tuple(chain), writer if quantizes else None)
        if node.op not in _DEQUANTIZED_PASS_THROUGH:
            return None
        source = node.inputs[0]
    return None


@dataclasses.dataclass(frozen=True)
class QuantizedUse:
    """How one consumer of the normalized tensor computes with quantized values."""

    node: gs.Node
    kind: str
    """The op's role (WEIGHT, DYNAMIC, INTEGER, QUANTIZE, DYNAMIC_QUANTIZE, DEQUANTIZE, GATHER),
    or DEQUANTIZED_WEIGHT, or PRESCALE."""

    weight: Optional[DequantizedWeight] = None
    """DEQUANTIZED_WEIGHT: how the graph dequantizes the projection's weight."""

    behind: Optional["QuantizedUse"] = None
    """PRESCALE: the quantized consumer the Mul feeds."""

    @property
    def op(self) -> Optional[QuantizedOp]:
        """The consumer's own row (None for a MatMul/Gemm or a Mul)."""
        return QUANTIZED_OPS.get(self.node.op)

    @property
    def where(self) -> str:
        return f"consumer {_named(self.node)}"

    @property
    def codes(self) -> Optional[gs.Tensor]:
        if self.weight is not None:
            return self.weight.codes
        return _input(self.node, self.op.codes) if self.op else None

    @property
    def scales(self) -> Optional[gs.Tensor]:
        if self.weight is not None:
            return self.weight.scales
        return _input(self.node, self.op.scales) if self.op else None

    @property
    def zero_points(self) -> Optional[gs.Tensor]:
        if self.weight is not None:
            return self.weight.zero_points
        return _input(self.node, self.op.zero_points) if self.op else None

    @property
    def edit(self) -> Optional[str]:
        """The module under passes/quantized/ that folds a gain here, if any."""
        if self.kind == PRESCALE:
            return "prescale"
        if self.weight is not None:
            return self.weight.op.edit
        return self.op.edit if self.op else None

    def describe(self) -> str:
        """What the consumer does with quantized values, as a clause after `where`."""
        if self.kind == DEQUANTIZED_WEIGHT:
            return f"reads weight {self.weight.tensor.name!r}, dequantized in the graph ({self.weight})"
        if self.kind == PRESCALE:
            return f"scales the activation in front of a quantized projection: {self.behind.where} {self.behind.describe()}"
        codes = self.codes
        weight = f" {codes.name!r}" if codes is not None else ""
        return {
            WEIGHT: f"dequantizes its weight{weight} inside the op",
            DYNAMIC: f"quantizes the normalized activation at run time and multiplies it by its quantized weight{weight}",
            INTEGER: "computes on quantized activations and weights",
            QUANTIZE: "quantizes the normalized activation with a static scale calibrated on x̂·g",
            DYNAMIC_QUANTIZE: ("quantizes the normalized activation with a scale computed at run time, for "
                               f"{self._readers()}"),
            DEQUANTIZE: "dequantizes the normalized tensor as if it held codes",
            GATHER: "gathers rows of a quantized table",
        }[self.kind]

    def _readers(self) -> str:
        readers = [n for out in self.node.outputs[:1] for n in out.outputs]
        return ", ".join(_named(n) for n in readers) or "no reader"

    def fold_reason(self) -> str:
        """Why no fold edit takes this consumer (its `edit`, where there is one, decides for itself)."""
        what = f"{self.where} {self.describe()}"
        if self.kind == QUANTIZE:
            return f"{what}; folding would change the range it was calibrated for (route: fold first, then quantize)"
        if self.kind in (DYNAMIC, DYNAMIC_QUANTIZE):
            return (f"{what}, whose quantized weights would have to take the gain along K; not folded "
                    "(route: fold first, then quantize)")
        if self.kind == PRESCALE:
            return f"{self.where} scales the activation by a non-constant in front of a quantized projection; not folded"
        if self.kind in (WEIGHT, DEQUANTIZED_WEIGHT):
            return f"{what}; no fold edit reads this format (fold needs dequantize → fold → requantize)"
        return f"{what}; not folded"

    def defer_reason(self) -> Optional[str]:
        """Why the plugin cannot replace this consumer (it takes float activations and float
        weights), or None: a weight the graph dequantizes is a float tensor the node can read."""
        if self.kind == DEQUANTIZED_WEIGHT:
            return None
        if self.kind in (WEIGHT, DYNAMIC):
            return f"{self.where} dequantizes its weight inside the op; the plugin takes float weights (defer does not apply)"
        if self.kind in (QUANTIZE, DYNAMIC_QUANTIZE):
            when = " at run time" if self.kind == DYNAMIC_QUANTIZE else ""
            return (f"{self.where} quantizes the normalized activation{when}; the plugin reads it in float "
                    "(defer does not apply)")
        if self.kind == PRESCALE:
            inner = self.behind.defer_reason() or f"{self.behind.where} {self.behind.describe()}"
            return f"{self.where} scales the activation in front of a quantized projection: {inner}"
        return f"{self.where} {self.describe()}; the plugin takes float activations and weights (defer does not apply)"


def quantized_use(node: gs.Node, tensor: gs.Tensor) -> Optional[QuantizedUse]:
    """How `node`, reading `tensor` (the normalized activation), computes with quantized values;
    None when it does not (a float projection, or anything else)."""
    row = QUANTIZED_OPS.get(node.op)
    if row is not None:
        return QuantizedUse(node, row.role)
    if node.op in LINEAR_OPS:
        weights = [t for t in node.inputs[1:2] if t is not tensor]
        weight = dequantized_weight(weights[0]) if weights else None
        return QuantizedUse(node, DEQUANTIZED_WEIGHT, weight=weight) if weight is not None else None
    if node.op == "Mul" and len(node.outputs[0].outputs) == 1:  # a per-channel prescale (AWQ, SmoothQuant)
        behind = quantized_use(node.outputs[0].outputs[0], node.outputs[0])
        return QuantizedUse(node, PRESCALE, behind=behind) if behind is not None else None
    return None


__all__ = [
    "DEQUANTIZE", "DEQUANTIZED_WEIGHT", "DYNAMIC", "DYNAMIC_QUANTIZE", "DequantizedWeight", "GATHER", "INTEGER",
    "PRESCALE", "QUANTIZE", "QUANTIZED_OPS", "QUANTIZED_STORAGE", "QuantizedOp", "QuantizedUse", "WEIGHT",
    "dequantized_weight", "is_quantized_op", "is_quantized_storage", "quantized_op_counts",
    "quantized_use",
]
