"""Running bfloat16 models where the runtime has no bfloat16 kernels.

ONNX Runtime's CPU provider has no bfloat16 MatMul (NOT_IMPLEMENTED), but it casts to and
from bfloat16. `emulate_bfloat16` rewrites a bfloat16 model into a float32 one that computes
what a bfloat16 device computes with float32 accumulation: every bfloat16 initializer and
constant becomes its exact float32 copy, and every tensor the original holds in bfloat16 is
rounded to bfloat16 where it is produced (a Cast to bfloat16 and back). Ops that only move or
select values (Reshape, Gather, Concat, ...) need no rounding and get none.

What it does not reproduce: a kernel's own internal precision (a bfloat16 GEMM accumulates in
float32 on every GPU we target, which matches; a fused kernel that rounds an intermediate
differently would not).
"""

from __future__ import annotations

import os

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from flashnorm.modelio import read_header

BFLOAT16, FLOAT = TensorProto.BFLOAT16, TensorProto.FLOAT
EMULATION = ("float32 copy of the bfloat16 weights on ONNX Runtime, every bfloat16 activation rounded to "
             "bfloat16 where it is produced (ONNX Runtime's CPU provider has no bfloat16 MatMul)")
"""How a bfloat16 model was run, as reports state it."""

# Outputs that are their inputs' values moved or selected: already bfloat16-exact.
_EXACT_OPS = frozenset({
    "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Slice", "Gather", "GatherND", "GatherElements", "Concat",
    "Split", "Expand", "Identity", "Flatten", "Tile", "Where", "Neg", "Max", "Min", "Relu", "Pad", "ScatterND",
})


def is_bfloat16_model(model: onnx.ModelProto) -> bool:
    """Whether any initializer, graph input or graph output is bfloat16."""
    graph = model.graph
    return any(t.data_type == BFLOAT16 for t in graph.initializer) or any(
        v.type.tensor_type.elem_type == BFLOAT16 for v in [*graph.input, *graph.output]
    )


def emulate_bfloat16(model: onnx.ModelProto, half: int = BFLOAT16) -> onnx.ModelProto:
    """A float32 copy of `model` that rounds every bfloat16 tensor to bfloat16 (see the module
    docstring). `model` is not changed; it must hold its weights (not external data).

    `half=TensorProto.FLOAT16` does the same for an fp16 model: every Cast and every fp16
    result rounded as written, as a strongly typed engine (TensorRT) computes it. ONNX
    Runtime's CPU provider does not: it widens the fp16 weights to fp32 and computes MatMul,
    the norm and the other arithmetic in fp32, rounding to fp16 only where a tensor enters an
    op it keeps in fp16 (Reshape, Split, Transpose, ...), so most roundings the graph states
    are skipped (docs/HALF_PRECISION.md)."""
    types = _element_types(model)
    result = onnx.ModelProto()
    result.CopyFrom(model)
    graph = result.graph
    for index, tensor in enumerate(graph.initializer):
        if tensor.data_type == half:
            graph.initializer[index].CopyFrom(_widened(tensor))
    for value in [*graph.input, *graph.output]:
        if value.type.tensor_type.elem_type == half:
            value.type.tensor_type.elem_type = FLOAT
    del graph.value_info[:]

    nodes = []
    for node in graph.node:
        _widen_attributes(node, half)
        nodes.append(node)
        if node.op_type in _EXACT_OPS or (node.op_type == "Cast" and _cast_target(node) != half):
            continue
        for position, name in enumerate(node.output):
            if name and _output_type(node, name, types, half) == half:
                types[name] = half  # what a later node without an inferred type reads
                wide = f"{name}.float32"
                node.output[position] = wide
                if node.op_type == "Cast":  # Cast to bfloat16: keep it, then widen exactly
                    nodes.append(helper.make_node("Cast", [wide], [name], to=FLOAT, name=f"{name}.widen"))
                    continue
                nodes += _rounding(wide, name, half)
    del graph.node[:]
    graph.node.extend(nodes)
    return result


