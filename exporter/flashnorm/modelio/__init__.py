"""Load and save ONNX models: external data, staged writes, clear errors.

Large models keep their weights out of memory. `load` parses the model without its external
data; every externally stored initializer becomes an `ExternalValues` that knows its file,
offset and length and reads its values only when a pass asks for `constant.values`. `save`
writes each tensor once, straight to its destination (see `flashnorm.modelio.saving`). Every
file is staged by `flashnorm.files`: a failure never leaves half a file behind.

One job per module: `values` (lazy tensor values), `wire` (the protobuf reader), `checker`
(the ONNX checker without weights), `graphwalk` (a graph's constants), `modelgraph` (the graph
`load` returns, with the model's own fields, kept by `copy()`), `loading`, `saving`.
Nothing here imports a pass.
"""

from flashnorm.modelio.loading import (
    ModelInterface, external_data_files, load, read_header, read_interface, unchanged_model,
)
from flashnorm.modelio.modelgraph import ModelGraph
from flashnorm.modelio.saving import EXTERNAL_DATA_THRESHOLD, INLINE_TENSOR_BYTES, save
from flashnorm.modelio.values import DerivedValues, ExternalValues, tensor_nbytes

__all__ = [
    "EXTERNAL_DATA_THRESHOLD",
    "INLINE_TENSOR_BYTES",
    "DerivedValues",
    "ExternalValues",
    "ModelGraph",
    "ModelInterface",
    "external_data_files",
    "load",
    "read_header",
    "read_interface",
    "save",
    "tensor_nbytes",
    "unchanged_model",
]
