"""The gain of a norm site: its value, its convention (w or 1+w) and where it is stored."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

import numpy as np
import onnx_graphsurgeon as gs

from flashnorm.match.queries import constant_value, is_scalar_equal, producer, stored_initializer

if TYPE_CHECKING:
    from flashnorm.match.site import NormSite


@dataclasses.dataclass
class Gain:
    value: np.ndarray
    """Effective per-channel multiplier, float64, shape [D]."""

    convention: str
    """'w' or '1+w' (the graph computes Add(w, 1) itself)."""

    tensor: Optional[gs.Constant]
    """The initializer holding w."""

    dtype: np.dtype
    """The dtype the gain has where it is read."""


def read_gain(tensor: gs.Tensor) -> Optional[Gain]:
    """The per-channel gain `tensor` holds, or None if it is not a constant vector that
    broadcasts along the last axis only."""
    value = constant_value(tensor)
    if value is None or value.ndim == 0 or value.shape[-1] < 2:
        return None
    if int(np.prod(value.shape[:-1])) != 1 or not np.issubdtype(_numeric(value.dtype), np.floating):
        return None
    convention, stored = "w", stored_initializer(tensor)
    node = producer(tensor)
    if node is not None and node.op == "Add" and len(node.inputs) == 2:
        for one, other in ((node.inputs[0], node.inputs[1]), (node.inputs[1], node.inputs[0])):
            if is_scalar_equal(constant_value(one), 1.0) and constant_value(other) is not None:
                convention, stored = "1+w", stored_initializer(other)
                break
    return Gain(value.astype(np.float64).reshape(-1), convention, stored, value.dtype)


def gain_slot_shape(site: "NormSite") -> tuple[int, ...]:
    """The shape the gain has where the site reads it: [D], or e.g. [1, 1, D], which can also
    broadcast the output to a higher rank; a replacement gain keeps this shape."""
    value = constant_value(site.gain_node.inputs[site.gain_index])
    return tuple(value.shape) if value is not None else (site.gain.size,)


def bias_slot_shape(site: "NormSite") -> tuple[int, ...]:
    """The shape a LayerNorm's bias has where the site reads it (as `gain_slot_shape`)."""
    value = constant_value(site.bias_node.inputs[site.bias_index])
    return tuple(value.shape) if value is not None else (site.bias.size,)


def _numeric(dtype: np.dtype) -> np.dtype:
    """ml_dtypes' bfloat16 is not a numpy floating subtype; treat it as one."""
    return np.dtype(np.float32) if dtype.name == "bfloat16" else dtype
