"""A per-input-channel scale in front of the projection: x̂·g → Mul(·, s) → (quantized) MatMul,
as ModelOpt's int4_awq writes its pre_quant_scale and SmoothQuant its smoothing scales.
The gain moves into the scale: s' = s·g (float64, rounded once to s's dtype). What follows the
Mul sees the same values as before, so the fold is exact whatever the weight's format; it is
preferred over requantizing (fold asks this module before the weight's)."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from flashnorm.match.queries import constant_value
from flashnorm.passes.quantized.edit import NotQuantFoldable, QuantEdit
from flashnorm.passes.quantized.requantize import QuantError

_FLOAT_KINDS = "f"


def plan(node: gs.Node, activation: gs.Tensor, gain: np.ndarray, where: str):
    """The exact fold into a constant per-channel Mul, None when `node` is no such Mul."""
    others = [t for t in node.inputs if t is not activation]
    if len(node.inputs) != 2 or len(others) != 1:
        return None
    scale_tensor = others[0]
    scale = constant_value(scale_tensor)
    if scale is None or scale.dtype.kind not in _FLOAT_KINDS and scale.dtype.name != "bfloat16":
        return None
    channels = gain.size
    if scale.size == 1:
        shape = (channels,)
    elif scale.size == channels and scale.shape[-1] == channels:
        shape = scale.shape
    else:
        raise NotQuantFoldable(f"{where}: scale {scale_tensor.name!r} of shape {list(scale.shape)} is not one "
                               f"value per input channel ({channels})")
    exact = scale.astype(np.float64).reshape(-1) * gain if scale.size > 1 else float(scale.reshape(())) * gain
    with np.errstate(over="ignore"):
        stored = exact.astype(scale.dtype)
    if not np.all(np.isfinite(stored.astype(np.float64))):
        raise NotQuantFoldable(f"{where}: s·g leaves {scale.dtype.name}'s range; kept the gain")
    norm = float(np.linalg.norm(exact))
    rel = float(np.linalg.norm(stored.astype(np.float64) - exact)) / norm if norm > 0 else 0.0

    def write(folded_gain: np.ndarray) -> list[gs.Node]:
        index = next(i for i, t in enumerate(node.inputs) if t is scale_tensor)
        node.inputs[index] = gs.Constant(f"{scale_tensor.name}.folded_for.{activation.name}",
                                         stored.reshape(shape))
        return []

    return QuantEdit(node, scale_tensor, f"prescale Mul ({scale.dtype.name})", True, QuantError(rel, 0.0, 0.0),
                     0.0, write)
