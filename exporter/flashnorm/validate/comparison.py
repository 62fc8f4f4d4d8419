"""Compare a candidate model against a reference on identical inputs, through Polygraphy.

Polygraphy runs both models (`Comparator.run`) and gives the elementwise verdict
(`SimpleCompareFunc`: an element fails iff |a−b| > atol AND |a−b|/|ref| > rtol). Outputs are
paired by exact name only: Polygraphy's default pairing falls back to substring and then
position matching, which can compare unrelated tensors. On top of its verdict every output
gets error statistics in float64 and a relative-L2 check, ‖a−b‖₂/‖ref‖₂ ≤ max_rel_l2, which is
the accuracy figure FlashNorm's exactness claims are stated in.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Iterable, Mapping

import numpy as np

from flashnorm.errors import FlashNormError
from flashnorm.validate.inputs import read_signature
from flashnorm.validate.runners import RunnerFactory, onnxrt_runner_factory, raise_run_failure

REFERENCE, CANDIDATE = "reference", "candidate"
DEFAULT_ATOL, DEFAULT_RTOL, DEFAULT_MAX_REL_L2 = 1e-4, 1e-3, 1e-5
_TINY = np.finfo(np.float64).tiny


@dataclasses.dataclass
class OutputError:
    """How far one output of the candidate is from the reference, over all iterations."""

    name: str
    shape: list[int]
    max_abs: float
    mean_abs: float
    max_rel: float
    """max |a−b| / |ref| elementwise (reference zeros count as the smallest positive float)."""
    mean_rel: float
    rel_l2: float
    """‖a−b‖₂ / ‖ref‖₂."""
    scaled_max_abs: float
    """max |a−b| / max |ref|: the largest error relative to the output's scale."""
    top1_agreement: float | None
    """For outputs named logits: the fraction of positions whose argmax agrees."""
    polygraphy_passed: bool
    passed: bool
    nonfinite: int = 0
    """Elements where exactly one side is NaN/Inf, or both are but differ."""


@dataclasses.dataclass
class ComparisonReport:
    reference: str
    candidate: str
    runners: list[str]
    inputs: dict[str, Any]
    atol: float
    rtol: float
    max_rel_l2: float
    outputs: list[OutputError]
    missing_outputs: list[str]
    passed: bool

    def output(self, name: str) -> OutputError:
        return next(o for o in self.outputs if o.name == name)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def exact_name(output_name: str, index: int, iteration_result: Any) -> list[str] | None:
    """Polygraphy `find_output_func` that pairs outputs by exact name, never by substring or
    position."""
    return [output_name] if output_name in iteration_result else None


def error_statistics(candidate: np.ndarray, reference: np.ndarray) -> dict[str, float]:
    a = np.asarray(candidate, dtype=np.float64)
    b = np.asarray(reference, dtype=np.float64)
    if a.shape != b.shape:
        raise FlashNormError(f"shape mismatch: candidate {list(a.shape)} vs reference {list(b.shape)}")
    finite = np.isfinite(a) & np.isfinite(b)
    # NaN/Inf: counted (a mismatch unless both hold the same non-finite value), kept out of
    # the statistics so that those stay meaningful.
    same_nonfinite = ~finite & ((a == b) | (np.isnan(a) & np.isnan(b)))
    nonfinite = int((~finite & ~same_nonfinite).sum())
    a, b = a[finite], b[finite]
    difference = np.abs(a - b)
    magnitude = np.abs(b)
    relative = difference / np.maximum(magnitude, _TINY)
    norm = float(np.linalg.norm(b))
    return {
        "max_abs": float(difference.max()) if a.size else 0.0,
        "mean_abs": float(difference.mean()) if a.size else 0.0,
        "max_rel": float(relative.max()) if a.size else 0.0,
        "mean_rel": float(relative.mean()) if a.size else 0.0,
        "rel_l2": float(np.linalg.norm(a - b) / norm) if norm > 0 else float(np.linalg.norm(a - b)),
        "scaled_max_abs": float(difference.max() / magnitude.max()) if a.size and magnitude.max() > 0 else 0.0,
        "nonfinite": nonfinite,
    }


