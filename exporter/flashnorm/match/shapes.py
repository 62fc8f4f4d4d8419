"""Fill in tensor shapes a graph does not carry (the legacy torch exporter writes none),
without copying its weights: ONNX shape inference runs on the graph's structure, with every
large initializer replaced by a typed input of the same shape."""

from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import helper
from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter, dtype_to_onnx

# Initializers up to this many elements keep their values (Reshape targets, axes, eps):
# shape inference needs them to compute shapes.
_SMALL_ELEMENTS = 64


@contextlib.contextmanager
def inferred_shapes(graph: gs.Graph, *, keep_types: bool = True) -> Iterator[list[gs.Variable]]:
    """Shapes filled in by `annotate_shapes` for the duration of the block, then removed again,
    so that a pass reasons with them without writing symbolic guesses into the model it saves.
    Element types stay unless `keep_types=False`: type inference is exact, and later passes
    (defer) need them."""
    untyped = [t for t in graph.tensors().values() if isinstance(t, gs.Variable) and t.dtype is None]
    annotated = annotate_shapes(graph)
    try:
        yield annotated
    finally:
        for tensor in annotated:
            tensor.shape = None
        if not keep_types:
            for tensor in untyped:
                tensor.dtype = None


def annotate_types(graph: gs.Graph) -> None:
    """Give every variable without an element type the one ONNX type inference finds, and
    no shapes: what passes that build new nodes need, without symbolic guesses in the output."""
    with inferred_shapes(graph, keep_types=True):
        pass


def annotate_shapes(graph: gs.Graph) -> list[gs.Variable]:
    """Give every variable without a shape the shape (and, where missing, the element type)
    ONNX shape inference finds (top-level graph only). Returns the tensors that gained a shape;
    a graph inference cannot handle is left as it was."""
    missing = [t for t in graph.tensors().values() if isinstance(t, gs.Variable) and t.shape is None and t.name]
    if not missing:
        return []
    try:
        model = _structure_only(graph)
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    except Exception:  # inference is best effort: the caller then reasons without shapes
        return []
    found = {v.name: v for v in list(inferred.graph.value_info) + list(inferred.graph.output)}
    annotated = []
    for tensor in missing:
        info = found.get(tensor.name)
        if info is None or not info.type.tensor_type.HasField("shape"):
            continue
        dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                for d in info.type.tensor_type.shape.dim]
        tensor.shape = dims
        if tensor.dtype is None and info.type.tensor_type.elem_type:
            tensor.dtype = helper.tensor_dtype_to_np_dtype(info.type.tensor_type.elem_type)
        annotated.append(tensor)
    return annotated


def _structure_only(graph: gs.Graph) -> onnx.ModelProto:
    inputs = [OnnxExporter.export_value_info_proto(t, do_type_check=False) for t in graph.inputs]
    initializers = []
    for tensor in graph.tensors().values():
        if not isinstance(tensor, gs.Constant):
            continue
        if int(np.prod(tensor.shape)) <= _SMALL_ELEMENTS:
            initializers.append(OnnxExporter.export_tensor_proto(tensor))
        else:
            inputs.append(helper.make_tensor_value_info(tensor.name, dtype_to_onnx(tensor.dtype), list(tensor.shape)))
    nodes = [OnnxExporter.export_node(node) for node in graph.nodes]
    outputs = [OnnxExporter.export_value_info_proto(t, do_type_check=False) for t in graph.outputs]
    proto = helper.make_graph(nodes, graph.name or "graph", inputs, outputs, initializers)
    opsets = [helper.make_opsetid("", graph.opset)] + [
        d for d in graph.import_domains or [] if d.domain not in ("", "ai.onnx")
    ]
    model = helper.make_model(proto, opset_imports=opsets)
    model.ir_version = min(model.ir_version, 10)
    model.functions.extend(OnnxExporter.export_function(f) for f in graph.functions)
    return model
