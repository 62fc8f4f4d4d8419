"""How sure a quantized budget's verdict is: a 95 % interval for the ratio of two NLL
differences, from a paired bootstrap over contiguous segments of the text.

The budget compares the candidate's extra NLL over the float model with the reference's,
c − f against r − f, both per token of the same text (docs/QUANTIZATION.md). Their ratio is a
ratio of two small means of noisy per-token differences, and neighbouring tokens are not
independent (a hard passage costs every model more for a while). So the text is cut into
segments of `block` contiguous tokens, and each bootstrap resample draws, per text,
as many segments as it has, with replacement; the three models' values of one token always move
together (paired), and the dependence within a segment is kept. The ratio of the resample's sums
gives one draw; the 2.5th and 97.5th percentiles of `resamples` draws are the interval
(percentile bootstrap). The generator is seeded: the same arrays and seed give the same interval.

The verdict against the line (`max_extra_ratio`, 1.1): **within** where the whole interval lies
under it, **over** where it lies above, **inconclusive** where it spans it. For an inconclusive
verdict, the interval's half-width on the line's side shrinks as 1/sqrt(tokens) for text of the
same kind, so about tokens × (half-width / distance to the line)² tokens would settle it if the
ratio stayed where it is.

Where the reference's extra NLL is ≤ 0 (the quantizer costs nothing on this text), there is no
ratio: the statistic is the candidate's extra NLL itself, against `min_allowance` nats.

Text of fewer than `MIN_SEGMENTS` segments in all is too little for an interval: the verdict is
inconclusive whatever the draws say (one segment makes every draw the estimate itself, an interval
of width zero).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import numpy as np

DEFAULT_BLOCK = 64
"""Tokens per bootstrap segment: long enough to hold the dependence between neighbouring
tokens' NLLs, short enough that a text of 2 000 tokens has 30 segments to draw from."""
DEFAULT_RESAMPLES = 2000
MIN_SEGMENTS = 8
"""The fewest segments (over all texts) whose resamples bound the ratio: with n segments there are
C(2n − 1, n) distinct resamples, 6 435 at 8 (one at 1), and a percentile interval from fewer is
narrower than the text's own noise."""
DEFAULT_SEED = 0
CONFIDENCE = 0.95

WITHIN, OVER, INCONCLUSIVE = "within", "over", "inconclusive"


@dataclasses.dataclass(frozen=True)
class Interval:
    """One verdict: the statistic, its interval, and where they lie against the line."""

    statistic: str
    """'ratio' (candidate's extra NLL / reference's) or 'extra' (the candidate's extra NLL, nats,
    where the reference's is ≤ 0)."""
    estimate: float
    low: float
    high: float
    line: float
    verdict: str
    tokens: int
    segments: int
    tokens_to_settle: int | None
    """Inconclusive only: about how many tokens of text of the same kind would settle the
    verdict, if the estimate stayed where it is (None: it sits on the line, or too few segments)."""
    too_few_segments: bool = False
    """Fewer than MIN_SEGMENTS segments: inconclusive, whatever the interval."""

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def _segments(length: int, block: int) -> np.ndarray:
    """Start offsets of the segments of `length` tokens; the last, shorter one joins the one
    before it when it is under half a block (a segment of a few tokens would weigh like a full one
    in the count of draws)."""
    starts = np.arange(0, length, block)
    if starts.size > 1 and length - starts[-1] < block / 2:
        starts = starts[:-1]
    return starts


def _segment_sums(values: np.ndarray, block: int) -> np.ndarray:
    return np.add.reduceat(values, _segments(values.size, block))


