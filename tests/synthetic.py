"""Small ONNX graphs, built with onnx.helper, for every RMSNorm and LayerNorm spelling FlashNorm
matches.

Each builder returns a shape-inferred `onnx.ModelProto` whose graph input `x` is normalized
by one spelling and read by linear projections. Gains are random with some negative values;
LayerNorm biases are drawn away from 0. Other test modules import `build_norm_model`,
`build_attention_block`, `SPELLINGS` (`SPELLING_KIND` says which are LayerNorms), `run`, and
`float64_model` (a float64 copy of a model, for reference runs).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


class GraphBuilder:
    """Collects nodes and initializers; every helper returns the name of its output."""

    def __init__(self, opset: int = 17) -> None:
        self.opset = opset
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._count = 0

    def name(self, prefix: str) -> str:
        self._count += 1
        return f"{prefix}_{self._count}"

    def const(self, value: np.ndarray, prefix: str = "c") -> str:
        name = self.name(prefix)
        self.initializers.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def op(self, op_type: str, inputs: Sequence[str], outputs: int = 1, domain: str = "", **attrs) -> str | list[str]:
        names = [self.name(op_type.lower()) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), names, name=self.name(op_type), domain=domain, **attrs))
        return names[0] if outputs == 1 else names

    def model(self, inputs: list[onnx.ValueInfoProto], outputs: Sequence[str],
              output_type: int = TensorProto.FLOAT) -> onnx.ModelProto:
        graph = helper.make_graph(
            self.nodes, "synthetic", inputs,
            [helper.make_tensor_value_info(o, output_type, None) for o in outputs],
            self.initializers,
        )
        opsets = [helper.make_opsetid("", self.opset), helper.make_opsetid("com.microsoft", 1)]
        model = helper.make_model(graph, opset_imports=opsets)
        model.ir_version = 10
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
        # Graph outputs carry the inferred type (ORT needs it for its output bindings).
        by_name = {v.name: v for v in inferred.graph.value_info}
        for output in inferred.graph.output:
            if output.name in by_name:
                output.CopyFrom(by_name[output.name])
        # Contrib ops have no shape inference: give their outputs a symbolic shape of the rank
        # ONNX Runtime produces (the ONNX checker requires a shape on every graph output).
        missing = [o for o in inferred.graph.output if not o.type.tensor_type.HasField("shape")]
        if missing and output_type != TensorProto.FLOAT:  # half contrib ops: the shape of `x`
            rank = len(inputs[0].type.tensor_type.shape.dim)
            for output in missing:
                dims = [f"{output.name}_{i}" for i in range(rank)]
                output.CopyFrom(helper.make_tensor_value_info(output.name, output_type, dims))
        elif missing:
            results = dict(zip([o.name for o in inferred.graph.output],
                               run(inferred, feeds(inferred, np.random.default_rng()))))
            for output in missing:
                dims = [f"{output.name}_{i}" for i in range(results[output.name].ndim)]
                output.CopyFrom(helper.make_tensor_value_info(output.name, TensorProto.FLOAT, dims))
        return inferred


def random_gain(rng: np.random.Generator, hidden: int) -> np.ndarray:
    """Gains around 1 with spread, every 7th negative (trained gains have negative entries)."""
    gain = rng.normal(1.0, 0.5, hidden)
    gain[:: 7] = -np.abs(gain[:: 7]) - 0.1
    return gain.astype(np.float32)


def random_bias(rng: np.random.Generator, hidden: int) -> np.ndarray:
    """LayerNorm biases away from 0: magnitudes around 0.5, either sign."""
    return (rng.normal(0.0, 0.2, hidden) + rng.choice([-0.5, 0.5], hidden)).astype(np.float32)


# ── spellings: (builder, x name, gain or None, eps[, bias]) → normalized output name ─────────

def _finish_gain(b: GraphBuilder, y: str, gain: Optional[np.ndarray], gain_first: bool = False) -> str:
    if gain is None:
        return y
    g = b.const(gain, "gain")
    return b.op("Mul", [g, y] if gain_first else [y, g])


def pow_div(b, x, gain, eps):
    sq = b.op("Pow", [x, b.const(np.array(2.0, np.float32))])
    ms = b.op("ReduceMean", [sq], axes=[-1], keepdims=1)
    rms = b.op("Sqrt", [b.op("Add", [ms, b.const(np.array(eps, np.float32))])])
    return _finish_gain(b, b.op("Div", [x, rms]), gain)


def mul_reciprocal(b, x, gain, eps):
    sq = b.op("Mul", [x, x])
    ms = b.op("ReduceMean", [sq], axes=[-1])
    rms = b.op("Sqrt", [b.op("Add", [b.const(np.array(eps, np.float32)), ms])])
    y = b.op("Mul", [b.op("Reciprocal", [rms]), x])
    return _finish_gain(b, y, gain, gain_first=True)


def legacy_torch(b, x, gain, eps):
    """torch.onnx legacy exporter (SmolLM2): Cast→Pow→ReduceMean→Add→Sqrt→Div(1,·)→Mul(x,·)→Cast→Mul(gain,·).
    The caller makes the first Cast's output also feed a residual Add."""
    sq = b.op("Pow", [x, b.const(np.array(2.0, np.float32))])
    ms = b.op("ReduceMean", [sq], axes=[-1], keepdims=1)
    rms = b.op("Sqrt", [b.op("Add", [ms, b.const(np.array(eps, np.float32))])])
    inv = b.op("Div", [b.const(np.array(1.0, np.float32)), rms])
    y = b.op("Cast", [b.op("Mul", [x, inv])], to=TensorProto.FLOAT)
    return _finish_gain(b, y, gain, gain_first=True)


