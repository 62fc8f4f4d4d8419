"""Optimization-profile shapes: `NAME:MIN,OPT,MAX` on the command line, each shape written
`1x64` (trtexec's spelling), or derived from the inputs a comparison feeds."""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Mapping

import numpy as np

from flashnorm.errors import FlashNormError

MAX_ELEMENTS = 2**63 - 1
"""TensorRT's dimensions and element counts are int64: a larger shape would overflow its bindings."""


@dataclasses.dataclass(frozen=True)
class ShapeRange:
    """The shapes one dynamic input may take in a profile: minimum ≤ optimum ≤ maximum."""

    minimum: tuple[int, ...]
    optimum: tuple[int, ...]
    maximum: tuple[int, ...]

    def __post_init__(self) -> None:
        ranks = {len(self.minimum), len(self.optimum), len(self.maximum)}
        if len(ranks) != 1:
            raise FlashNormError(f"min, opt and max shapes have different ranks: {self.describe()}")
        for low, mid, high in zip(self.minimum, self.optimum, self.maximum):
            if not 0 <= low <= mid <= high:
                raise FlashNormError(f"shapes must satisfy 0 <= min <= opt <= max in every dimension: {self.describe()}")
        if math.prod(self.maximum) > MAX_ELEMENTS:
            raise FlashNormError(f"the max shape of {self.describe()} has {math.prod(self.maximum):.3g} elements; "
                                 f"TensorRT counts a tensor's elements in an int64 (at most {MAX_ELEMENTS})")

    def describe(self) -> str:
        return ",".join("x".join(str(d) for d in shape) for shape in (self.minimum, self.optimum, self.maximum))

    def contains(self, shape: Iterable[int]) -> bool:
        shape = tuple(int(d) for d in shape)
        return len(shape) == len(self.minimum) and all(
            low <= d <= high for low, d, high in zip(self.minimum, shape, self.maximum)
        )


def parse_shape(text: str) -> tuple[int, ...]:
    """'1x64' → (1, 64); '' → () (a scalar)."""
    text = text.strip()
    if not text:
        return ()
    try:
        return tuple(int(d) for d in text.lower().split("x"))
    except ValueError:
        raise FlashNormError(f"bad shape {text!r}: write dimensions as integers joined by 'x', e.g. 1x64") from None


def parse_shape_spec(spec: str) -> tuple[str, ShapeRange]:
    """'input_ids:1x1,1x64,1x512' → ('input_ids', ShapeRange(...)); 'name:1x64' fixes one shape."""
    name, sep, shapes = spec.rpartition(":")
    if not sep or not name:
        raise FlashNormError(f"bad --shapes {spec!r}: expected NAME:MIN,OPT,MAX (e.g. input_ids:1x1,1x64,1x512)")
    parts = [parse_shape(p) for p in shapes.split(",")]
    if len(parts) == 1:
        parts *= 3
    if len(parts) != 3:
        raise FlashNormError(f"bad --shapes {spec!r}: give one shape or three (MIN,OPT,MAX), got {len(parts)}")
    return name, ShapeRange(*parts)


def parse_shape_specs(specs: Iterable[str]) -> dict[str, ShapeRange]:
    ranges: dict[str, ShapeRange] = {}
    for spec in specs:
        name, shape_range = parse_shape_spec(spec)
        if name in ranges:
            raise FlashNormError(f"--shapes gives input {name!r} twice")
        ranges[name] = shape_range
    return ranges


def shape_ranges_from_feeds(feeds: Iterable[Mapping[str, np.ndarray]]) -> dict[str, ShapeRange]:
    """A profile that covers every feed: per input, the elementwise min and max of the shapes
    fed, with the first feed's shape as the optimum."""
    ranges: dict[str, ShapeRange] = {}
    shapes: dict[str, list[tuple[int, ...]]] = {}
    for feed in feeds:
        for name, value in feed.items():
            shapes.setdefault(name, []).append(tuple(int(d) for d in np.shape(value)))
    for name, seen in shapes.items():
        if len({len(s) for s in seen}) != 1:
            raise FlashNormError(f"input {name!r} is fed with different ranks: {sorted(set(seen))}")
        minimum = tuple(min(s[i] for s in seen) for i in range(len(seen[0])))
        maximum = tuple(max(s[i] for s in seen) for i in range(len(seen[0])))
        optimum = tuple(min(max(d, low), high) for d, low, high in zip(seen[0], minimum, maximum))
        ranges[name] = ShapeRange(minimum, optimum, maximum)
    return ranges