def top1_agreement(candidate: np.ndarray, reference: np.ndarray) -> float:
    return float(np.mean(np.argmax(candidate, axis=-1) == np.argmax(reference, axis=-1)))


def compare_models(
    reference: str | os.PathLike[str],
    candidate: str | os.PathLike[str],
    feeds: Iterable[Mapping[str, np.ndarray]],
    *,
    runners: tuple[RunnerFactory, RunnerFactory] | None = None,
    atol: float = DEFAULT_ATOL,
    rtol: float = DEFAULT_RTOL,
    max_rel_l2: float = DEFAULT_MAX_REL_L2,
    inputs_description: Mapping[str, Any] | None = None,
) -> ComparisonReport:
    """Run `reference` and `candidate` on each feed dict and compare every output by name.

    `runners` is (reference factory, candidate factory); both default to ONNX Runtime on CPU.
    Fails (passed=False) when any output exceeds the tolerances, holds NaN/Inf where the other
    does not, or exists in the reference but not in the candidate."""
    reference_factory, candidate_factory = runners or (onnxrt_runner_factory(), onnxrt_runner_factory())
    models = {REFERENCE: (reference, reference_factory), CANDIDATE: (candidate, candidate_factory)}
    return compare_several(models, feeds, [(REFERENCE, CANDIDATE)], atol=atol, rtol=rtol, max_rel_l2=max_rel_l2,
                           inputs_description=inputs_description)[(REFERENCE, CANDIDATE)]


def compare_several(
    models: Mapping[str, tuple[str | os.PathLike[str], RunnerFactory]],
    feeds: Iterable[Mapping[str, np.ndarray]],
    pairs: Iterable[tuple[str, str]],
    *,
    atol: float = DEFAULT_ATOL,
    rtol: float = DEFAULT_RTOL,
    max_rel_l2: float = DEFAULT_MAX_REL_L2,
    inputs_description: Mapping[str, Any] | None = None,
) -> dict[tuple[str, str], ComparisonReport]:
    """`compare_models` for each (reference role, candidate role) of `pairs`, with every model
    of `models` (role → (path, runner factory)) run once on each feed dict."""
    from polygraphy.comparator import Comparator, SimpleCompareFunc
    from polygraphy.logger import G_LOGGER

    feeds = [dict(f) for f in feeds]
    pairs = list(pairs)
    if not feeds:
        raise FlashNormError("no inputs to compare on")
    signatures = {role: read_signature(path) for role, (path, _) in models.items()}
    first = next(iter(signatures.values()))
    for signature in signatures.values():
        if signature.input_names != first.input_names:
            raise FlashNormError(f"the models take different inputs: {first.input_names} vs {signature.input_names}")
    runner_list = [factory(os.fspath(path), role) for role, (path, factory) in models.items()]
    runner_of = dict(zip(models, runner_list))
    common = {(r, c): [n for n in signatures[r].output_names if n in signatures[c].output_names] for r, c in pairs}
    compared = [pair for pair in pairs if common[pair]]
    if compared:  # Polygraphy refuses a comparison without a common output
        compare_func = SimpleCompareFunc(atol=atol, rtol=rtol, check_error_stat="elemwise",
                                         find_output_func=exact_name)
        colors, G_LOGGER.colors = G_LOGGER.colors, False  # else it prints a note on stdout
        try:
            with G_LOGGER.verbosity(G_LOGGER.CRITICAL):
                try:
                    run_results = Comparator.run(runner_list, data_loader=feeds)
                except Exception as exc:
                    raise_run_failure(exc, "a model")
                    raise
                # Pairs (candidate, reference): Polygraphy measures relative error against the second.
                indices = {role: i for i, role in enumerate(models)}
                accuracy = Comparator.compare_accuracy(
                    run_results, comparisons=[(indices[c], indices[r]) for r, c in compared], compare_func=compare_func)
        finally:
            G_LOGGER.colors = colors
    reports = {}
    for reference_role, candidate_role in pairs:
        reference_runner, candidate_runner = runner_of[reference_role], runner_of[candidate_role]
        names = common[(reference_role, candidate_role)]
        outputs = []
        if names:
            verdicts = accuracy[0][(candidate_runner.name, reference_runner.name)]
            outputs = [_output_error(name, run_results[candidate_runner.name], run_results[reference_runner.name],
                                     verdicts, max_rel_l2) for name in names]
        missing = [n for n in signatures[reference_role].output_names if n not in names]
        reports[(reference_role, candidate_role)] = ComparisonReport(
            reference=os.fspath(models[reference_role][0]),
            candidate=os.fspath(models[candidate_role][0]),
            runners=[f"{r.name}: {type(r).__name__}" for r in (reference_runner, candidate_runner)],
            inputs=dict(inputs_description or {"iterations": len(feeds)}),
            atol=atol, rtol=rtol, max_rel_l2=max_rel_l2,
            outputs=outputs,
            missing_outputs=missing,
            passed=bool(outputs) and not missing and all(o.passed for o in outputs),
        )
    return reports


