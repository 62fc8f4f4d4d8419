"""The half-precision budget (flashnorm.validate.budget) on a tiny random Llama exported in fp32
and in the half type: the unoptimized half model itself is at exactly 1× its own error, the model
with its embedding scaled by 1.05 is far outside (measured 1.3–8× with a 1.02 scale), and models
fed other inputs are refused before anything runs."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from flashnorm.errors import FlashNormError
from flashnorm.validate import budget, language_model_feeds, random_token_ids, read_signature
from flashnorm.validate.bfloat16 import emulating_runner_factory
from flashnorm.validate.runners import onnxrt_runner_factory
from models import cache

pytest.importorskip("torch")


@pytest.fixture(scope="module", params=["fp16", "bf16"])
def exports(request, tmp_path_factory):
    from flashnorm.export import export_causal_lm

    directory = tmp_path_factory.mktemp(request.param)
    fp32, half = directory / "model.onnx", directory / f"model.{request.param}.onnx"
    export_causal_lm(cache.tiny_llama_model(), fp32)
    export_causal_lm(cache.tiny_llama_model(), half, dtype=request.param)
    return fp32, half


def _feeds(model, rng):
    signature = read_signature(model)
    return [language_model_feeds(signature, random_token_ids(signature.vocab_size, 4, 32, rng))]


def _runners():
    # The fp32 model on ONNX Runtime; half models as `flashnorm compare` runs them.
    return onnxrt_runner_factory(), emulating_runner_factory(), emulating_runner_factory()


def _perturbed(half, path, factor):
    """`half` with its first 2-D weight scaled by `factor`, rounded to the weight's type."""
    model = onnx.load(str(half))
    weight = next(t for t in model.graph.initializer if len(t.dims) == 2 and t.dims[0] > 1 and t.dims[1] > 1)
    values = numpy_helper.to_array(weight)
    weight.CopyFrom(numpy_helper.from_array((values.astype(np.float64) * factor).astype(values.dtype), weight.name))
    onnx.save(model, str(path))
    return path


def test_the_reference_itself_is_within_its_own_budget(exports, rng):
    fp32, half = exports
    report, comparison = budget.judge_budget(fp32, half, half, _feeds(half, rng), runners=_runners())
    (logits,) = report.outputs
    assert logits.name == "logits" and 0 < logits.reference_rel_l2 < 0.1
    assert logits.ratio == 1.0 and logits.candidate_top1 == logits.reference_top1
    assert report.passed and report.max_ratio == budget.MAX_RATIO
    # The tolerance comparison of the candidate with the reference comes from the same runs.
    assert comparison.passed and comparison.output("logits").rel_l2 == 0


def test_a_moved_weight_is_outside_the_budget(exports, tmp_path, rng):
    fp32, half = exports
    moved = _perturbed(half, tmp_path / "moved.onnx", 1.05)
    report, _ = budget.judge_budget(fp32, half, moved, _feeds(half, rng), runners=_runners())
    (logits,) = report.outputs
    assert logits.ratio > budget.MAX_RATIO and not logits.passed and not report.passed
    # The verdict follows the ratio given: the same errors pass a bound above their ratio.
    relaxed, _ = budget.judge_budget(fp32, half, moved, _feeds(half, rng), runners=_runners(), max_ratio=1e6,
                                  max_top1_drop_points=100)
    assert relaxed.passed


def test_models_fed_other_inputs_are_refused(exports, tmp_path):
    from flashnorm.export import export_causal_lm

    fp32, half = exports
    with_cache = tmp_path / "kv.onnx"
    export_causal_lm(cache.tiny_llama_model(), with_cache, dtype="fp16", kv_cache=True)
    with pytest.raises(FlashNormError, match="takes inputs"):
        budget.check_same_inputs(fp32, half, with_cache)