def axes_input(b, x, gain, eps):
    """Opset ≥ 18: ReduceMean takes its axes as an input."""
    sq = b.op("Pow", [x, b.const(np.array(2.0, np.float32))])
    ms = b.op("ReduceMean", [sq, b.const(np.array([-1], np.int64))], keepdims=1)
    rms = b.op("Sqrt", [b.op("Add", [ms, b.const(np.array(eps, np.float32))])])
    return _finish_gain(b, b.op("Div", [x, rms]), gain)


def pow_rsqrt(b, x, gain, eps):
    sq = b.op("Mul", [x, x])
    ms = b.op("ReduceMean", [sq], axes=[-1])
    inv = b.op("Pow", [b.op("Add", [ms, b.const(np.array(eps, np.float32))]), b.const(np.array(-0.5, np.float32))])
    return _finish_gain(b, b.op("Mul", [x, inv]), gain)


def cast_gain(b, x, gain, eps):
    """Gain stored as fp16 and Cast to the activation dtype; casts around the division."""
    xc = b.op("Cast", [x], to=TensorProto.FLOAT)
    sq = b.op("Pow", [xc, b.const(np.array(2.0, np.float32))])
    ms = b.op("ReduceMean", [sq], axes=[-1])
    rms = b.op("Sqrt", [b.op("Add", [ms, b.const(np.array(eps, np.float32))])])
    y = b.op("Cast", [b.op("Div", [xc, rms])], to=TensorProto.FLOAT)
    if gain is None:
        return y
    g = b.op("Cast", [b.const(gain.astype(np.float16), "gain")], to=TensorProto.FLOAT)
    return b.op("Cast", [b.op("Mul", [y, g])], to=TensorProto.FLOAT)


def constant_node_gain(b, x, gain, eps):
    sq = b.op("Pow", [x, b.const(np.array(2.0, np.float32))])
    ms = b.op("ReduceMean", [sq], axes=[-1])
    rms = b.op("Sqrt", [b.op("Add", [ms, b.const(np.array(eps, np.float32))])])
    y = b.op("Div", [x, rms])
    if gain is None:
        return y
    g = b.op("Constant", [], value=numpy_helper.from_array(gain, "gain_value"))
    return b.op("Mul", [y, g])


def gemma_add_one(b, x, gain, eps):
    """Gemma's (1+w) gain computed in the graph: Add(w, 1); `gain` is the effective 1+w."""
    sq = b.op("Pow", [x, b.const(np.array(2.0, np.float32))])
    ms = b.op("ReduceMean", [sq], axes=[-1])
    inv = b.op("Reciprocal", [b.op("Sqrt", [b.op("Add", [ms, b.const(np.array(eps, np.float32))])])])
    y = b.op("Mul", [x, inv])
    if gain is None:
        return y
    w = b.const((gain - 1.0).astype(np.float32), "gemma_w")
    g = b.op("Add", [w, b.const(np.array(1.0, np.float32))])
    return b.op("Mul", [y, g])


def _finish_bias(b: GraphBuilder, y: str, bias: Optional[np.ndarray], bias_first: bool = False) -> str:
    if bias is None:
        return y
    c = b.const(bias, "ln_bias")
    return b.op("Add", [c, y] if bias_first else [y, c])


