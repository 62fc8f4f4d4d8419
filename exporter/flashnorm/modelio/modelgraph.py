"""The graph `load` returns: an onnx-graphsurgeon Graph that also carries, through `copy()`,
the ModelProto fields onnx-graphsurgeon has no place for."""

from __future__ import annotations

from collections import OrderedDict

import onnx
import onnx_graphsurgeon as gs


class ModelGraph(gs.Graph):
    """A `gs.Graph` plus `model_fields`: a ModelProto holding only the loaded model's
    doc_string, domain, model_version, metadata_props and training_info, which `save` writes
    back. `gs.Graph.copy()` returns a plain Graph and leaves out producer_name and
    producer_version as well; `ModelGraph.copy()` keeps all of them, so a copy saves as the
    original would."""

    def __init__(self, *args, model_fields: onnx.ModelProto | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.model_fields = onnx.ModelProto() if model_fields is None else model_fields

    @classmethod
    def adopt(cls, graph: gs.Graph, model_fields: onnx.ModelProto) -> ModelGraph:
        """`graph`'s nodes, tensors and fields (not copied) in a ModelGraph with `model_fields`."""
        return cls(
            nodes=graph.nodes, inputs=graph.inputs, outputs=graph.outputs, name=graph.name,
            doc_string=graph.doc_string, opset=graph.opset, import_domains=graph.import_domains,
            producer_name=graph.producer_name, producer_version=graph.producer_version,
            functions=graph.functions, ir_version=graph.ir_version, model_fields=model_fields,
        )

    def copy(self, tensor_map: OrderedDict[str, gs.Tensor] | None = None) -> ModelGraph:
        copied = super().copy(tensor_map)
        copied.producer_name, copied.producer_version = self.producer_name, self.producer_version
        fields = onnx.ModelProto()
        fields.CopyFrom(self.model_fields)
        return ModelGraph.adopt(copied, fields)