def interval(float_nll: Mapping[str, np.ndarray], reference_nll: Mapping[str, np.ndarray],
             candidate_nll: Mapping[str, np.ndarray], *, max_extra_ratio: float, min_allowance: float,
             block: int = DEFAULT_BLOCK, resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED,
             confidence: float = CONFIDENCE) -> Interval:
    """The verdict over every text of the mappings (text name → per-token NLL, the same tokens in
    all three), segments resampled within each text (stratified: every draw keeps each text's
    share of the tokens)."""
    names = list(float_nll)
    if not names or set(names) != set(reference_nll) or set(names) != set(candidate_nll):
        raise ValueError("the three models need per-token NLLs of the same texts")
    if block < 1 or resamples < 1:
        raise ValueError("block and resamples must be positive")
    candidate_parts, reference_parts, counts = [], [], []
    for name in names:
        f, r, c = (np.asarray(m[name], dtype=np.float64).reshape(-1) for m in (float_nll, reference_nll, candidate_nll))
        if not f.size or f.shape != r.shape or f.shape != c.shape:
            raise ValueError(f"text {name!r}: the three per-token NLL arrays differ in length or are empty")
        candidate_parts.append(_segment_sums(c - f, block))
        reference_parts.append(_segment_sums(r - f, block))
        counts.append(_segment_sums(np.ones_like(f), block))
    tokens = int(sum(part.sum() for part in counts))
    # The estimate is summed as each draw is (segment sums, text by text), so a draw that picks every
    # segment once, as every draw of a one-segment text does, equals it to the last bit.
    candidate_total = sum(part.sum() for part in candidate_parts)
    reference_total = sum(part.sum() for part in reference_parts)

    rng = np.random.default_rng(seed)
    draws_candidate = np.zeros(resamples)
    draws_reference = np.zeros(resamples)
    draws_tokens = np.zeros(resamples)
    for cand, ref, count in zip(candidate_parts, reference_parts, counts):
        picks = rng.integers(0, cand.size, size=(resamples, cand.size))
        draws_candidate += cand[picks].sum(axis=1)
        draws_reference += ref[picks].sum(axis=1)
        draws_tokens += count[picks].sum(axis=1)

    if reference_total > 0:
        statistic, estimate, line = "ratio", candidate_total / reference_total, max_extra_ratio
        with np.errstate(divide="ignore", invalid="ignore"):
            # A draw whose reference costs nothing has no ratio: it counts as far above the line.
            draws = np.where(draws_reference > 0, draws_candidate / np.where(draws_reference > 0, draws_reference, 1),
                             np.inf)
    else:
        statistic, estimate, line = "extra", candidate_total / tokens, min_allowance
        draws = draws_candidate / draws_tokens
    low, high = _percentiles(draws, confidence)
    segments = int(sum(part.size for part in counts))
    too_few = segments < MIN_SEGMENTS
    verdict = INCONCLUSIVE if too_few else WITHIN if high <= line else OVER if low > line else INCONCLUSIVE
    settle = None
    if verdict == INCONCLUSIVE and not too_few:
        distance = abs(line - estimate)
        half_width = (high - estimate) if estimate < line else (estimate - low)
        if distance > 0 and math.isfinite(half_width):
            settle = int(math.ceil(tokens * (half_width / distance) ** 2))
    return Interval(statistic, float(estimate), float(low), float(high), float(line), verdict, tokens, segments,
                    settle, too_few)


def _percentiles(draws: np.ndarray, confidence: float) -> tuple[float, float]:
    """The two-sided percentile interval; infinite draws (no ratio) sort above every finite one."""
    ordered = np.sort(draws)
    tail = (1 - confidence) / 2
    low = ordered[int(math.floor(tail * (ordered.size - 1)))]
    high = ordered[int(math.ceil((1 - tail) * (ordered.size - 1)))]
    return float(low), float(high)


def per_text(float_nll: Mapping[str, np.ndarray], reference_nll: Mapping[str, np.ndarray],
             candidate_nll: Mapping[str, np.ndarray], **options) -> dict[str, Interval]:
    """`interval` of each text alone (the same seed for each)."""
    return {name: interval({name: float_nll[name]}, {name: reference_nll[name]}, {name: candidate_nll[name]},
                           **options) for name in float_nll}


def describe(result: Interval | Mapping[str, object], confidence: float = CONFIDENCE) -> str:
    """'1.019× (95 % interval 0.981–1.060; line 1.1×): within' and, when inconclusive, how
    much text would settle it."""
    r = result.to_dict() if isinstance(result, Interval) else dict(result)
    if r["statistic"] == "ratio":
        text = f"{r['estimate']:.3f}× ({confidence * 100:g} % interval {r['low']:.3f}–{_bound(r['high'])}; line {r['line']:g}×)"
    else:
        text = (f"extra {r['estimate']:+.4f} nats ({confidence * 100:g} % interval {r['low']:+.4f} to {r['high']:+.4f}; "
                f"line +{r['line']:g})")
    text += f": {r['verdict']}"
    if r.get("too_few_segments"):
        text += (f" ({r['tokens']:,} tokens make {r['segments']} segment(s); an interval needs at least "
                 f"{MIN_SEGMENTS}: more text, or a smaller --budget-segment)")
    elif r["verdict"] == INCONCLUSIVE:
        settle = r.get("tokens_to_settle")
        text += (f" (about {settle:,} tokens of such text, {settle / r['tokens']:.1f}× these {r['tokens']:,}, would "
                 "settle it if the estimate held)" if settle else " (the estimate sits on the line: no amount of text "
                                                                  "settles it)")
    return text


def _bound(value: float) -> str:
    return f"{value:.3f}" if math.isfinite(value) else "∞"
