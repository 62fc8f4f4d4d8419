"""A LayerNorm's centred weight rounded to a half type with its columns still summing to zero.

The fold centres a LayerNorm's weight over K in float64 (W_c = W* − (1/K)·1·(1ᵀW*), so 1ᵀW_c = 0)
and defer relies on it: the node computes x·Ŵ_c = (x − μ1)·Ŵ_c + μ·(1ᵀŴ_c), the LayerNorm's result
only where the STORED columns sum to zero. Rounded to nearest, each element is off by up to half
its spacing and a column of K elements sums to about 0.3·√K spacings: the node is then off by
μ·(1ᵀŴ_c)/σ, tens of times the half graph's own error at |μ|/σ = 100 (docs/LAYERNORM.md, "Where
rounding enters").

`round_centred` rounds to nearest, then moves elements of each column to their other neighbouring
value (the one on the exact value's other side: every element stays one of the two representable
values around its exact one) until no single move brings the column's sum nearer zero; the sum
is then zero wherever the column has an element of its finest spacing to move the right way
(tests/test_rounding.py). A move changes the sum by the element's spacing s and the element's
error from |e| to s − |e|, so moves are taken from the elements lying nearest the midpoint
between their two neighbours, and only towards zero, never past it while a move that stops short
is left (past zero, the moves left may all go the old way):

1. Coarse to fine: the elements within δ = 2^-b ≈ 0.75/√K spacings of their midpoint (about 2δ
   of the elements, read off the float64 bits below the type's mantissa; a column needs about
   0.3·√K moves), spacing by spacing from the largest, per column floor(|sum|/s) of them, those
   within δ/2 first. This leaves |sum| below the finest spacing among them.
2. Finish: every element whose spacing s ≤ |sum| (read off its exponent bits), moves already
   made included (undoing one lowers the error, so undos go first), in rounds nearest the
   midpoint first, per column the longest run whose spacings add up to at most |sum|; where the
   sum is still not zero, one move past zero that shrinks |sum| (s < 2|sum|), after which the
   elements moving the other way are looked for again.

The extra error is below half a per cent of the rounding error's L2 norm (tests/test_rounding.py).
Float32 weights are rounded to nearest: their column sums add about 0.3·√K·2⁻²⁴·|μ|/σ relative, a
small share of what the fp32 node's own accumulation over the raw x adds (docs/LAYERNORM.md).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np

COMPENSATED_TYPES = frozenset({"float16", "bfloat16"})
"""The types `round_centred` compensates; others are rounded to nearest."""

_MANTISSA_BITS = {"float16": 10, "bfloat16": 7}

_BAND_SCALE = 0.75
"""The band δ ≈ _BAND_SCALE/√K of step 1 (about 2δK ≈ 1.5√K candidates a column): on a
4096×12288 fp16 weight 0.75 took 0.82 s, 0.375 2.5 s (step 2 has more to do), 1.5 0.82 s with
twice the extra error."""

_BLOCK_ELEMENTS = 1 << 18
"""Elements searched for candidates at a time: a few MiB, so that the block stays in cache."""

_FINISH_BANDS = np.ldexp(1.0, -np.arange(8, -1, -1))
"""The finishing rounds' bands of extra error over spacing (1 − 2|e|/s): undos (below 0) and
moves nearest the midpoint first."""


def round_centred(weight: np.ndarray, axis: int, dtype: np.dtype | str) -> np.ndarray:
    """`weight` (float64, 1-D or 2-D) centred over `axis` (each column minus its mean: the
    slices along `axis` sum to zero) and rounded to `dtype` so that each rounded slice still sums
    as near zero as moving single elements to their other neighbour can bring it (float16,
    bfloat16: module docstring; other types rounded to nearest). Returns a new array of `dtype`."""
    if isinstance(dtype, str) and dtype == "bfloat16":
        import ml_dtypes  # names the type to numpy

        dtype = ml_dtypes.bfloat16
    dtype = np.dtype(dtype)
    if weight.ndim not in (1, 2):
        raise ValueError(f"round_centred takes a 1-D or 2-D weight, not {weight.ndim}-D")
    axis = axis % weight.ndim
    centred = np.asarray(weight, dtype=np.float64)
    centred = centred - centred.mean(axis=axis, keepdims=True)
    rounded = centred.astype(dtype)
    if dtype.name in COMPENSATED_TYPES and centred.size:
        _compensate(centred.reshape(centred.shape[0], -1), rounded.reshape(rounded.shape[0], -1), axis)
    return rounded


def _compensate(exact: np.ndarray, rounded: np.ndarray, axis: int) -> None:
    """Move elements of `rounded` (2-D, `exact` rounded to nearest) in place so that its slices
    along `axis` sum nearer zero: module docstring."""
    residual = rounded.sum(axis=axis, dtype=np.float64)
    live = np.isfinite(residual) & (residual != 0)
    if not live.any():
        return
    # [columns, K] views: candidates are found a block of columns at a time and kept by column.
    exact_columns, rounded_columns = np.moveaxis(exact, axis, -1), np.moveaxis(rounded, axis, -1)
    mantissa_bits = _MANTISSA_BITS[rounded.dtype.name]
    band = 2.0 ** -math.floor(math.log2(max(2.0, math.sqrt(exact.shape[axis]) / _BAND_SCALE)))
    if band < 0.5:  # else the finishing rounds alone see every element
        # Where [1/2 − band, 1/2 + band) of a spacing starts, and its width, as the top 64 bits of
        # the fraction below the type's mantissa.
        low, width = np.uint64(int((0.5 - band) * 2.0**64)), np.uint64(int(2 * band * 2.0**64))
        shift = np.uint64(12 + mantissa_bits)

        def near_midpoint(columns: slice, bits: np.ndarray, found: np.ndarray) -> None:
            np.left_shift(exact_columns[columns].view(np.uint64), shift, out=bits)
            np.subtract(bits, low, out=bits)
            np.less(bits, width, out=found)

        moves = _candidates(exact_columns, rounded_columns, residual, live, axis, np.uint64, near_midpoint)
        _coarse_to_fine(rounded_columns, residual, moves, band)
        live = np.isfinite(residual) & (residual != 0)
    while live.any():
        # Moves that stop short of zero (spacing s ≤ |sum|); then, where the sum is not zero yet,
        # one past zero that still shrinks |sum| (s < 2|sum|): its sign turns, and the elements
        # moving the other way are looked for again. An element's bracketing spacing s is at least
        # half the spacing of its rounded value, read off its exponent bits.
        with np.errstate(divide="ignore"):
            fits = np.floor(np.log2(2.0 * np.abs(residual))) + 1  # spacing ≤ 2|sum|
        moves = _candidates(exact_columns, rounded_columns, residual, live, axis, np.uint16,
                            _spacing_below(rounded_columns, fits, live, mantissa_bits))
        _fit(rounded_columns, residual, moves)
        live &= residual != 0
        if not live.any():
            break
        with np.errstate(divide="ignore"):
            passes = np.ceil(np.log2(4.0 * np.abs(residual)))  # spacing < 4|sum|
        moves = _candidates(exact_columns, rounded_columns, residual, live, axis, np.uint16,
                            _spacing_below(rounded_columns, passes, live, mantissa_bits))
        live = _pass_zero(rounded_columns, residual, moves)


def _spacing_below(rounded: np.ndarray, power: np.ndarray, live: np.ndarray,
                   mantissa_bits: int) -> Callable[[slice, np.ndarray, np.ndarray], None]:
    """The `_candidates` test of the elements of `rounded` ([columns, K]) whose value's spacing is
    below 2^power (per column; none in dead columns), compared as magnitude bits."""
    exponent_bits = 15 - mantissa_bits
    first = power + (1 << (exponent_bits - 1)) - 1 + mantissa_bits  # the exponent field of that spacing
    first = np.clip(np.where(live, first, 0.0), 0, (1 << exponent_bits) - 1).astype(np.uint16)
    limit = first << np.uint16(mantissa_bits)

    def test(columns: slice, bits: np.ndarray, found: np.ndarray) -> None:
        np.bitwise_and(rounded[columns].view(np.uint16), np.uint16(0x7FFF), out=bits)
        np.less(bits, limit[columns, None], out=found)

    return test


def _candidates(exact: np.ndarray, rounded: np.ndarray, residual: np.ndarray, live: np.ndarray, axis: int,
                bits_type: type, test: Callable[[slice, np.ndarray, np.ndarray], None]) -> "_Moves":
    """The moves towards zero (against the sign of its column's `residual`) of the elements of
    live columns of `rounded` ([columns, K] views of the weight whose K runs along `axis`) that
    `test(columns, bits, found)` marks in `found`, a block of columns at a time (`bits`: scratch
    of `bits_type`; both laid out as the weight, so that every pass reads memory in order and the
    block stays in cache while its candidates are read)."""
    count, length = exact.shape
    block = max(1, _BLOCK_ELEMENTS // length)
    scratch = (length, block) if axis == 0 else (block, length)
    bits = np.moveaxis(np.empty(scratch, dtype=bits_type), axis, -1)
    found = np.moveaxis(np.empty(scratch, dtype=bool), axis, -1)
    parts = []
    for start in range(0, count, block):
        columns = slice(start, min(start + block, count))
        if not live[columns].any():
            continue
        width = columns.stop - start
        test(columns, bits[:width], found[:width])
        found[:width] &= live[columns, None]
        column, index = found[:width].nonzero()  # by column, then index
        value = rounded[columns][column, index]
        wanted = exact[columns][column, index]
        near = value.astype(np.float64)
        up = wanted > near
        towards_zero = np.flatnonzero((up == (residual[columns][column] < 0)) & (wanted != near))
        column, index, value, wanted, near, up = (a[towards_zero] for a in (column, index, value, wanted, near, up))
        other = np.nextafter(value, np.where(up, np.inf, -np.inf).astype(value.dtype))
        step = other.astype(np.float64) - near
        movable = np.isfinite(step) & (step != 0)  # not exact already, the neighbour finite
        step = step[movable]
        extra = 1.0 - 2.0 * np.abs(wanted[movable] - near[movable]) / np.abs(step)
        parts.append((column[movable] + start, index[movable], other[movable], step, extra))
    if not parts:
        return _Moves(*(np.empty(0, dtype) for dtype in (np.intp, np.intp, rounded.dtype, np.float64, np.float64)))
    return _Moves(*(np.concatenate(arrays) for arrays in zip(*parts)))


@dataclasses.dataclass
class _Moves:
    """Candidate moves, grouped by column: element [`column`, `index`] of a [columns, K] view of
    the weight goes from its current value to `other`, its neighbour on its exact value's other
    side."""

    column: np.ndarray
    index: np.ndarray
    other: np.ndarray
    step: np.ndarray
    """other − current (float64): ± the element's spacing."""

    extra: np.ndarray
    """The move's extra error over the spacing, 1 − 2|error|/spacing: 0 at the midpoint, < 0 for an undo."""

    def make(self, rounded: np.ndarray, chosen: np.ndarray) -> None:
        rounded[self.column[chosen], self.index[chosen]] = self.other[chosen]


def _coarse_to_fine(rounded: np.ndarray, residual: np.ndarray, moves: _Moves, band: float) -> None:
    """Step 1 of the module docstring: `residual` (the column sums) updated, moves made in `rounded`."""
    if moves.step.size == 0:
        return
    _, exponent = np.frexp(np.abs(moves.step))  # |step| = 2^(exponent − 1)
    key = (moves.extra > band).astype(np.int16) - 2 * exponent.astype(np.int16)
    order = np.argsort(key, kind="stable")  # by spacing, largest first, nearest first; still by column
    key, column, step = key[order], moves.column[order], moves.step[order]
    chosen = np.zeros(order.size, dtype=bool)
    edges = np.r_[0, np.flatnonzero(np.diff(key)) + 1, order.size]
    for start, stop in zip(edges[:-1], edges[1:]):
        owner, change = column[start:stop], step[start:stop]
        wanted = np.floor(np.abs(residual[owner]) / abs(change[0]))  # never past zero
        useful = change * residual[owner] < 0
        first = np.r_[True, owner[1:] != owner[:-1]]
        rank = np.cumsum(useful)
        rank -= np.maximum.accumulate(np.where(first, rank - useful, 0))  # 1, 2, ... within each column
        taken = useful & (rank <= wanted)
        residual += np.bincount(owner[taken], weights=change[taken], minlength=residual.size)
        chosen[start:stop] = taken
    moves.make(rounded, order[chosen])


def _fit(rounded: np.ndarray, residual: np.ndarray, moves: _Moves) -> None:
    """Step 2's moves that stop short of zero, from `moves` (all towards zero), nearest the
    midpoint first: `residual` (the column sums) updated, moves made in `rounded`."""
    column, step = moves.column, moves.step
    level = np.searchsorted(_FINISH_BANDS, moves.extra)
    moved = np.zeros(column.size, dtype=bool)
    for last in range(_FINISH_BANDS.size):
        candidates = np.flatnonzero(level <= last)
        while candidates.size:
            owner = column[candidates]
            fitting = ~moved[candidates] & (np.abs(step[candidates]) <= np.abs(residual[owner]))
            if not fitting.any():
                break
            chosen, owner = candidates[fitting], owner[fitting]
            first = np.r_[True, owner[1:] != owner[:-1]]
            run = np.cumsum(np.abs(step[chosen]))
            run -= np.maximum.accumulate(np.where(first, run - np.abs(step[chosen]), 0.0))  # within each column
            taken = chosen[run <= np.abs(residual[owner])]
            residual += np.bincount(column[taken], weights=step[taken], minlength=residual.size)
            moved[taken] = True
            # Columns that had no such move, or now sum to zero, are done with this band.
            still = np.zeros(residual.size, dtype=bool)
            still[owner] = True
            still &= residual != 0
            candidates = candidates[~moved[candidates] & still[column[candidates]]]
    moves.make(rounded, moved)


def _pass_zero(rounded: np.ndarray, residual: np.ndarray, moves: _Moves) -> np.ndarray:
    """Step 2's move past zero: per column, of `moves` (all towards zero), the one nearest its
    midpoint among those that shrink |sum|. Returns the columns whose sum turned sign."""
    column = moves.column
    past = np.flatnonzero(np.abs(moves.step) < 2.0 * np.abs(residual[column]))
    past = past[np.lexsort((moves.extra[past], column[past]))]
    past = past[np.r_[True, column[past][1:] != column[past][:-1]]] if past.size else past
    residual += np.bincount(column[past], weights=moves.step[past], minlength=residual.size)
    moves.make(rounded, past)
    turned = np.zeros(residual.size, dtype=bool)
    turned[column[past]] = True
    return turned & (residual != 0)
