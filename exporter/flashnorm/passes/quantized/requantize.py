"""Requantization of a folded weight, and the error it adds.

A quantized weight stores codes q and, per group of elements (a block along K, an output
channel, the whole tensor), a scale s and possibly a zero point z: W = (q − z)·s. Folding the
gain g (which varies along K) gives the target T = diag(g)·W, computed in float64 from the
dequantized weight. Where a group spans several input channels, T is not on the group's grid
any more and must be quantized again in the same format.

`requantize` does that per group with a search over the clipping ratio: for each candidate
ratio r (`CLIP_RATIOS`) the group's range is shrunk to r times its extremes, the scale (and
zero point, where the format stores one) computed from it and cast to the scale's stored
dtype, the group quantized with that stored scale, and the candidate kept whose squared
error Σ(W' − T)² over the group is smallest. The error is measured in the folded weight's own
space, which already carries g: a row with a large gain counts for as much as it weighs in
the projection's output.

The error metric (`QuantError`), per weight:

- `rel_error` = ‖W' − T‖_F / ‖T‖_F: the relative change the fold makes to the quantized
  model's projection, for normalized inputs x̂ whose channels are uncorrelated with unit
  variance (what the norm produces): E‖x̂(W' − T)‖² / E‖x̂T‖² is exactly this ratio squared.
- `own_noise` = sqrt(Σ g_k²·Δ²/12) / ‖T‖_F, where Δ is the original quantization step of
  each element (|s| for integer codes, s times the code's unit in the last place for fp8):
  the same relative output error the original quantization already has against the float
  weights it came from (uniform rounding noise, seen through the gain).
- `noise_ratio` = rel_error / own_noise: how much the fold adds, in units of the format's
  own noise. 0 for an exact fold; 1 means the fold adds as much error as quantizing did
  (the output's noise against the float model grows by about √2).

Exact folds (a prescale Mul, scales per input channel) report `noise_ratio` 0 and, as
`rel_error`, what rounding the new scales to their stored type did.

The scales' dtype is kept (float32, float16, bfloat16), and every error is computed with the
scale as stored.

Cost: about 0.5 µs per weight element on one CPU core (a 4096×4096 int4 weight in 7–13 s),
paid twice, when planning (to measure) and when saving (to write, so that no requantized
weight waits in memory for the save).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

CLIP_RATIOS: tuple[float, ...] = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)
"""Candidate clipping ratios of the per-group search (1.0: the group's full range)."""

FP8_MAX = 448.0  # float8e4m3fn's largest finite value
_CHUNK_ELEMENTS = 1 << 20  # groups are requantized this many elements at a time


class RequantizeError(Exception):
    """Why a weight cannot be requantized in its format (one line)."""


@dataclasses.dataclass(frozen=True)
class Grid:
    """The codes a format stores: integers in [qmin, qmax], or float8e4m3fn values."""

    name: str
    qmin: int = 0
    qmax: int = 0
    fp8: bool = False

    @staticmethod
    def integer(bits: int, signed: bool) -> "Grid":
        if signed:
            return Grid(f"int{bits}", -(1 << (bits - 1)), (1 << (bits - 1)) - 1)
        return Grid(f"uint{bits}", 0, (1 << bits) - 1)


FP8_E4M3FN = Grid("float8e4m3fn", fp8=True)


@dataclasses.dataclass
class Requantized:
    """One weight requantized, as [G, L] groups: codes (int64, or float64 holding fp8 values),
    the stored scale and zero point per group, and the squared error per group."""

    codes: np.ndarray
    scale: np.ndarray
    """[G] float64 values the scale dtype holds exactly (what the file will store)."""

    zero_point: Optional[np.ndarray]
    """[G] int64 when the format stores zero points (float64 for float zero points); None otherwise."""

    squared_error: np.ndarray
    ratio: np.ndarray
    """[G] the clipping ratio chosen per group."""


def _cast(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        return values.astype(dtype).astype(np.float64)


def fp8_round(values: np.ndarray) -> np.ndarray:
    """float64 values rounded to float8e4m3fn (saturating at ±448, as QuantizeLinear does)."""
    import ml_dtypes

    return np.clip(values, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def fp8_ulp(codes: np.ndarray) -> np.ndarray:
    """The unit in the last place of float8e4m3fn values (3 mantissa bits, subnormals below 2⁻⁶)."""
    magnitude = np.maximum(np.abs(codes), 2.0 ** -6)
    return 2.0 ** (np.floor(np.log2(magnitude)) - 3)


def _candidates(target: np.ndarray, grid: Grid, free_zero_point: bool, fixed_zero: int, ratio: float,
                scale_dtype: np.dtype, zero_dtype: Optional[np.dtype] = None) -> list[tuple[np.ndarray, Optional[np.ndarray]]]:
    """(scale [G] as stored, zero point [G] or None) candidates for one clipping ratio."""
    hi = np.maximum(target.max(axis=1), 0.0) * ratio
    lo = np.minimum(target.min(axis=1), 0.0) * ratio
    if grid.fp8:
        return [(_cast(np.maximum(hi, -lo) / FP8_MAX, scale_dtype), None)]
    if free_zero_point:
        scale = _cast((hi - lo) / (grid.qmax - grid.qmin), scale_dtype)
        with np.errstate(divide="ignore", invalid="ignore"):
            exact_zero = grid.qmin - lo / scale
            zero = np.clip(exact_zero if zero_dtype is not None else np.round(exact_zero), grid.qmin, grid.qmax)
        zero = np.where(np.isfinite(zero), zero, fixed_zero)
        return [(scale, _cast(zero, zero_dtype) if zero_dtype is not None else zero)]
    # Fixed zero point: codes c = q − z in [cmin, cmax]; a positive scale maps the largest
    # value to cmax (or the smallest to cmin), a negative one maps them the other way round
    # (MatMulNBits' symmetric quantizer writes negative scales: the extreme lands on −8).
    cmin, cmax = grid.qmin - fixed_zero, grid.qmax - fixed_zero
    with np.errstate(divide="ignore", invalid="ignore"):
        positive = np.maximum(hi / cmax if cmax > 0 else 0.0, lo / cmin if cmin < 0 else 0.0)
        negative = np.maximum(hi / -cmin if cmin < 0 else 0.0, -lo / cmax if cmax > 0 else 0.0)
    result = [(_cast(positive, scale_dtype), None)]
    if cmin < 0 < cmax:
        result.append((_cast(-negative, scale_dtype), None))
    return result


def _quantize(target: np.ndarray, grid: Grid, scale: np.ndarray, zero: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes, dequantized values) of `target` [G, L] on the grid with scale and zero point [G]."""
    safe = np.where(scale == 0, 1.0, scale)[:, None]
    if grid.fp8:
        codes = fp8_round(target / safe)
        return codes, codes * safe
    codes = np.clip(np.round(target / safe + zero[:, None]), grid.qmin, grid.qmax)
    return codes, (codes - zero[:, None]) * safe


def requantize(target: np.ndarray, grid: Grid, scale_dtype: np.dtype, *, free_zero_point: bool = False,
               fixed_zero: int = 0, zero_dtype: Optional[np.dtype] = None,
               ratios: tuple[float, ...] = CLIP_RATIOS) -> Requantized:
    """Quantize `target` [G, L] (float64) per group on `grid`, scales stored in `scale_dtype`,
    choosing per group the clipping ratio of least squared error. `free_zero_point`: the
    format stores an integer zero point per group (recomputed); otherwise every group's zero
    point is `fixed_zero`. `zero_dtype`: the zero points are stored as floats of that type (not
    rounded to a code; MatMulNBits' zero points of the scales' type). RequantizeError where no candidate gives a finite scale the dtype
    holds (a folded block beyond the scale type's range)."""
    groups, length = target.shape
    codes = np.empty((groups, length), dtype=np.float64)
    best_scale = np.zeros(groups)
    best_zero = np.full(groups, float(fixed_zero))
    best_error = np.full(groups, np.inf)
    best_ratio = np.ones(groups)
    step = max(1, _CHUNK_ELEMENTS // max(length, 1))
    for start in range(0, groups, step):
        part = slice(start, start + step)
        block = target[part]
        for ratio in ratios:
            for scale, zero in _candidates(block, grid, free_zero_point, fixed_zero, ratio, scale_dtype, zero_dtype):
                zero = np.full(len(scale), float(fixed_zero)) if zero is None else zero
                valid = np.isfinite(scale) & ((scale != 0) | (np.abs(block).max(axis=1) == 0))
                candidate, values = _quantize(block, grid, scale, zero)
                error = np.where(valid, ((values - block) ** 2).sum(axis=1), np.inf)
                better = error < best_error[part]
                if not better.any():
                    continue
                index = np.flatnonzero(better) + start
                codes[index] = candidate[better]
                best_scale[index], best_zero[index] = scale[better], zero[better]
                best_error[index], best_ratio[index] = error[better], ratio
    if not np.all(np.isfinite(best_error)):
        bad = int(np.flatnonzero(~np.isfinite(best_error))[0])
        raise RequantizeError(f"group {bad}: no scale that {scale_dtype.name} holds quantizes the folded values "
                              f"(largest {float(np.abs(target[bad]).max()):.6g})")
    # An all-zero group keeps a scale of 1 rather than 0 (a zero scale is legal but odd).
    best_scale = np.where(best_scale == 0, _cast(np.ones(1), scale_dtype), best_scale)
    if not grid.fp8:
        codes = codes.astype(np.int64)
    zero_point = None
    if free_zero_point:
        zero_point = best_zero if zero_dtype is not None else best_zero.astype(np.int64)
    return Requantized(codes, best_scale, zero_point, best_error, best_ratio)


@dataclasses.dataclass(frozen=True)
class QuantError:
    """What folding did to one quantized weight (the module docstring defines each value)."""

    rel_error: float
    own_noise: float
    noise_ratio: float
    clip_ratios: dict[str, float] = dataclasses.field(default_factory=dict)
    """Requantized weights: the share of groups that chose each clipping ratio."""

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def measure(target: np.ndarray, result_values: np.ndarray, own_variance: float,
            ratio: Optional[np.ndarray] = None) -> QuantError:
    """QuantError of `result_values` against `target` (same shape, float64), the original
    quantization's noise being Σ g²Δ²/12 = `own_variance`."""
    norm = float(np.linalg.norm(target))
    error = float(np.linalg.norm(result_values - target))
    return error_from_sums(error ** 2, norm ** 2, own_variance, ratio)


def error_from_sums(squared_error: float, squared_norm: float, own_variance: float,
                    ratio: Optional[np.ndarray] = None) -> QuantError:
    norm = np.sqrt(squared_norm)
    rel = float(np.sqrt(squared_error) / norm) if norm > 0 else 0.0
    own = float(np.sqrt(own_variance) / norm) if norm > 0 else 0.0
    noise_ratio = rel / own if own > 0 else (0.0 if rel == 0 else float("inf"))
    clip = {}
    if ratio is not None and ratio.size:
        values, counts = np.unique(np.round(ratio, 4), return_counts=True)
        clip = {f"{v:g}": round(float(c) / ratio.size, 4) for v, c in zip(values, counts)}
    return QuantError(rel, own, noise_ratio, clip)
