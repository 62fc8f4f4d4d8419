"""Graph queries every matcher and pass shares: who writes a tensor, what constant value it
holds, which initializer stores it, what dtype it has.

Exporters spell one constant many ways: an initializer, a `Constant` node, a `Cast` of an
initializer (an fp32 gain fed to an fp16 Mul), `Add(w, 1)` (Gemma's 1+w gain). Matchers and
passes ask "is this tensor a constant, what is its value, and where is it stored?" here.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from flashnorm.modelio.values import read_values, stored_values

# Ops whose output is a constant when all their inputs are, evaluated in numpy in the
# tensor's own dtype (so that Cast, and the dtype of the result, are exact).
_ELEMENTWISE = {
    "Add": np.add,
    "Sub": np.subtract,
    "Mul": np.multiply,
    "Div": np.divide,
}

_MAX_DEPTH = 16

# Ops that read only their input's shape, never its values: a norm output feeding one of
# these (the legacy torch exporter computes Reshape sizes from Shape) is not a "use".
SHAPE_ONLY_OPS = frozenset({"Shape", "Size"})


def onnx_to_numpy_dtype(onnx_type: int) -> np.dtype:
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(onnx_type))


def producer(tensor: gs.Tensor) -> Optional[gs.Node]:
    """The node that writes `tensor`, or None for graph inputs and initializers."""
    return tensor.inputs[0] if tensor.inputs else None


def through_transpose(tensor: gs.Tensor, where: str, error: type[Exception]) -> tuple[gs.Tensor, Optional[gs.Node]]:
    """Looks through the Transpose that writes a 2-D weight: (its input, the Transpose), or
    (`tensor`, None) when no Transpose writes it. A perm other than [1, 0] raises `error`, so
    the caller leaves the site alone and reports why."""
    source = producer(tensor)
    if source is None or source.op != "Transpose":
        return tensor, None
    perm = list(source.attrs.get("perm", [1, 0]))
    if perm != [1, 0]:
        raise error(f"{where}: weight Transpose perm {perm} is not [1, 0]")
    return source.inputs[0], source


def stored_initializer(tensor: gs.Tensor, through: frozenset[str] = frozenset({"Cast", "Identity"}),
                       depth: int = 4) -> Optional[gs.Constant]:
    """The initializer whose values `tensor` carries, followed back through up to `depth` nodes
    of the ops in `through`; None when another node (or a graph input) is in the way."""
    for _ in range(depth):
        if isinstance(tensor, gs.Constant):
            return tensor
        node = producer(tensor)
        if node is None or node.op not in through:
            return None
        tensor = node.inputs[0]
    return None


def holding_constant(tensor: gs.Tensor) -> Optional[gs.Constant]:
    """The constant that holds `tensor`'s values: the tensor itself (an initializer) or a
    Constant node's value; None otherwise."""
    if isinstance(tensor, gs.Constant):
        return tensor
    node = producer(tensor)
    if node is not None and node.op == "Constant" and isinstance(node.attrs.get("value"), gs.Constant):
        return node.attrs["value"]
    return None


def constant_value(tensor: Optional[gs.Tensor], depth: int = 0) -> Optional[np.ndarray]:
    """The value of `tensor` if it is computable from constants alone, else None."""
    if tensor is None or depth > _MAX_DEPTH:
        return None
    if isinstance(tensor, gs.Constant):
        return constant_array(tensor)
    node = producer(tensor)
    if node is None:
        return None
    if node.op == "Constant":
        return _constant_node_value(node)
    if node.op == "Identity":
        return constant_value(node.inputs[0], depth + 1)
    if node.op == "Cast":
        value = constant_value(node.inputs[0], depth + 1)
        return None if value is None else value.astype(onnx_to_numpy_dtype(int(node.attrs["to"])))
    if node.op in _ELEMENTWISE and len(node.inputs) == 2:
        left = constant_value(node.inputs[0], depth + 1)
        right = constant_value(node.inputs[1], depth + 1)
        if left is None or right is None:
            return None
        result = _ELEMENTWISE[node.op](left, right)
        return np.asarray(result).astype(np.result_type(left, right))
    return None


def constant_array(constant: gs.Constant) -> np.ndarray:
    """A constant's values in its own dtype, bfloat16 included (`read_values`), without
    caching them on the constant."""
    return read_values(stored_values(constant))


def _constant_node_value(node: gs.Node) -> Optional[np.ndarray]:
    for key, value in node.attrs.items():
        if key == "value":
            return np.asarray(value.values)
        if key == "value_float":
            return np.asarray(value, dtype=np.float32)
        if key == "value_floats":
            return np.asarray(value, dtype=np.float32)
        if key == "value_int":
            return np.asarray(value, dtype=np.int64)
        if key == "value_ints":
            return np.asarray(value, dtype=np.int64)
    return None


def stored_dtype_name(tensor: gs.Tensor) -> str:
    """The dtype name of a tensor's storage ('float32', 'float8e4m3fn', 'int4'...), without
    reading its values; '' when unknown."""
    dtype = getattr(tensor, "dtype", None)
    if dtype is None:
        return ""
    if isinstance(dtype, (int, np.integer)):  # an unloaded constant of a type NumPy lacks (bfloat16, fp8)
        return onnx.TensorProto.DataType.Name(int(dtype)).lower()
    try:
        return np.dtype(dtype).name
    except TypeError:
        return ""


def numpy_dtype(dtype: object) -> Optional[np.dtype]:
    """A tensor's dtype as NumPy's (an unloaded bfloat16 constant reports its ONNX type
    number); None where NumPy has no such type."""
    try:
        if isinstance(dtype, (int, np.integer)):
            return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(int(dtype)))
        return np.dtype(dtype)
    except (KeyError, TypeError, ValueError):
        return None


def is_constant_expression(tensor: Optional[gs.Tensor], depth: int = 0) -> bool:
    """True when `tensor` depends on no graph input: an initializer, a Constant node, or any
    deterministic op (Transpose, DequantizeLinear, Reshape, Cast, ...) of such tensors."""
    if tensor is None or depth > _MAX_DEPTH:
        return False
    if isinstance(tensor, gs.Constant):
        return True
    node = producer(tensor)
    if node is None or node.op.startswith("Random"):
        return False
    if node.op == "Constant":
        return True
    return all(
        is_constant_expression(t, depth + 1) for t in node.inputs if not _is_empty(t)
    )


def _is_empty(tensor: gs.Tensor) -> bool:
    return isinstance(tensor, gs.Variable) and tensor.name == "" and not tensor.inputs


def is_scalar_equal(value: Optional[np.ndarray], expected: float) -> bool:
    return value is not None and value.size == 1 and float(value.reshape(())) == expected


def tensor_rank(tensor: gs.Tensor) -> Optional[int]:
    shape = getattr(tensor, "shape", None)
    return None if shape is None else len(shape)


def last_dim(tensor: gs.Tensor) -> Optional[int]:
    shape = getattr(tensor, "shape", None)
    if shape and isinstance(shape[-1], (int, np.integer)) and int(shape[-1]) > 0:
        return int(shape[-1])
    return None
