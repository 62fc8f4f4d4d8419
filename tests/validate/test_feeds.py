"""flashnorm.validate.feeds: what `flashnorm compare` feeds a token model."""

from __future__ import annotations

import numpy as np
import pytest

from flashnorm import cli
from flashnorm.validate.feeds import FeedOptions, build_feeds
from flashnorm.validate.inputs import tokenize
from flashnorm.validate.likelihood import SHIPPED_TEXTS, shipped_text


@pytest.mark.slow
def test_shipped_text_is_the_same_positions_whatever_the_seed(smollm2_onnx, smollm2_tokenizer, rng):
    """--shipped-text NAME: that public-domain text through the model's tokenizer (recorded by
    `flashnorm export`), whatever --seed draws, so a budget's verdict does not vary by draw; the
    report names the text instead of printing its 2 000 tokens. Without NAME: every shipped text,
    one feed each."""
    expected = tokenize(shipped_text("declaration"), smollm2_tokenizer)
    for seed in rng.integers(2**32, size=2):
        options = FeedOptions(shipped_text="declaration", seed=int(seed))
        feeds, description, ids = build_feeds(smollm2_onnx, smollm2_onnx, options)
        assert np.array_equal(ids, expected) and np.array_equal(feeds[0]["input_ids"], expected) and len(feeds) == 1
        assert description["text"] == f"the shipped public-domain texts declaration ({expected.size} tokens)"
    assert expected.size > 1500
    feeds, description, _ = build_feeds(smollm2_onnx, smollm2_onnx, FeedOptions(shipped_text="all"))
    assert len(feeds) == len(SHIPPED_TEXTS) and all(f["input_ids"].size > 1500 for f in feeds)
    assert all(name in description["text"] for name in SHIPPED_TEXTS)


@pytest.mark.parametrize("other", [["--text", "hello"], ["--input-ids", "1,2,3"]])
def test_shipped_text_excludes_the_other_token_sources(tiny_llama_onnx, other, capsys):
    assert cli.main(["compare", str(tiny_llama_onnx), str(tiny_llama_onnx), "--shipped-text", *other]) == 2
    assert "not allowed with argument" in capsys.readouterr().err
