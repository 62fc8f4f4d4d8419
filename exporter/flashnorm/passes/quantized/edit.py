"""What every quantized fold shares: the edit a format's planner returns, the refusal it
raises, and the lazily computed replacement tensors apply writes."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import numpy as np
import onnx_graphsurgeon as gs

from flashnorm.modelio.values import DerivedValues
from flashnorm.passes.edit import WeightEdit
from flashnorm.passes.quantized.requantize import QuantError


class NotQuantFoldable(Exception):
    """Why a quantized consumer's weight cannot take the gain (one line); `details` go in the report."""

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.details = details


@dataclasses.dataclass
class QuantEdit(WeightEdit):
    """One quantized consumer to fold: planned (and measured) without changing the graph."""

    node: gs.Node
    weight: gs.Tensor
    """The tensor that names the weight (its codes, or the prescale vector)."""

    format: str
    """'MatMulNBits int4 block 32 asymmetric', 'DequantizeLinear int8 per-axis(K)', ..."""

    exact: bool
    error: QuantError
    squared_norm: float
    """‖T‖² of the folded target, to combine the errors of a site's weights."""

    writer: Callable[[np.ndarray], list[gs.Node]] = dataclasses.field(repr=False, default=None)
    """apply: called with the gain (float64, [K]); rewires the node's inputs to new constants
    and returns the nodes to add."""

    shared_with: list[str] = dataclasses.field(default_factory=list)

    def apply(self, gain: np.ndarray) -> list[gs.Node]:
        return self.writer(gain)

    def details(self) -> dict[str, Any]:
        return {"consumer": f"{self.node.op} {self.node.name}", "format": self.format,
                "exact": self.exact, **self.error.to_dict()}


class _PartValues(DerivedValues):
    """One part of a LazyParts: computed from the parts' own reads, never reading `source`
    (kept for what saving asks of a derived tensor's origin)."""

    def load(self) -> np.ndarray:
        values = np.asarray(self.function(None))
        if list(values.shape) != self.shape or values.dtype != self.dtype:
            raise ValueError(f"derived values are {values.dtype}{list(values.shape)}, declared {self.dtype}{self.shape}")
        return values


class LazyParts:
    """Several tensors computed together (a requantized weight's codes, scales and zero points),
    computed when the first is saved or read and dropped once each has been taken, so a model
    holds at most one weight's results in memory."""

    def __init__(self, compute: Callable[[], dict[str, np.ndarray]]) -> None:
        self._compute = compute
        self._result: Optional[dict[str, np.ndarray]] = None
        self._pending: set[str] = set()

    def part(self, name: str) -> np.ndarray:
        if self._result is None:
            self._result = self._compute()
            self._pending = set(self._result)
        value = self._result[name]
        self._pending.discard(name)
        if not self._pending:
            self._result = None
        return value

    def constant(self, name: str, source: gs.Constant, label: str, shape, dtype) -> gs.Constant:
        """A new constant holding part `name` (declared `shape` and `dtype`), derived from `source`."""
        values = _PartValues(source, lambda _: self.part(name), shape=tuple(int(d) for d in shape), dtype=dtype)
        return gs.Constant(label, values)