def ln_decomposed(b, x, gain, eps, bias=None):
    """torch.onnx below opset 17 (fp32): ReduceMean→Sub→Pow→ReduceMean→Add eps→Sqrt→Div→Mul g→Add b."""
    centred = b.op("Sub", [x, b.op("ReduceMean", [x], axes=[-1], keepdims=1)])
    var = b.op("ReduceMean", [b.op("Pow", [centred, b.const(np.array(2.0, np.float32))])], axes=[-1], keepdims=1)
    std = b.op("Sqrt", [b.op("Add", [var, b.const(np.array(eps, np.float32))])])
    return _finish_bias(b, _finish_gain(b, b.op("Div", [centred, std]), gain), bias)


def ln_decomposed_cast(b, x, gain, eps, bias=None):
    """torch.onnx below opset 17 for a half model: the centred input Cast to double for the
    variance and the division, Cast back (to the builder's `activation` type) before the gain."""
    centred = b.op("Sub", [x, b.op("ReduceMean", [x], axes=[-1], keepdims=1)])
    wide = b.op("Cast", [centred], to=TensorProto.DOUBLE)
    var = b.op("ReduceMean", [b.op("Pow", [wide, b.const(np.array(2.0, np.float64))])], axes=[-1], keepdims=1)
    std = b.op("Sqrt", [b.op("Add", [var, b.const(np.array(eps, np.float64))])])
    y = b.op("Cast", [b.op("Div", [wide, std])], to=getattr(b, "activation", TensorProto.FLOAT))
    return _finish_bias(b, _finish_gain(b, y, gain), bias)


def ln_reciprocal(b, x, gain, eps, bias=None):
    """Mul(d, d) for the square, eps first, Reciprocal·Mul; gain and bias as first operands."""
    centred = b.op("Sub", [x, b.op("ReduceMean", [x], axes=[-1])])
    var = b.op("ReduceMean", [b.op("Mul", [centred, centred])], axes=[-1])
    inv = b.op("Reciprocal", [b.op("Sqrt", [b.op("Add", [b.const(np.array(eps, np.float32)), var])])])
    y = b.op("Mul", [inv, centred])
    return _finish_bias(b, _finish_gain(b, y, gain, gain_first=True), bias, bias_first=True)


def ln_rsqrt_axes_input(b, x, gain, eps, bias=None):
    """Opset ≥ 18: ReduceMean's axes as an input; 1/σ as Pow(·, -0.5)·Mul."""
    axes = b.const(np.array([-1], np.int64))
    centred = b.op("Sub", [x, b.op("ReduceMean", [x, axes], keepdims=1)])
    var = b.op("ReduceMean", [b.op("Pow", [centred, b.const(np.array(2.0, np.float32))]), axes], keepdims=1)
    inv = b.op("Pow", [b.op("Add", [var, b.const(np.array(eps, np.float32))]), b.const(np.array(-0.5, np.float32))])
    return _finish_bias(b, _finish_gain(b, b.op("Mul", [centred, inv]), gain), bias)


def layer_normalization(b, x, gain, eps, bias=None):
    """Opset 17: LayerNormalization(x, scale[, B]) over the last axis."""
    hidden = len(gain) if gain is not None else len(bias) if bias is not None else None
    scale = gain if gain is not None else np.ones(hidden or 0, np.float32)
    inputs = [x, b.const(scale, "gain")] + ([b.const(bias, "ln_bias")] if bias is not None else [])
    return b.op("LayerNormalization", inputs, axis=-1, epsilon=eps)


def skip_layer_normalization(b, x, gain, eps, bias=None):
    """ONNX Runtime's SkipLayerNormalization(x, skip, gamma[, beta]); the sum output is also a
    graph output."""
    inputs = [x, "skip", b.const(gain if gain is not None else np.ones(len(bias), np.float32), "gain")]
    if bias is not None:
        inputs.append(b.const(bias, "ln_bias"))
    y, _, _, total = b.op("SkipLayerNormalization", inputs, outputs=4, domain="com.microsoft", epsilon=eps)
    b.residual_output = total
    return y


def rms_normalization(b, x, gain, eps):
    b.opset = max(b.opset, 23)
    scale = gain if gain is not None else np.ones(0, np.float32)
    return b.op("RMSNormalization", [x, b.const(scale, "gain")], axis=-1, epsilon=eps)


def simplified_layernorm(b, x, gain, eps):
    return b.op("SimplifiedLayerNormalization", [x, b.const(gain, "gain")], axis=-1, epsilon=eps)


def skip_simplified_layernorm(b, x, gain, eps):
    """The residual `skip` is a second graph input; the sum output is also a graph output."""
    y, _, _, total = b.op("SkipSimplifiedLayerNormalization", [x, "skip", b.const(gain, "gain")],
                          outputs=4, domain="com.microsoft", epsilon=eps)
    b.residual_output = total
    return y


