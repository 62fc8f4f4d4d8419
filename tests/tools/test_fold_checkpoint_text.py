"""`flashnorm fold-checkpoint --check-int8`'s text: the verdict judges the logits, and the layers
listed after it are said to be not judged, so a pass never reads as "within the limit" followed by
layers "over the limit"."""

from __future__ import annotations

from flashnorm.tools import fold_checkpoint


def _report(ratio: float, grown: int) -> dict:
    rows = [{"layer": f"model.layers.{i}.mlp.down_proj", "ratio": 1.5, "original_error": 1e-3, "folded_error": 1.5e-3}
            for i in range(grown)]
    return {"source": "in", "output": "out", "architecture": "LlamaForCausalLM", "shards": 1, "tensors": 3,
            "seconds": 1.0, "sites": [], "largest_range_growth": {"weight": "", "factor": 1.0}, "norm_sites": 61,
            "folded": 60, "left_alone": 1,
            "int8": {"original_int8_error": 0.01, "folded_int8_error": 0.01 * ratio, "ratio": ratio, "limit": 1.1,
                     "passed": ratio <= 1.1, "layers_over_limit": rows, "layers": rows[:10], "quantized_layers": 210}}


def test_a_passing_check_says_the_layers_it_lists_are_not_judged():
    text = fold_checkpoint.format_text(_report(1.04, 111))
    assert "ratio 1.040 (within the check's 1.1× limit, which judges the logits)" in text
    assert "not judged: 111 of 210 quantized layers' own output error grew more than 1.1×" in text
    assert "... and 101 more such layers (--report lists them)" in text
    assert "over the limit" not in text


def test_a_failing_check_has_one_verdict_line():
    report = _report(1.3, 0)
    assert "OVER the check's 1.1× limit" in fold_checkpoint.format_text(report)
    assert fold_checkpoint.verdict(report) == ("--check-int8: the folded model's int8 logits error is 1.300× the "
                                               "original's, over the 1.1× limit")
