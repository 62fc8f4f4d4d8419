"""flashnorm.rounding.round_centred: a centred weight rounded to fp16/bf16 whose rounded columns
still sum to zero, every element one of the two representable values around its exact one.

What is checked of every result: (1) each element is its exact value's nearest representable
value or the neighbour on the exact value's other side (within one spacing); (2) no single
element moved to its other neighbour (or back) would bring its column's sum nearer zero — the
bound the module promises; (3) the rounding error grows by a small fraction. Random columns of
realistic sizes sum to exactly zero; columns of a few elements are compared with every choice.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from flashnorm.rounding import round_centred

ml_dtypes = pytest.importorskip("ml_dtypes")
DTYPES = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def _neighbours(exact: np.ndarray, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """(nearest, other) in float64: the representable values around each exact value (other =
    nearest where the exact value is representable)."""
    nearest = exact.astype(dtype)
    wide = nearest.astype(np.float64)
    other = np.nextafter(nearest, np.where(exact > wide, np.inf, -np.inf).astype(dtype)).astype(np.float64)
    return wide, np.where(wide == exact, wide, other)


def _check(weight: np.ndarray, axis: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """round_centred's result checked for (1) and (2) of the module docstring; returns it, the
    exact centred weight and its nearest rounding (float64)."""
    exact = weight - weight.mean(axis=axis, keepdims=True)
    result = round_centred(weight, axis, dtype)
    assert result.dtype == dtype and result.shape == weight.shape
    rounded = result.astype(np.float64)
    nearest, other = _neighbours(exact, dtype)
    assert np.all((rounded == nearest) | (rounded == other)), "an element left its two neighbours"
    assert np.all(np.isfinite(rounded))
    total = rounded.sum(axis=axis, keepdims=True)
    alternative = np.where(rounded == nearest, other, nearest)
    better = np.abs(total + (alternative - rounded)) < np.abs(total)
    assert not better.any(), f"{int(better.sum())} single moves would still shrink a column's sum"
    return rounded, exact, nearest


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("name", DTYPES)
def test_random_columns_sum_to_zero(name, axis, rng):
    """Columns of K = 768 drawn like a folded LayerNorm weight (a gain per channel times a normal
    weight): most fp16 sums reach exactly zero, the others stop a few of the column's finest
    spacings short (an element of that spacing moving the right way is rare); the median sum ends
    thousands of times below the nearest rounding's, the largest hundreds; the rounding error
    grows by under 1 % (20 seeds: at least 59 % of the fp16 sums zero, the largest 0.0022 and the
    median at most 0.00016 of the nearest rounding's median, the error 0.33 % larger)."""
    dtype = DTYPES[name]
    shape = (768, 96) if axis == 0 else (96, 768)
    gain = rng.uniform(0.2, 5.0, 768)
    weight = rng.standard_normal(shape) * 0.02 * (gain[:, None] if axis == 0 else gain[None, :])
    rounded, exact, nearest = _check(weight, axis, dtype)
    sums, nearest_sums = np.abs(rounded.sum(axis=axis)), np.abs(nearest.sum(axis=axis))
    if name == "float16":
        assert np.mean(sums == 0) >= 0.4, sums
    assert np.median(sums) <= 1e-3 * np.median(nearest_sums), (np.median(sums), np.median(nearest_sums))
    assert np.max(sums) <= 1e-2 * np.median(nearest_sums), (sums.max(), np.median(nearest_sums))
    assert np.linalg.norm(rounded - exact) <= 1.01 * np.linalg.norm(nearest - exact)


@pytest.mark.parametrize("name", DTYPES)
def test_short_columns_against_every_choice(name, rng):
    """Columns of 3 to 9 elements at scales from 1e-6 to 100: never further from zero than
    rounding to nearest, never nearer than the best of all 2^K choices of neighbours, and at that
    best in most columns (single moves miss combinations such as one move of 2s and one of −s)."""
    dtype = DTYPES[name]
    at_best = trials = 0
    for _ in range(60):
        k = int(rng.integers(3, 10))
        weight = rng.standard_normal(k) * 10.0 ** rng.uniform(-6, 2) * rng.uniform(0.01, 1.0, k) ** rng.integers(0, 3)
        rounded, exact, nearest = _check(weight, 0, dtype)
        _, other = _neighbours(exact, dtype)
        best = min(abs(np.where(np.array(choice, bool), other, nearest).sum())
                   for choice in itertools.product((0, 1), repeat=k))
        assert best <= abs(rounded.sum()) <= abs(nearest.sum())
        at_best += abs(rounded.sum()) == best
        trials += 1
    assert at_best >= 0.5 * trials, (at_best, trials)


@pytest.mark.parametrize("name", DTYPES)
def test_adversarial_columns(name):
    dtype = DTYPES[name]
    # Every element but one the same value, rounded the same way: the residual builds up over
    # the whole column and comes out of many equal elements.
    repeated = np.r_[np.full(511, 0.1), -51.1]
    rounded, _, nearest = _check(repeated, 0, dtype)
    spacing = abs(float(np.spacing(np.asarray(0.1).astype(dtype)).astype(np.float64)))
    assert abs(nearest.sum()) > 10 * spacing and abs(rounded.sum()) <= spacing / 2
    # Representable already: nothing to move.
    exact = np.array([[1.0, 0.5], [2.0, -0.25], [-3.0, -0.25]])
    np.testing.assert_array_equal(round_centred(exact, 0, dtype).astype(np.float64), exact)
    # A constant column centres to zeros.
    assert not np.any(round_centred(np.full((7, 3), 3.25), 0, dtype).astype(np.float64))
    # Exactly at midpoints (a move costs nothing), at subnormal scale, next to the largest finite
    # value (whose other neighbour is infinite: it never moves there), one huge element among
    # small ones, and the two layouts of one weight.
    unit = 2.0 ** -(10 if name == "float16" else 7)
    ties = 1.0 + unit / 2 + unit * np.arange(9)
    ties[-1] = -ties[:-1].sum()
    largest = float(np.asarray(ml_dtypes.finfo(dtype).max, np.float64))
    rng = np.random.default_rng(0)
    for column in (ties, rng.standard_normal(300) * 3e-7, np.r_[largest * 0.999, -largest * 0.998, rng.standard_normal(30)],
                   np.r_[1e4, rng.standard_normal(200) * 1e-3]):
        _check(column, 0, dtype)
    weight = rng.standard_normal((64, 40))
    np.testing.assert_array_equal(round_centred(weight, 0, dtype).astype(np.float64),
                                  round_centred(np.asfortranarray(weight), 0, dtype).astype(np.float64))
    np.testing.assert_array_equal(round_centred(weight, 0, dtype).T.astype(np.float64),
                                  round_centred(np.ascontiguousarray(weight.T), 1, dtype).astype(np.float64))


@pytest.mark.parametrize("name", DTYPES)
def test_rounding_again_changes_nothing(name, rng):
    """Defer re-centres the weight the fold rounded: a column summing to zero has a mean of zero,
    and the same values come back."""
    dtype = DTYPES[name]
    once = round_centred(rng.standard_normal((256, 64)) * 0.05, 0, dtype)
    zero = once[:, once.astype(np.float64).sum(axis=0) == 0]
    assert zero.shape[1] >= 8
    np.testing.assert_array_equal(round_centred(zero.astype(np.float64), 0, dtype).view(np.uint16), zero.view(np.uint16))


def test_float32_is_rounded_to_nearest(rng):
    weight = rng.standard_normal((300, 20))
    expected = (weight - weight.mean(axis=0, keepdims=True)).astype(np.float32)
    np.testing.assert_array_equal(round_centred(weight, 0, np.float32), expected)
    np.testing.assert_array_equal(round_centred(weight, 0, "float32"), expected)
    assert round_centred(weight, 0, "bfloat16").dtype == DTYPES["bfloat16"]