SPELLINGS: dict[str, Callable] = {
    "pow_div": pow_div,
    "mul_reciprocal": mul_reciprocal,
    "legacy_torch": legacy_torch,
    "axes_input": axes_input,
    "pow_rsqrt": pow_rsqrt,
    "cast_gain": cast_gain,
    "constant_node_gain": constant_node_gain,
    "gemma_add_one": gemma_add_one,
    "gemma_folded": pow_div,  # the 1+w gain already folded into one constant
    "rms_normalization": rms_normalization,
    "simplified_layernorm": simplified_layernorm,
    "skip_simplified_layernorm": skip_simplified_layernorm,
    "ln_decomposed": ln_decomposed,
    "ln_decomposed_cast": ln_decomposed_cast,
    "ln_reciprocal": ln_reciprocal,
    "ln_rsqrt_axes_input": ln_rsqrt_axes_input,
    "layer_normalization": layer_normalization,
    "skip_layer_normalization": skip_layer_normalization,
}
SPELLING_FAMILY = {
    "rms_normalization": "RMSNormalization",
    "simplified_layernorm": "SimplifiedLayerNormalization",
    "skip_simplified_layernorm": "SkipSimplifiedLayerNormalization",
    "layer_normalization": "LayerNormalization",
    "skip_layer_normalization": "SkipLayerNormalization",
}
SPELLING_KIND = {name: "layer" if name.startswith(("ln_", "layer_", "skip_layer_")) else "rms" for name in SPELLINGS}
# torch.onnx writes the decomposed LayerNorm below opset 17; the models it writes are at 14.
OPSET = {"axes_input": 18, "rms_normalization": 23, "ln_decomposed": 14, "ln_decomposed_cast": 14,
         "ln_reciprocal": 14, "ln_rsqrt_axes_input": 18}
SKIP_SPELLINGS = frozenset({"skip_simplified_layernorm", "skip_layer_normalization"})
# Consumer layouts: how the normalized tensor reaches the projection weights.
CONSUMERS = ("matmul", "qkv", "transposed", "gemm", "biased")


def _gain_for(spelling: str, rng: np.random.Generator, hidden: int) -> np.ndarray:
    if spelling.startswith("gemma"):
        w = rng.normal(0.0, 0.3, hidden)
        w[:: 5] = -1.0 - np.abs(w[:: 5])  # 1+w < 0 at every 5th channel
        return (1.0 + w).astype(np.float32)
    return random_gain(rng, hidden)


def _projections(b: GraphBuilder, y: str, consumer: str, rng: np.random.Generator, hidden: int,
                 widths: Sequence[int] = (48, 16, 16), dtype: np.dtype = np.dtype(np.float32)) -> list[str]:
    """Linear consumers of `y` with weights (and biases) in `dtype`: each output is a graph output."""
    def weight(k, n):
        return (rng.standard_normal((k, n)) / np.sqrt(k)).astype(dtype)

    if consumer == "matmul":
        return [b.op("MatMul", [y, b.const(weight(hidden, widths[0]), "w")])]
    if consumer == "qkv":
        return [b.op("MatMul", [y, b.const(weight(hidden, n), "w")]) for n in widths]
    if consumer == "transposed":  # HF nn.Linear layout [N, K] behind a Transpose
        w = b.op("Transpose", [b.const(weight(widths[0], hidden), "w")], perm=[1, 0])
        return [b.op("MatMul", [y, w])]
    if consumer == "gemm":  # 2-D activations, Gemm transB=1 with beta·C; Gemm transB=0 with alpha
        bias = rng.standard_normal(widths[0]).astype(dtype)
        return [
            b.op("Gemm", [y, b.const(weight(widths[0], hidden), "w"), b.const(bias, "bias")], transB=1, beta=1.5),
            b.op("Gemm", [y, b.const(weight(hidden, widths[1]), "w")], alpha=0.5),
        ]
    if consumer == "biased":  # MatMul + Add of a constant [N] vector, either operand order
        products = [b.op("MatMul", [y, b.const(weight(hidden, n), "w")]) for n in widths]
        biases = [b.const(rng.standard_normal(n).astype(dtype), "bias") for n in widths]
        return [b.op("Add", [p, c] if i % 2 == 0 else [c, p]) for i, (p, c) in enumerate(zip(products, biases))]
    raise ValueError(f"unknown consumer layout {consumer!r}; known: {CONSUMERS}")


