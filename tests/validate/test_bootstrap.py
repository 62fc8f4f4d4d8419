"""The quantized budget's statistics (flashnorm.validate.bootstrap) on synthetic per-token NLL
arrays whose answers are known: the ratio, an interval as wide as the noise makes it (from the
segments' spread, not the tokens', where neighbouring tokens move together), the three verdicts,
the text that would settle an inconclusive one, the seed, and the case without a ratio. Numpy
only, milliseconds."""

from __future__ import annotations

import numpy as np
import pytest

from flashnorm.validate import bootstrap

LINE = 1.1
OPTIONS = dict(max_extra_ratio=LINE, min_allowance=0.002)


def trio(reference_extra, candidate_extra, *, tokens=2048, noise=0.0, segment_noise=0.0, seed=1, block=64):
    """Per-token NLLs of one text: the float model's (varied, as real text is), the reference's
    `reference_extra` above it and the candidate's `candidate_extra` above it, plus independent
    noise per token (`noise`) and per segment of `block` tokens (`segment_noise`) on the candidate's
    difference to the reference."""
    rng = np.random.default_rng(seed)
    f = rng.gamma(2.0, 1.5, tokens)
    r = f + reference_extra
    shared = np.repeat(rng.normal(0, segment_noise, -(-tokens // block)), block)[:tokens]
    c = r + (candidate_extra - reference_extra) + rng.normal(0, noise, tokens) + shared
    return {"t": f}, {"t": r}, {"t": c}


def test_no_noise_the_ratio_exactly():
    result = bootstrap.interval(*trio(0.5, 0.525), **OPTIONS)
    assert result.statistic == "ratio" and result.estimate == pytest.approx(1.05)
    assert result.low == pytest.approx(1.05) and result.high == pytest.approx(1.05)
    assert result.verdict == bootstrap.WITHIN and result.tokens == 2048 and result.segments == 32
    over = bootstrap.interval(*trio(0.5, 0.6), **OPTIONS)
    assert over.estimate == pytest.approx(1.2) and over.verdict == bootstrap.OVER and over.tokens_to_settle is None


def test_interval_width_follows_the_token_noise():
    """Independent noise σ per token on c − r: the ratio's standard error is σ / (extra · √n), so
    the 95 % interval is about 2 × 1.96 of it wide."""
    sigma, extra, tokens = 0.4, 0.5, 4096
    result = bootstrap.interval(*trio(extra, extra * 1.0, tokens=tokens, noise=sigma), **OPTIONS)
    expected = 2 * 1.96 * sigma / (extra * np.sqrt(tokens))
    assert result.high - result.low == pytest.approx(expected, rel=0.15)
    assert result.low < result.estimate < result.high


def test_segments_keep_the_dependence_between_neighbours():
    """Noise shared by the 64 tokens of a segment: the standard error is σ / (extra · √segments),
    8× what independent tokens with the same per-token spread would give; the bootstrap over
    segments sees it, one over single tokens (segment length 1) would not."""
    sigma, extra, tokens = 0.4, 0.5, 4096
    arrays = trio(extra, extra, tokens=tokens, segment_noise=sigma)
    by_segment = bootstrap.interval(*arrays, **OPTIONS)
    by_token = bootstrap.interval(*arrays, **OPTIONS, block=1)
    expected = 2 * 1.96 * sigma / (extra * np.sqrt(tokens / 64))
    assert by_segment.high - by_segment.low == pytest.approx(expected, rel=0.25)
    assert (by_segment.high - by_segment.low) > 4 * (by_token.high - by_token.low)


def test_inconclusive_says_how_much_text_settles_it():
    """An interval spanning the line; text of the same kind (the same segments, repeated) in the
    amount it asks for settles it, when the estimate holds."""
    f, r, c = trio(0.5, 0.53, tokens=1024, noise=0.6, seed=3)
    c["t"] += 0.53 - (c["t"] - f["t"]).mean()  # the estimate exactly 1.06: the formula's premise
    small = bootstrap.interval(f, r, c, **OPTIONS)
    assert small.estimate == pytest.approx(1.06)
    assert small.verdict == bootstrap.INCONCLUSIVE and small.low < LINE < small.high
    half_width = small.high - small.estimate
    assert small.tokens_to_settle == int(np.ceil(1024 * (half_width / (LINE - small.estimate)) ** 2)) > 1024
    copies = int(np.ceil(small.tokens_to_settle * 1.2 / 1024))
    settled = bootstrap.interval(*({"t": np.tile(m["t"], copies)} for m in (f, r, c)), **OPTIONS)
    assert settled.estimate == pytest.approx(1.06) and settled.verdict == bootstrap.WITHIN
    assert "would settle it" in bootstrap.describe(small) and "inconclusive" in bootstrap.describe(small)


def test_the_seed_makes_it_repeatable():
    arrays = trio(0.5, 0.52, noise=0.3)
    a = bootstrap.interval(*arrays, **OPTIONS, seed=7)
    assert a == bootstrap.interval(*arrays, **OPTIONS, seed=7)
    assert a != bootstrap.interval(*arrays, **OPTIONS, seed=8)


def test_texts_are_resampled_apart_and_judged_apart():
    """Two texts: the pooled ratio is the ratio of the pooled sums; each text gets its own."""
    f1, r1, c1 = trio(0.5, 0.5, tokens=1024)
    f2, r2, c2 = trio(0.3, 0.45, tokens=512, seed=2)
    arrays = ({"a": f1["t"], "b": f2["t"]}, {"a": r1["t"], "b": r2["t"]}, {"a": c1["t"], "b": c2["t"]})
    pooled = bootstrap.interval(*arrays, **OPTIONS)
    assert pooled.estimate == pytest.approx((0.5 * 1024 + 0.45 * 512) / (0.5 * 1024 + 0.3 * 512))
    assert pooled.tokens == 1536 and pooled.segments == 24
    per = bootstrap.per_text(*arrays, **OPTIONS)
    assert per["a"].estimate == pytest.approx(1.0) and per["b"].estimate == pytest.approx(1.5)
    assert per["a"].verdict == bootstrap.WITHIN and per["b"].verdict == bootstrap.OVER


def test_without_a_ratio_the_candidates_extra_against_the_allowance():
    """The reference no worse than the float model: no ratio, the candidate's extra NLL judged
    against +0.002 nats."""
    fine = bootstrap.interval(*trio(-0.01, 0.001), **OPTIONS)
    assert fine.statistic == "extra" and fine.estimate == pytest.approx(0.001) and fine.verdict == bootstrap.WITHIN
    assert bootstrap.interval(*trio(-0.01, 0.01), **OPTIONS).verdict == bootstrap.OVER
    assert "nats" in bootstrap.describe(fine)


def test_a_short_last_segment_joins_the_one_before():
    assert bootstrap.interval(*trio(0.5, 0.5, tokens=64 * 10 + 20), **OPTIONS).segments == 10
    assert bootstrap.interval(*trio(0.5, 0.5, tokens=64 * 10 + 40), **OPTIONS).segments == 11


def test_mismatched_arrays_are_refused():
    f, r, c = trio(0.5, 0.5)
    with pytest.raises(ValueError, match="differ in length"):
        bootstrap.interval(f, r, {"t": c["t"][:-1]}, **OPTIONS)
    with pytest.raises(ValueError, match="same texts"):
        bootstrap.interval(f, r, {"u": c["t"]}, **OPTIONS)


@pytest.mark.parametrize("seed", range(20))
def test_a_one_segment_text_has_its_estimate_as_its_interval(seed):
    # 95 tokens under a 64-token block are one segment: every draw is that segment, and the estimate
    # is summed as the draws are, so low == estimate == high to the last bit (CI once saw the estimate
    # one ulp above `high` when it was summed another way).
    rng = np.random.default_rng(seed)
    f = rng.gamma(2.0, 1.5, 95)
    r = f + rng.uniform(0.01, 0.2, 95)
    c = r + rng.normal(0.3, 0.2, 95)
    for statistic, (reference, candidate) in {"ratio": (r, c), "extra": (f - 0.1, c)}.items():
        result = bootstrap.interval({"t": f}, {"t": reference}, {"t": candidate}, **OPTIONS)
        assert result.statistic == statistic and result.segments == 1
        assert result.low == result.estimate == result.high
        # ... which claims a certainty one segment cannot give: inconclusive, saying why.
        assert result.verdict == bootstrap.INCONCLUSIVE and result.too_few_segments and result.tokens_to_settle is None
        assert "95 tokens make 1 segment(s); an interval needs at least 8" in bootstrap.describe(result)


def test_fewer_than_eight_segments_are_inconclusive_whatever_the_ratio():
    # A candidate six times the reference's extra NLL: over at 8 segments of 64 tokens, and
    # inconclusive (too little text) at 7, however clear the draws look.
    for segments, verdict in ((7, bootstrap.INCONCLUSIVE), (8, bootstrap.OVER)):
        result = bootstrap.interval(*trio(0.1, 0.6, tokens=64 * segments, noise=0.05), **OPTIONS)
        assert result.segments == segments and result.low > LINE
        assert result.verdict == verdict and result.too_few_segments == (segments < bootstrap.MIN_SEGMENTS)
    texts = [trio(0.1, 0.6, tokens=64 * 4, noise=0.05, seed=seed) for seed in (1, 2)]
    pooled = bootstrap.interval(*({f"t{i}": part["t"] for i, part in enumerate(t[k] for t in texts)} for k in range(3)),
                                **OPTIONS)
    assert pooled.segments == 8 and pooled.verdict == bootstrap.OVER  # the count is over all texts
