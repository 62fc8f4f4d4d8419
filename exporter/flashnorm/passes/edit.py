"""The one protocol of a fold's weight edits, float or quantized: a planner reads and measures a
consumer without changing the graph and returns a `WeightEdit` (or raises its one-line reason);
`apply` writes the edit; the pass reports what the plans measured.

Float weights (`passes.fold.FloatEdit`: W* = diag(g)·W, rounded once) and quantized ones
(`passes.quantized.QuantEdit`: scales that take g, or requantized codes) are both applied by
`passes.fold.apply_fold` through this interface, and a new kind of edit (a bias, a centring) is
one more subclass."""

from __future__ import annotations

import abc
from typing import Optional

import numpy as np
import onnx_graphsurgeon as gs


class WeightEdit(abc.ABC):
    """One consumer of a norm site whose weights take the site's gain."""

    node: gs.Node
    """The consumer."""

    weight: gs.Tensor
    """The tensor that names what is edited (the weight, its codes, a prescale vector)."""

    shared_with: list[str]
    """Readers of that tensor outside this consumer ('MatMul 'name''): a tied weight, copied on apply."""

    @abc.abstractmethod
    def apply(self, gain: np.ndarray) -> list[gs.Node]:
        """Rewire the consumer to new constants holding the folded values (computed lazily, when
        saved), for `gain` (float64, [K]); return the nodes the caller adds to the graph."""

    def float_weight(self) -> Optional[tuple[np.ndarray, int]]:
        """The float weight a quantizer run after the fold would see, unfolded, with the axis the
        gain runs over (0: [K, N], 1: [N, K]); None when the edit leaves no such weight to
        quantize (it is quantized already, or the gain goes into a scale in front of it)."""
        return None