def build_norm_model(spelling: str, rng: np.random.Generator, *, consumer: str = "qkv", hidden: int = 32,
                     eps: float = 1e-5, weightless: bool = False, rank: int = 3) -> onnx.ModelProto:
    """`x` → norm(spelling) → projections. rank 4 is a per-head layout [B, S, H, D]."""
    b = GraphBuilder(OPSET.get(spelling, 17))
    b.residual_output = None
    if consumer == "gemm":
        rank = 2
    dims = {2: ["tokens"], 3: ["batch", "seq"], 4: ["batch", "seq", 4]}[rank]
    x_info = helper.make_tensor_value_info("x", TensorProto.FLOAT, dims + [hidden])
    inputs = [x_info]
    gain = None if weightless else _gain_for(spelling, rng, hidden)
    layer = {} if SPELLING_KIND[spelling] == "rms" else {"bias": None if weightless else random_bias(rng, hidden)}
    if layer and weightless and spelling in SPELLING_FAMILY:
        gain = np.ones(hidden, np.float32)  # the fused LayerNorms require a scale
    x, outputs = "x", []
    if spelling == "legacy_torch":  # the first Cast feeds the norm and the residual Add
        x = b.op("Cast", ["x"], to=TensorProto.FLOAT)
    if spelling in SKIP_SPELLINGS:
        inputs.append(helper.make_tensor_value_info("skip", TensorProto.FLOAT, dims + [hidden]))
    y = SPELLINGS[spelling](b, x, gain, eps, **layer)
    outputs += _projections(b, y, consumer, rng, hidden)
    if spelling == "legacy_torch":
        outputs.append(b.op("Add", [x, b.op("MatMul", [outputs[0], b.const(
            (rng.standard_normal((48, hidden)) / 7).astype(np.float32), "w_o")])]))
    if b.residual_output is not None:
        outputs.append(b.residual_output)
    return b.model(inputs, outputs)


HALF_TYPES = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16, "float32": TensorProto.FLOAT}
GAIN_STYLES = ("half", "cast", "fp32")
"""Where a half-precision graph applies the gain: 'half' Mul by a gain stored in the half type
after the Cast down (transformers' Llama); 'cast' the same with an fp32 gain Cast to the half
type; 'fp32' Mul in fp32 before the Cast down (Gemma's (1+w.float()), the spelling's own gain)."""


def half_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def build_half_norm_model(spelling: str, seed: int, dtype: str, *, gain_style: str = "half", consumer: str = "qkv",
                          hidden: int = 32, eps: float = 1e-5, widths: Sequence[int] = (48, 16, 16)) -> onnx.ModelProto:
    """`x` (in `dtype`) → RMSNorm computed in fp32 (Cast up, the spelling, Cast down; a fused
    spelling takes the half tensor itself) → projections with `dtype` weights. The same seed
    gives the same values for every dtype: `dtype='float32'` is the fp32 original of the
    half-precision graphs (its Casts are no-ops)."""
    rng = np.random.default_rng(seed)
    kind, numpy_type = HALF_TYPES[dtype], half_dtype(dtype)
    b = GraphBuilder(OPSET.get(spelling, 17))
    b.residual_output = None
    rank = 2 if consumer == "gemm" else 3
    dims = {2: ["tokens"], 3: ["batch", "seq"]}[rank]
    inputs = [helper.make_tensor_value_info("x", kind, dims + [hidden])]
    gain = _gain_for(spelling, rng, hidden)
    if spelling in SPELLING_FAMILY:  # fused: the node reads the half tensor and computes in fp32
        if spelling == "skip_simplified_layernorm":
            inputs.append(helper.make_tensor_value_info("skip", kind, dims + [hidden]))
            y, _, _, b.residual_output = b.op("SkipSimplifiedLayerNormalization", ["x", "skip", b.const(
                gain.astype(numpy_type), "gain")], outputs=4, domain="com.microsoft", epsilon=eps)
        elif spelling == "rms_normalization":
            b.opset = max(b.opset, 23)
            y = b.op("RMSNormalization", ["x", b.const(gain.astype(numpy_type), "gain")], axis=-1, epsilon=eps)
        else:
            y = b.op("SimplifiedLayerNormalization", ["x", b.const(gain.astype(numpy_type), "gain")], axis=-1,
                     epsilon=eps)
    else:
        x32 = b.op("Cast", ["x"], to=TensorProto.FLOAT)
        if gain_style == "fp32":
            y = b.op("Cast", [SPELLINGS[spelling](b, x32, gain, eps)], to=kind)
        else:
            y = b.op("Cast", [SPELLINGS[spelling](b, x32, None, eps)], to=kind)
            if gain_style == "half":
                g = b.const(gain.astype(numpy_type), "gain")
            else:
                g = b.op("Cast", [b.const(gain, "gain")], to=kind)
            y = b.op("Mul", [y, g])
    outputs = _projections(b, y, consumer, rng, hidden, widths, numpy_type)
    if b.residual_output is not None:
        outputs.append(b.residual_output)
    return b.model(inputs, outputs, kind)