def _rounding(source: str, target: str, half: int) -> list[onnx.NodeProto]:
    rounded = f"{target}.rounded"
    return [
        helper.make_node("Cast", [source], [rounded], to=half, name=f"{target}.round"),
        helper.make_node("Cast", [rounded], [target], to=FLOAT, name=f"{target}.widen"),
    ]


def _cast_target(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "to"), 0)


def _widened(tensor: onnx.TensorProto) -> onnx.TensorProto:
    return numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float32), tensor.name)


def _widen_attributes(node: onnx.NodeProto, half: int) -> None:
    """Constant / ConstantOfShape values and Cast targets of bfloat16 become float32 (the Cast
    to bfloat16 itself is kept by the caller and widened right after)."""
    for attribute in node.attribute:
        if attribute.type == onnx.AttributeProto.TENSOR and attribute.t.data_type == half:
            attribute.t.CopyFrom(_widened(attribute.t))


def _element_types(model: onnx.ModelProto) -> dict[str, int]:
    """Every tensor's element type as ONNX type inference finds it (initializers and graph
    inputs/outputs as declared)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:  # inference is best effort; unknown types fall back to the inputs' type
        inferred = model
    types = {v.name: v.type.tensor_type.elem_type
             for v in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]}
    types.update({t.name: t.data_type for t in model.graph.initializer})
    return {name: kind for name, kind in types.items() if kind}


def _output_type(node: onnx.NodeProto, name: str, types: dict[str, int], half: int) -> int:
    """The output's inferred type; where inference found none (a custom-domain node such as
    FlashNormMatMul), the half type if any input has it."""
    if name in types:
        return types[name]
    if node.op_type == "Cast":
        return _cast_target(node)
    return half if any(types.get(i) == half for i in node.input) else 0


def emulating_runner_factory(*, optimization_level: str = "all", float16: bool = False):
    """A RunnerFactory (see validate.runners) of Polygraphy ONNX Runtime runners that run a
    model through `emulate_bfloat16` when it is a bfloat16 model (with `float16`, an fp16
    model too), and as it is otherwise."""
    from flashnorm.validate.runners import make_session

    def build(model_path: str, name: str):
        from polygraphy.backend.onnxrt import OnnxrtRunner

        half = half_type(read_header(model_path))
        if half == BFLOAT16 or (float16 and half == TensorProto.FLOAT16):
            return OnnxrtRunner(lambda: emulated_session(model_path, optimization_level=optimization_level, half=half),
                                name=name)
        return OnnxrtRunner(lambda: make_session(model_path, optimization_level=optimization_level), name=name)

    return build


def half_type(model: onnx.ModelProto) -> int:
    """BFLOAT16 for a bfloat16 model, FLOAT16 for an fp16 one (any initializer or graph input
    or output of that type), 0 otherwise."""
    if is_bfloat16_model(model):
        return BFLOAT16
    graph = model.graph
    if any(t.data_type == TensorProto.FLOAT16 for t in graph.initializer) or any(
            v.type.tensor_type.elem_type == TensorProto.FLOAT16 for v in [*graph.input, *graph.output]):
        return TensorProto.FLOAT16
    return 0


def precision(model_path: str | os.PathLike[str]) -> tuple[int, str]:
    """(ONNX element type, how a comparison runs it) for the model at `model_path`: bfloat16
    emulated, float16 on ONNX Runtime as it runs the file, anything else as float32."""
    kind = half_type(read_header(model_path))
    if kind == BFLOAT16:
        return kind, f"bfloat16: {EMULATION}"
    if kind == TensorProto.FLOAT16:
        return kind, ("float16 on ONNX Runtime: its CPU provider widens the fp16 weights to fp32 and computes "
                      "MatMul and the norms in fp32, rounding to fp16 only before ops it keeps in fp16")
    return FLOAT, "float32"


def emulated_session(model_path: str, *, optimization_level: str = "all", half: int = BFLOAT16):
    """An ONNX Runtime CPU session of `emulate_bfloat16(model, half)`."""
    import onnxruntime as ort

    from flashnorm.validate.runners import session_options

    model = emulate_bfloat16(onnx.load(model_path), half)
    return ort.InferenceSession(model.SerializeToString(), sess_options=session_options(optimization_level),
                                providers=["CPUExecutionProvider"])
