"""Walking a graph's constants: every Constant of the graph, its functions and subgraphs."""

from __future__ import annotations

import onnx_graphsurgeon as gs
from onnx_graphsurgeon.ir.tensor import SparseValues

from flashnorm.modelio.values import stored_values


def graphs(graph: gs.Graph) -> list[gs.Graph]:
    """The graph, its functions, and every subgraph of either, each once."""
    found: dict[int, gs.Graph] = {}
    for root in [graph, *graph.functions]:
        for candidate in [root, *root.subgraphs(recursive=True)]:
            found.setdefault(id(candidate), candidate)
    return list(found.values())


def all_constants(graph: gs.Graph) -> list[gs.Constant]:
    """Every Constant reachable from `graph` (node inputs and attributes, graph inputs and
    outputs, in all subgraphs and functions), each once."""
    found: dict[int, gs.Constant] = {}
    for sub in graphs(graph):
        candidates = [*sub.inputs, *sub.outputs]
        for node in sub.nodes:
            candidates += [*node.inputs, *node.attrs.values()]
        for tensor in candidates:
            if isinstance(tensor, gs.Constant):
                found.setdefault(id(tensor), tensor)
    return list(found.values())


def initializers(graph: gs.Graph) -> list[gs.Constant]:
    """The Constants the exporter writes as initializers of `graph` itself."""
    return [
        t for t in graph.tensors().values()
        if isinstance(t, gs.Constant) and not isinstance(stored_values(t), SparseValues)
    ]