def build_half_layer_norm_model(spelling: str, seed: int, dtype: str, *, hidden: int = 128,
                                widths: Sequence[int] = (128, 64, 64)) -> onnx.ModelProto:
    """`x` (in `dtype`) → LayerNorm as a half export writes it → projections with `dtype` weights
    and biases (MatMul + Add). 'layer_normalization': the opset-17 node on the half tensor
    (torch.onnx's dynamo exporter; it computes in fp32, stash_type 1); 'ln_decomposed_cast':
    torch.onnx below opset 17 (mean and Sub in half, the rest in double, Cast down, half gain
    Mul and bias Add). The same seed gives the same values for every dtype ('float32': the
    original)."""
    rng = np.random.default_rng(seed)
    kind, numpy_type = HALF_TYPES[dtype], half_dtype(dtype)
    b = GraphBuilder(OPSET.get(spelling, 17))
    b.activation = kind
    gain, bias = random_gain(rng, hidden).astype(numpy_type), random_bias(rng, hidden).astype(numpy_type)
    y = SPELLINGS[spelling](b, "x", gain, 1e-5, bias=bias)
    outputs = _projections(b, y, "biased", rng, hidden, widths, numpy_type)
    return b.model([helper.make_tensor_value_info("x", kind, ["batch", "seq", hidden])], outputs, kind)


def _linear(b: GraphBuilder, x: str, rng: np.random.Generator, k: int, n: int, bias: bool = True) -> str:
    """x·W (+ c): a MatMul with a [k, n] weight, then the Add of a constant [n] bias."""
    y = b.op("MatMul", [x, b.const((rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32), "w")])
    return b.op("Add", [y, b.const(random_bias(rng, n), "bias")]) if bias else y


def build_parallel_block(rng: np.random.Generator, *, spelling: str = "ln_decomposed", hidden: int = 32,
                         ffn: int = 64, eps: float = 1e-5) -> onnx.ModelProto:
    """Falcon / GPT-J / Phi-2: one LayerNorm feeds attention (q, k, v) and the MLP in parallel,
    both added to the residual: x + attn(LN(x)) + mlp(LN(x)); then a final LayerNorm and a head
    without bias. Biases everywhere else, gains and biases drawn away from 1 and 0."""
    b = GraphBuilder(OPSET.get(spelling, 17))
    b.residual_output = None
    norm = SPELLINGS[spelling]
    y = norm(b, "x", random_gain(rng, hidden), eps, bias=random_bias(rng, hidden))
    q, k, v = (_linear(b, y, rng, hidden, hidden) for _ in range(3))
    mixed = b.op("Add", [b.op("Mul", [q, b.op("Sigmoid", [k])]), v])  # a stand-in for attention
    attention = _linear(b, mixed, rng, hidden, hidden)
    mlp = _linear(b, b.op("Tanh", [_linear(b, y, rng, hidden, ffn)]), rng, ffn, hidden)
    h = b.op("Add", [b.op("Add", ["x", attention]), mlp])
    final = norm(b, h, random_gain(rng, hidden), eps, bias=random_bias(rng, hidden))
    logits = _linear(b, final, rng, hidden, 48, bias=False)
    return b.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", hidden])], [logits])


def build_post_ln_block(rng: np.random.Generator, *, spelling: str = "ln_decomposed", hidden: int = 32,
                        ffn: int = 64, eps: float = 1e-12) -> onnx.ModelProto:
    """BERT: LN(embeddings) feeds q, k, v and the residual Add; LN(h + attn) feeds the MLP and
    the residual Add; LN(h + mlp) is the output. Every LN's output is (also) the residual stream."""
    b = GraphBuilder(OPSET.get(spelling, 17))
    b.residual_output = None
    norm = SPELLINGS[spelling]
    h = norm(b, "x", random_gain(rng, hidden), eps, bias=random_bias(rng, hidden))
    q, k, v = (_linear(b, h, rng, hidden, hidden) for _ in range(3))
    attention = _linear(b, b.op("Add", [b.op("Mul", [q, b.op("Sigmoid", [k])]), v]), rng, hidden, hidden)
    h = norm(b, b.op("Add", [h, attention]), random_gain(rng, hidden), eps, bias=random_bias(rng, hidden))
    mlp = _linear(b, b.op("Tanh", [_linear(b, h, rng, hidden, ffn)]), rng, ffn, hidden)
    out = norm(b, b.op("Add", [h, mlp]), random_gain(rng, hidden), eps, bias=random_bias(rng, hidden))
    return b.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", hidden])], [out])