def _output_error(name: str, candidate_iterations: Any, reference_iterations: Any, verdicts: Any,
                  max_rel_l2: float) -> OutputError:
    pairs = [(c[name], r[name]) for c, r in zip(candidate_iterations, reference_iterations)]
    for c, r in pairs:
        if c.shape != r.shape:
            raise FlashNormError(f"output {name}: candidate shape {list(c.shape)} vs reference {list(r.shape)}")
    stats = error_statistics(
        np.concatenate([np.ravel(c) for c, _ in pairs]), np.concatenate([np.ravel(r) for _, r in pairs])
    )
    # Every iteration must carry a verdict for this output (a skipped output never passes).
    polygraphy_passed = len(verdicts) == len(pairs) and all(name in v and bool(v[name]) for v in verdicts)
    passed = polygraphy_passed and stats["rel_l2"] <= max_rel_l2 and stats["nonfinite"] == 0
    top1 = None
    if name == "logits":
        top1 = float(np.mean([top1_agreement(c, r) for c, r in pairs]))
    return OutputError(name=name, shape=list(pairs[0][1].shape), top1_agreement=top1,
                       polygraphy_passed=polygraphy_passed, passed=passed, **stats)


def format_report(report: ComparisonReport) -> str:
    """A few readable lines: one per output, then the verdict."""
    lines = [f"reference {report.reference} ({report.runners[0]})", f"candidate {report.candidate} ({report.runners[1]})"]
    for key, value in report.inputs.items():
        lines.append(f"  {key}: {value}")
    for o in report.outputs:
        top1 = f"  top-1 {o.top1_agreement:.2%}" if o.top1_agreement is not None else ""
        lines.append(
            f"{'PASS' if o.passed else 'FAIL'} {o.name} {o.shape}: max abs {o.max_abs:.3g}, mean abs {o.mean_abs:.3g}, "
            f"max rel {o.max_rel:.3g}, mean rel {o.mean_rel:.3g}, rel L2 {o.rel_l2:.3g}, "
            f"max abs/max|ref| {o.scaled_max_abs:.3g}{top1}"
        )
    for name in report.missing_outputs:
        lines.append(f"FAIL {name}: missing from the candidate")
    lines.append(
        f"{'PASSED' if report.passed else 'FAILED'} (atol {report.atol:g}, rtol {report.rtol:g}, "
        f"rel L2 ≤ {report.max_rel_l2:g})"
    )
    return "\n".join(lines)

