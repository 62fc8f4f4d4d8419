"""Optimization-profile shapes from the command line and from the inputs a comparison feeds."""

from __future__ import annotations

import numpy as np
import pytest

from flashnorm.engine.shapes import ShapeRange, parse_shape, parse_shape_spec, parse_shape_specs, shape_ranges_from_feeds
from flashnorm.errors import FlashNormError


def test_parse_shape():
    assert parse_shape("1x64") == (1, 64)
    assert parse_shape("2X3x4") == (2, 3, 4)
    assert parse_shape("") == ()
    with pytest.raises(FlashNormError, match="integers joined by 'x'"):
        parse_shape("1,64")


def test_min_opt_max_and_single_shape():
    name, shape_range = parse_shape_spec("input_ids:1x1,1x64,1x512")
    assert name == "input_ids"
    assert shape_range == ShapeRange((1, 1), (1, 64), (1, 512))
    assert shape_range.describe() == "1x1,1x64,1x512"
    fixed = parse_shape_spec("past:1x3x0x64")[1]
    assert fixed.minimum == fixed.optimum == fixed.maximum == (1, 3, 0, 64)


def test_names_with_colons_keep_everything_before_the_last_colon():
    name, _ = parse_shape_spec("past_key_values.0:key:1x3x0x64")
    assert name == "past_key_values.0:key"


@pytest.mark.parametrize("spec, message", [
    ("input_ids", "expected NAME:MIN,OPT,MAX"),
    (":1x1", "expected NAME:MIN,OPT,MAX"),
    ("x:1x1,1x2", "one shape or three"),
    ("x:1x4,1x2,1x8", "min <= opt <= max"),
    ("x:1x4,1x4x1,1x8", "different ranks"),
])
def test_bad_specs(spec, message):
    with pytest.raises(FlashNormError, match=message):
        parse_shape_spec(spec)


def test_repeated_name_is_refused():
    with pytest.raises(FlashNormError, match="twice"):
        parse_shape_specs(["x:1x1", "x:1x2"])


def test_ranges_from_feeds_cover_every_feed(rng):
    shapes = [(2, int(rng.integers(1, 40))) for _ in range(4)]
    feeds = [{"input_ids": np.ones(s, np.int64), "mask": np.ones((s[0], s[1] + 3), np.int64)} for s in shapes]
    ranges = shape_ranges_from_feeds(feeds)
    for feed in feeds:
        for name, value in feed.items():
            assert ranges[name].contains(value.shape)
    assert ranges["input_ids"].minimum == (2, min(s[1] for s in shapes))
    assert ranges["input_ids"].maximum == (2, max(s[1] for s in shapes))
    assert ranges["input_ids"].optimum == shapes[0]
    assert not ranges["input_ids"].contains((2, max(s[1] for s in shapes) + 1))
