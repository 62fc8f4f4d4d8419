"""The error budget on whole models: random Hugging Face models of every architecture family
(tests/models/test_hf_architectures.py's cases) exported in fp32, fp16 and bf16; the half
exports optimized (fold + cancel, and fold + defer) and compared with the fp32 original.

The budget (issue 13): the optimized half model's logits error against the fp32 original is
at most 1.1× the unfolded half model's own error (relative L2), and its top-1 agreement with
the fp32 original at most 0.5 points lower. The numbers of folded and cancelled sites are
those of the fp32 model. Both types run through `validate.bfloat16`: fp32 copies of the half
weights, every half activation rounded where the graph says, as a strongly typed engine
(TensorRT) computes it. fp16 is not judged on ONNX Runtime's CPU provider: it widens the fp16
weights to fp32 and computes MatMul, the norms and the rest in fp32 (only tensors entering
Reshape, Split, Transpose and the like are rounded to fp16), so the unfolded model's error
there is little more than its weights' rounding, and the fold's second rounding of g·W shows
as 1.06-1.09x folded and 1.07-1.10x deferred (up to 1.102, Qwen3) on these models, against
0.95-1.05 with every stated rounding kept (both measured 2026-12-01; docs/HALF_PRECISION.md).
"""

from __future__ import annotations

import pytest

from flashnorm.passes import optimize_file
from flashnorm.progress import Progress
from flashnorm.validate import compare_models, language_model_feeds, random_token_ids, read_signature
from flashnorm.validate.bfloat16 import emulating_runner_factory
from test_hf_architectures import CASES, Case, _randomize_gains

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow  # 16 cases, 6-44 s each on 2 shared cores (359 s in all, 2026-12-01)

BUDGET, TOP1_POINTS = 1.1, 0.5
SEQUENCE = 64
# Sequences of 64 random tokens per dtype. The top-1 difference between an optimized model and
# the unfolded one is decided by the positions where their argmaxes differ (fp16: 0.1-0.6 % of
# positions, bf16: 0.7-3.9 %, 2026-12-01), so its standard error is sqrt(share / positions).
# Over 24 bf16 draws of 16384 positions the folded model's difference had sd 0.12 points and
# mean -0.03, and the positions alone predict 0.12: the draw of random weights adds nothing
# measurable, so seeding it would not help; only positions do. bf16 at 32768 positions: at
# most 0.11 points standard error, the 0.5-point limit 4.3 of them or more from the mean (a CI
# dry run failed qwen2-bf16 by 0.66 points at 4096); fp16 at 16384: at most 0.06, 8 of them.
BATCH = {"fp16": 256, "bf16": 512}


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setattr(Progress, "enabled", False)


def _counts(report) -> tuple[int, int]:
    summary = report["summary"]
    return summary.get("fold.folded", 0), summary.get("cancel.cancelled", 0)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_half_model_error_budget(case: Case, dtype: str, tmp_path, rng):
    from flashnorm.export import export_causal_lm

    torch.manual_seed(int(rng.integers(2**31)))
    model = case.build().eval()
    _randomize_gains(model, rng)
    original, half = tmp_path / "fp32.onnx", tmp_path / f"{dtype}.onnx"
    export_causal_lm(model, original)
    export_causal_lm(model, half, dtype=dtype)
    folded, deferred = tmp_path / "folded.onnx", tmp_path / "deferred.onnx"
    fold_cancel = optimize_file(half, folded, ("fold", "cancel"))
    assert fold_cancel["norm_sites"] == case.sites
    assert _counts(fold_cancel) == (case.folded, case.cancelled), fold_cancel["summary"]
    fold_defer = optimize_file(half, deferred, ("fold", "defer"))
    assert fold_defer["summary"].get("defer.deferred", 0) >= 1

    signature = read_signature(original)
    feeds = [language_model_feeds(signature, random_token_ids(signature.vocab_size, BATCH[dtype], SEQUENCE, rng))]
    runners = (emulating_runner_factory(float16=True), emulating_runner_factory(float16=True))
    errors = {}
    for name, path in (("half", half), ("folded", folded), ("deferred", deferred)):
        logits = compare_models(original, path, feeds, runners=runners, max_rel_l2=1.0).output("logits")
        assert logits.nonfinite == 0, (name, logits)
        errors[name] = logits
    print({k: (round(v.rel_l2, 6), v.top1_agreement) for k, v in errors.items()})
    for name in ("folded", "deferred"):
        assert errors[name].rel_l2 <= BUDGET * errors["half"].rel_l2, (name, errors[name].rel_l2, errors["half"].rel_l2)
        assert errors[name].top1_agreement >= errors["half"].top1_agreement - TOP1_POINTS / 100, (name, errors)
