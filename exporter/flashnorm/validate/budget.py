"""The half-precision error budget (docs/HALF_PRECISION.md): a FlashNorm-optimized half model
is judged against the unoptimized half model it came from, both measured against the fp32
model, instead of against the half model with fp32-tight tolerances (which a half model fails
on its own rounding).

Per output, the candidate's relative L2 error against the fp32 model must be at most
`max_ratio` times the reference's; for logits, its top-1 agreement with the fp32 model at most
`max_top1_drop_points` below the reference's.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Iterable, Mapping

import numpy as np

from flashnorm.errors import FlashNormError
from flashnorm.validate.comparison import (
    CANDIDATE, DEFAULT_ATOL, DEFAULT_MAX_REL_L2, DEFAULT_RTOL, REFERENCE, ComparisonReport, compare_several,
)
from flashnorm.validate.inputs import read_signature
from flashnorm.validate.runners import RunnerFactory

MAX_RATIO = 1.1
"""Largest allowed (candidate error) / (reference error), both against the fp32 model."""
MAX_TOP1_DROP_POINTS = 0.5
"""Largest allowed drop of top-1 agreement with the fp32 model, in percentage points."""
FP32 = "fp32"


@dataclasses.dataclass
class BudgetOutput:
    name: str
    reference_rel_l2: float
    """‖reference − fp32‖₂ / ‖fp32‖₂: the unoptimized half model's own error."""
    candidate_rel_l2: float
    ratio: float
    reference_top1: float | None
    """Share of positions whose argmax equals the fp32 model's (logits only)."""
    candidate_top1: float | None
    nonfinite: int
    """Elements where the candidate is NaN/Inf and the fp32 model is not (or the reverse)."""
    passed: bool


@dataclasses.dataclass
class BudgetReport:
    fp32_model: str
    max_ratio: float
    max_top1_drop_points: float
    outputs: list[BudgetOutput]
    passed: bool

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def check_same_inputs(fp32_model: str | os.PathLike[str], *models: str | os.PathLike[str]) -> None:
    """FlashNormError unless `fp32_model` takes the same inputs, of the same types, as each of
    `models`: the three run on one set of feeds (token ids), not on converted copies."""
    expected = {t.name: t.dtype for t in read_signature(fp32_model).inputs}
    for model in models:
        actual = {t.name: t.dtype for t in read_signature(model).inputs}
        if set(actual) != set(expected):
            raise FlashNormError(f"{fp32_model} takes inputs {sorted(expected)}, {model} takes {sorted(actual)}")
        differing = next((name for name in actual if actual[name] != expected[name]), None)
        if differing is not None:
            raise FlashNormError(
                f"input {differing} is {expected[differing]} in {fp32_model} and {actual[differing]} in {model}: "
                f"the budget compares models fed the same inputs (token ids; export without --kv-cache)")


def judge_budget(
    fp32_model: str | os.PathLike[str],
    reference: str | os.PathLike[str],
    candidate: str | os.PathLike[str],
    feeds: Iterable[Mapping[str, np.ndarray]],
    *,
    runners: tuple[RunnerFactory, RunnerFactory, RunnerFactory],
    max_ratio: float = MAX_RATIO,
    max_top1_drop_points: float = MAX_TOP1_DROP_POINTS,
    atol: float = DEFAULT_ATOL,
    rtol: float = DEFAULT_RTOL,
    max_rel_l2: float = DEFAULT_MAX_REL_L2,
    inputs_description: Mapping[str, Any] | None = None,
) -> tuple[BudgetReport, ComparisonReport]:
    """Run the fp32 model, the reference and the candidate once each on `feeds` (runner
    factories in that order) and judge every output the reference and the candidate share by
    the budget. Also returns the candidate compared with the reference under the tolerances
    (`compare_models`' report), from the same runs."""
    check_same_inputs(fp32_model, reference, candidate)
    fp32_factory, reference_factory, candidate_factory = runners
    models = {FP32: (fp32_model, fp32_factory), REFERENCE: (reference, reference_factory),
              CANDIDATE: (candidate, candidate_factory)}
    # Against the fp32 model only the statistics count, not the tolerances.
    reports = compare_several(models, feeds, [(FP32, REFERENCE), (FP32, CANDIDATE), (REFERENCE, CANDIDATE)],
                              atol=atol, rtol=rtol, max_rel_l2=max_rel_l2, inputs_description=inputs_description)
    own_errors = {o.name: o for o in reports[(FP32, REFERENCE)].outputs}
    candidate_errors = {o.name: o for o in reports[(FP32, CANDIDATE)].outputs}
    outputs = []
    for name, own in own_errors.items():
        theirs = candidate_errors.get(name)
        if theirs is None:
            continue
        if own.rel_l2 > 0:
            ratio = theirs.rel_l2 / own.rel_l2
        else:  # the reference equals the fp32 model here: the candidate may not differ at all
            ratio = 1.0 if theirs.rel_l2 == 0 else float("inf")
        passed = ratio <= max_ratio and theirs.nonfinite <= own.nonfinite
        if own.top1_agreement is not None and theirs.top1_agreement is not None:
            passed = passed and theirs.top1_agreement >= own.top1_agreement - max_top1_drop_points / 100
        outputs.append(BudgetOutput(
            name=name, reference_rel_l2=own.rel_l2, candidate_rel_l2=theirs.rel_l2, ratio=ratio,
            reference_top1=own.top1_agreement, candidate_top1=theirs.top1_agreement, nonfinite=theirs.nonfinite,
            passed=passed,
        ))
    budget = BudgetReport(
        fp32_model=os.fspath(fp32_model), max_ratio=max_ratio, max_top1_drop_points=max_top1_drop_points,
        outputs=outputs, passed=bool(outputs) and all(o.passed for o in outputs),
    )
    return budget, reports[(REFERENCE, CANDIDATE)]


def format_budget(report: Mapping[str, Any]) -> str:
    """A line per output and the verdict, from `BudgetReport.to_dict()`."""
    lines = [f"half-precision budget against the fp32 model {report['fp32_model']}:"]
    for o in report["outputs"]:
        top1 = ""
        if o["reference_top1"] is not None and o["candidate_top1"] is not None:
            top1 = f", top-1 {o['candidate_top1']:.2%} vs {o['reference_top1']:.2%}"
        lines.append(f"{'PASS' if o['passed'] else 'FAIL'} {o['name']}: rel L2 {o['candidate_rel_l2']:.3g} vs "
                     f"reference {o['reference_rel_l2']:.3g} ({o['ratio']:.3f}x){top1}")
    lines.append(f"{'PASSED' if report['passed'] else 'FAILED'} (ratio ≤ {report['max_ratio']:g}, top-1 at most "
                 f"{report['max_top1_drop_points']:g} points lower)")
    return "\n".join(lines)