def build_multi_arity_model(rng: np.random.Generator, *, hidden: int = 32, widths: Sequence[Sequence[int]] = (
        (48, 16, 16), (40, 40), (24,)), eps: float = 1e-5) -> onnx.ModelProto:
    """`x` [batch, seq, hidden] read by one RMSNorm per entry of `widths`, each feeding that many
    projections of those widths: deferred, they become FlashNormMatMul nodes of different output
    counts (q|k|v, gate|up, a lone projection) in one model."""
    b = GraphBuilder(17)
    outputs = []
    for group in widths:
        y = pow_div(b, "x", random_gain(rng, hidden), eps)
        for width in group:
            weight = (rng.standard_normal((hidden, width)) / np.sqrt(hidden)).astype(np.float32)
            outputs.append(b.op("MatMul", [y, b.const(weight, "w")]))
    return b.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", hidden])], outputs)


def build_attention_block(rng: np.random.Generator, *, kind: str = "qkv_norm", hidden: int = 32, heads: int = 4,
                          eps: float = 1e-6, pre_norm: str = "pow_div", dynamic_shape: bool = False) -> onnx.ModelProto:
    """Pre-attention RMSNorm → q/k/v projections → Reshape [B,S,H,hd] → per-head norms → Transpose.

    kind: 'qkv_norm' (Gemma 4: q_norm, k_norm and a weightless v_norm: cancellable),
          'gqa_expand' (as qkv_norm, k/v with half the heads repeated by Unsqueeze→Expand→Reshape),
          'qk_norm' (Qwen3/Gemma 3: V has no norm), 'biased' (q/k/v with bias, per-head norms),
          'rope_slice' (k path also sliced into a branch with no norm, like MLA's RoPE slice),
          'rope_between' (q multiplied by a runtime `cos` input before q_norm),
          'rotary_op' (q and k rotated by opset-23 RotaryEmbedding before their norms: cancellable).
    pre_norm: the spelling of the pre-attention norm (a key of SPELLINGS; a LayerNorm gets a bias).
    dynamic_shape: Reshape sizes computed from Shape(normalized) as the legacy torch exporter does.
    """
    b = GraphBuilder(23 if kind == "rotary_op" else OPSET.get(pre_norm, 17))
    b.residual_output = None
    per_head = axes_input if b.opset >= 18 else pow_div
    head = hidden // heads
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", hidden])]
    if pre_norm in SKIP_SPELLINGS:
        inputs.append(helper.make_tensor_value_info("skip", TensorProto.FLOAT, ["batch", "seq", hidden]))
    spelling = axes_input if b.opset >= 18 and pre_norm == "pow_div" else SPELLINGS[pre_norm]
    layer = {"bias": random_bias(rng, hidden)} if SPELLING_KIND[pre_norm] == "layer" else {}
    y = spelling(b, "x", random_gain(rng, hidden), eps, **layer)

    def head_shape(count: int) -> str:
        if not dynamic_shape:
            return b.const(np.array([0, 0, count, head], np.int64), "shape")
        tokens = b.op("Slice", [b.op("Shape", [y]), b.const(np.array([0], np.int64)), b.const(np.array([2], np.int64))])
        return b.op("Concat", [tokens, b.const(np.array([count, head], np.int64))], axis=0)

    if kind == "rotary_op":
        angles = np.arange(8)[:, None] / (100.0 ** (np.arange(head // 2) / (head // 2)))
        cos_cache = b.const(np.cos(angles).astype(np.float32), "cos_cache")
        sin_cache = b.const(np.sin(angles).astype(np.float32), "sin_cache")
        inputs.append(helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "seq"]))
    outputs = []
    for role in ("q", "k", "v"):
        kv_heads = heads // 2 if kind == "gqa_expand" and role != "q" else heads
        w = b.const((rng.standard_normal((hidden, kv_heads * head)) / np.sqrt(hidden)).astype(np.float32), f"w_{role}")
        p = b.op("MatMul", [y, w])
        if kind == "biased":
            p = b.op("Add", [p, b.const(rng.standard_normal(kv_heads * head).astype(np.float32), f"b_{role}")])
        if kind == "rope_slice" and role == "k":
            outputs.append(b.op("Slice", [p, b.const(np.array([0], np.int64)), b.const(np.array([head], np.int64)),
                                          b.const(np.array([-1], np.int64))]))
        if kind == "rotary_op" and role != "v":  # opset-23 RotaryEmbedding: a rotation per token
            p = b.op("RotaryEmbedding", [p, cos_cache, sin_cache, "position_ids"], num_heads=kv_heads)
        h = b.op("Reshape", [p, head_shape(kv_heads)])
        if kv_heads != heads:  # repeat_kv: [B,S,kv,hd] → [B,S,kv,2,hd] → [B,S,H,hd]
            h = b.op("Unsqueeze", [h, b.const(np.array([3], np.int64))])
            h = b.op("Expand", [h, b.const(np.array([1, 1, 1, heads // kv_heads, 1], np.int64))])
            h = b.op("Reshape", [h, b.const(np.array([0, 0, heads, head], np.int64))])
        if kind == "rope_between" and role == "q":  # a rotation with runtime angles before q_norm
            h = b.op("Mul", [h, "cos"])

        if role == "v" and kind == "qk_norm":
            n = h
        else:
            n = per_head(b, h, None if role == "v" else random_gain(rng, head), eps)
        outputs.append(b.op("Transpose", [n], perm=[0, 2, 1, 3]))
    if kind == "rope_between":
        inputs.append(helper.make_tensor_value_info("cos", TensorProto.FLOAT, [1, 1, 1, head]))
    if b.residual_output is not None:
        outputs.append(b.residual_output)
    return b.model(inputs, outputs)


def feeds(model: onnx.ModelProto, rng: np.random.Generator, batch: int = 2, seq: int = 5) -> dict[str, np.ndarray]:
    """Random inputs for every graph input: symbolic dims take batch/seq (or tokens=batch·seq)."""
    result = {}
    for value in model.graph.input:
        dims = []
        for i, d in enumerate(value.type.tensor_type.shape.dim):
            if d.HasField("dim_value"):
                dims.append(d.dim_value)
            else:
                dims.append({"batch": batch, "seq": seq, "tokens": batch * seq}.get(d.dim_param, 3))
        dtype = helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
        if np.issubdtype(dtype, np.integer):  # token ids, positions: small non-negative
            result[value.name] = rng.integers(0, 8, dims).astype(dtype)
        else:
            result[value.name] = (rng.standard_normal(dims) * rng.uniform(0.5, 2.0) + 0.1).astype(dtype)
    return result


def run(model: onnx.ModelProto | str, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Run in ONNX Runtime on CPU with graph optimizations on (as a user would)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    source = model if isinstance(model, str) else model.SerializeToString()
    session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
    return session.run(None, inputs)


def float64_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of a float32 model computing in float64, for reference runs: float32 initializers,
    tensor constants, Casts to float and graph inputs and outputs become float64, in the graph and
    in its local functions; a Constant given as value_float(s) (a function's eps) gets a Cast after
    it. Intermediate value_info is dropped, for ONNX Runtime to infer again."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)

    def widen(tensor: onnx.TensorProto) -> None:
        if tensor.data_type == TensorProto.FLOAT:
            tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float64), tensor.name))

    def widen_nodes(owner: onnx.GraphProto | onnx.FunctionProto) -> None:
        result = []
        for node in owner.node:
            result.append(node)
            for attribute in node.attribute:
                if attribute.name == "to" and attribute.i == TensorProto.FLOAT:
                    attribute.i = TensorProto.DOUBLE
                elif attribute.type == onnx.AttributeProto.TENSOR:
                    widen(attribute.t)
                elif attribute.type == onnx.AttributeProto.GRAPH:
                    widen_graph(attribute.g)
            if node.op_type == "Constant" and node.attribute[0].name in ("value_float", "value_floats"):
                narrow = f"{node.output[0]}.float32"
                result.append(helper.make_node("Cast", [narrow], [node.output[0]], to=TensorProto.DOUBLE))
                node.output[0] = narrow
        del owner.node[:]
        owner.node.extend(result)

    def widen_graph(graph: onnx.GraphProto) -> None:
        for tensor in graph.initializer:
            widen(tensor)
        widen_nodes(graph)
        for value in [*graph.input, *graph.output]:
            if value.type.tensor_type.elem_type == TensorProto.FLOAT:
                value.type.tensor_type.elem_type = TensorProto.DOUBLE
        del graph.value_info[:]

    widen_graph(copy.graph)
    for function in copy.functions:
        widen_nodes(function)
    return copy


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    return float(np.max(np.abs(actual.astype(np.float64) - expected)) / np.max(np.abs(expected)))
