"""Shape annotation (flashnorm.match.shapes) for graphs exported without value_info.

(Named test_match_shapes: tests/engine/test_shapes.py exists and test directories are not packages.)"""

from __future__ import annotations

import onnx_graphsurgeon as gs

from flashnorm.match.shapes import annotate_shapes, annotate_types, inferred_shapes
from synthetic import build_attention_block


def test_missing_shapes_are_inferred_without_copying_weights(rng):
    model = build_attention_block(rng, dynamic_shape=True)
    stored = {v.name: [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim] for v in model.graph.value_info}
    del model.graph.value_info[:]
    graph = gs.import_onnx(model)
    assert annotate_shapes(graph)
    tensors = graph.tensors()
    for name, dims in stored.items():
        if name in tensors:
            shape = tensors[name].shape
            assert len(shape) == len(dims)
            for annotated, known in zip(shape, dims):
                if isinstance(known, int) and known > 0:  # inference may know more, never less
                    assert annotated == known, name
    assert annotate_shapes(graph) == []  # nothing left to fill


def test_inferred_shapes_are_removed_after_the_block(rng):
    model = build_attention_block(rng)
    del model.graph.value_info[:]
    graph = gs.import_onnx(model)
    with inferred_shapes(graph) as annotated:
        assert annotated and all(t.shape is not None for t in annotated)
    assert all(t.shape is None for t in annotated)


def test_element_types_stay_unless_asked(rng):
    model = build_attention_block(rng)
    del model.graph.value_info[:]
    graph = gs.import_onnx(model)
    with inferred_shapes(graph, keep_types=False) as annotated:
        assert all(t.dtype is not None for t in annotated)
    assert all(t.dtype is None for t in annotated)
    annotate_types(graph)
    assert all(t.dtype is not None and t.shape is None for t in annotated)
