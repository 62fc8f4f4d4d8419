"""NormSite: what every matcher returns, whatever spelling the exporter used."""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import onnx_graphsurgeon as gs


@dataclasses.dataclass
class NormSite:
    """One norm in a graph, of one of two kinds:

    'rms':   y = x / sqrt(mean(x², axis=-1) + eps) · gain
    'layer': y = (x − μ) / sqrt(mean((x − μ)², axis=-1) + eps) · gain + bias,  μ = mean(x, axis=-1)

    A matcher fills every field; passes read them and never re-walk the norm's nodes.
    """

    name: str
    """Stable identifier used in reports (the name of the site's output tensor)."""

    spelling: str
    """The family that matched: 'decomposed' (either kind), 'RMSNormalization',
    'SimplifiedLayerNormalization', 'SkipSimplifiedLayerNormalization', 'LayerNormalization' or
    'SkipLayerNormalization'."""

    input: gs.Variable
    """The tensor that is normalized (for the Skip form: the residual sum's inputs live in
    `nodes`, and `input` is the first data input)."""

    output: gs.Variable
    """The tensor the consumers read: the normalized input times the gain, after any
    trailing Cast."""

    nodes: list[gs.Node]
    """Every node that belongs to the site, producer order."""

    eps: float
    axis: int
    """Normalized axis, negative (the last axis, -1, for every site FlashNorm accepts)."""

    gain: Optional[np.ndarray]
    """The effective per-channel multiplier g in float64 (for a (1+w) gain: 1+w), or None
    when the norm has no gain at all."""

    gain_convention: str
    """'w', '1+w' or 'none'."""

    gain_tensor: Optional[gs.Constant] = None
    """The initializer that stores the gain (w itself for the '1+w' convention)."""

    hidden_size: Optional[int] = None

    gain_node: Optional[gs.Node] = None
    """The node that multiplies by the gain (the Mul, or the fused norm node)."""

    gain_index: Optional[int] = None
    """Which input of `gain_node` carries the gain: a fold writes ones there."""

    gain_dtype: Optional[np.dtype] = None
    """The dtype the gain has where `gain_node` reads it (after any Cast on the gain)."""

    data_inputs: list[gs.Tensor] = dataclasses.field(default_factory=list)
    """Every non-constant input the site reads: [input] or, for the Skip form,
    [input, skip]."""

    residual_output: Optional[gs.Variable] = None
    """Skip form only: the residual sum input+skip(+bias) the node also writes, if used."""

    output_cast: Optional[int] = None
    """ONNX dtype of a Cast between the normalization and `output`, if any."""

    kind: str = "rms"
    """'rms' (RMSNorm) or 'layer' (LayerNorm: subtracts the mean, may add a bias)."""

    bias: Optional[np.ndarray] = None
    """LayerNorm only: the per-channel bias b in float64, or None when the norm adds none."""

    bias_tensor: Optional[gs.Constant] = None
    """The initializer that stores the bias."""

    bias_node: Optional[gs.Node] = None
    """The node that adds the bias (the Add, or the fused norm node)."""

    bias_index: Optional[int] = None
    """Which input of `bias_node` carries the bias: a fold writes zeros there."""

    bias_dtype: Optional[np.dtype] = None
    """The dtype the bias has where `bias_node` reads it."""

    @property
    def consumers(self) -> list[gs.Node]:
        return list(self.output.outputs)

    @property
    def is_weightless(self) -> bool:
        """No gain other than ones and, for a LayerNorm, no bias other than zeros."""
        gainless = self.gain is None or bool(np.all(self.gain == 1.0))
        return gainless and (self.bias is None or not np.any(self.bias))
