"""Lazy tensor values: weights that stay on disk (`ExternalValues`) and weights computed from
other weights only when they are saved or read (`DerivedValues`).

Passes describe changed weights with `DerivedValues`; `flashnorm.modelio.saving` computes each
one while writing it and frees it right after, so no tensor is held in memory twice.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import onnx
import onnx.numpy_helper
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.ir.tensor import LazyValues

from flashnorm.untrusted import InputFile

# Bits per element of the sub-byte types, whose raw_data is packed.
PACKED_BITS = {
    getattr(onnx.TensorProto, name): bits
    for name, bits in {"INT4": 4, "UINT4": 4, "FLOAT4E2M1": 4, "INT2": 2, "UINT2": 2}.items()
    if hasattr(onnx.TensorProto, name)
}


def stored_values(constant: gs.Constant) -> np.ndarray | LazyValues:
    """A constant's values as they are stored: its array, or its `LazyValues` still unread.

    onnx-graphsurgeon 0.6 has no public getter for this: `Constant.values` reads a lazy tensor
    and keeps the array on the constant, which for a weight means holding it in memory until
    the graph is gone. This is the one place FlashNorm reads its private `_values`; values
    are set through the public `constant.values = ...`, which takes a `LazyValues` as it is."""
    return constant._values


def read_values(values: np.ndarray | LazyValues, *, copy: bool = False) -> np.ndarray:
    """The array a constant's stored `values` hold, in their own dtype, bfloat16 included
    (through ml_dtypes); `copy` for an array the caller may modify. An initializer as
    onnx-graphsurgeon imported it is read through onnx itself: onnx-graphsurgeon's own loader
    warns on every bfloat16 tensor that NumPy lacks the type, and casts it to float32."""
    if type(values) is LazyValues:
        # Read-only where onnx wraps the tensor's bytes; writable means an array of its own.
        array = np.asarray(onnx.numpy_helper.to_array(values.tensor))
        return array.copy() if copy and not array.flags.writeable else array
    if isinstance(values, LazyValues):
        return values.load()
    return np.array(values) if copy else np.asarray(values)


def tensor_nbytes(data_type: int, dims: Iterable[int]) -> int | None:
    """Bytes of `raw_data` for a tensor of this ONNX type and shape; None for strings."""
    if data_type == onnx.TensorProto.STRING:
        return None
    volume = math.prod(int(d) for d in dims)
    if data_type in PACKED_BITS:
        return (volume * PACKED_BITS[data_type] + 7) // 8
    try:
        return volume * onnx.helper.tensor_dtype_to_np_dtype(data_type).itemsize
    except (KeyError, ValueError):  # UNDEFINED or a type this onnx does not know
        return None


def _inline_copy(tensor: onnx.TensorProto, raw: bytes) -> onnx.TensorProto:
    inline = onnx.TensorProto()
    inline.CopyFrom(tensor)
    del inline.external_data[:]
    inline.data_location = onnx.TensorProto.DEFAULT
    inline.raw_data = raw
    return inline


class ExternalValues(LazyValues):
    """A tensor stored in an external data file. `tensor` is its TensorProto (location,
    offset, length; no data), `data` the data file as `load` opened it, `model_file` the model
    file that refers to it. `load()` reads exactly that byte range, through the descriptor
    opened when the model was loaded, into one NumPy array; the TensorProto is never filled
    in, so reading a weight never leaves a second copy behind. `check_unchanged()` refuses
    (one line) a model or data file that was replaced or rewritten since it was opened."""

    def __init__(self, tensor: onnx.TensorProto, data: InputFile, offset: int, length: int, model_file: InputFile) -> None:
        super().__init__(tensor)
        self.data, self.offset, self.length, self.model_file = data, offset, length, model_file
        self.nbytes = length

    @property
    def path(self) -> Path:
        """The data file, resolved."""
        return self.data.path

    @property
    def model(self) -> Path:
        """The model file that names the data file."""
        return self.model_file.path

    def load(self) -> np.ndarray:
        data_type = self.tensor.data_type
        dims = tuple(int(d) for d in self.tensor.dims)
        if data_type in PACKED_BITS:
            raw = self.data.read_at(self.offset, self.length)
            return np.array(onnx.numpy_helper.to_array(_inline_copy(self.tensor, raw)))
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(data_type))
        values = np.empty(dims, dtype=dtype.newbyteorder("<"))
        self.data.read_into(memoryview(values.reshape(-1).view(np.uint8)), self.offset)
        return values.astype(dtype, copy=False)

    def inline_proto(self) -> onnx.TensorProto:
        """The tensor with its data inside (for writing it into a model file)."""
        return _inline_copy(self.tensor, self.data.read_at(self.offset, self.length))

    def check_unchanged(self) -> None:
        self.model_file.check_unchanged()
        self.data.check_unchanged()

    def __str__(self) -> str:
        return f"ExternalValues (shape={self.shape}, dtype={self.dtype}, {self.path.name}@{self.offset})"


class DerivedValues(LazyValues):
    """Values computed from another constant's values only when they are needed.

    `DerivedValues(weight, lambda w: w * gain[:, None])` describes a changed weight without
    computing it: `save` computes it while writing it and frees it right after, so a pass that
    changes many large weights (fold) never holds more than one of them in memory. `load()`
    (what `constant.values` calls) computes it too. `function` receives a fresh array of the
    source's values, which it may modify in place, and must return an array of `shape` and
    `dtype` (by default the source's)."""

    def __init__(
        self,
        source: gs.Constant,
        function: Callable[[np.ndarray], np.ndarray],
        *,
        shape: Iterable[int] | None = None,
        dtype: np.dtype | None = None,
    ) -> None:
        # The source's current values object, not the Constant: later edits of the source
        # (or its `.values` being loaded) do not change what this derives from.
        self.source, self.function = stored_values(source), function
        self.shape = list(source.shape if shape is None else shape)
        self.dtype = np.dtype(source.dtype if dtype is None else dtype)
        self.nbytes = math.prod(int(d) for d in self.shape) * self.dtype.itemsize

    def load(self) -> np.ndarray:
        # A lazy source is read into a new array every time; an in-memory one is copied so
        # that `function` may work in place without changing it.
        source = read_values(self.source, copy=True)
        values = np.asarray(self.function(source))
        if list(values.shape) != self.shape or values.dtype != self.dtype:
            raise ValueError(
                f"derived values are {values.dtype}{list(values.shape)}, declared {self.dtype}{self.shape}"
            )
        return values

    @property
    def tensor(self) -> onnx.TensorProto:
        """The computed tensor, for code that exports the graph without `save`."""
        return onnx.numpy_helper.from_array(self.load())

    def __str__(self) -> str:
        return f"DerivedValues (shape={self.shape}, dtype={self.dtype}, from {self.source})"


def type_name(tensor: onnx.TensorProto) -> str:
    if tensor.data_type in onnx.TensorProto.DataType.values():
        return onnx.TensorProto.DataType.Name(tensor.data_type)
    return str(tensor.data_type)

