"""`flashnorm compare REFERENCE.onnx CANDIDATE.onnx`: run both on identical inputs with
Polygraphy on ONNX Runtime; report max/mean absolute and relative error and relative L2 per
output, and fail (exit 1) beyond `--atol/--rtol/--max-rel-l2`. A token model (one with an
`input_ids` input) gets seeded random token ids, `--input-ids`, or `--text` through the model's
tokenizer, and `--generate N` also compares N greedy tokens. Any other model gets seeded random
tensors for every input, from its declared dtypes and shapes (`--input-shapes`, `--val-range`).
With `--budget FP32.onnx`, a half-precision candidate is judged by the error budget of
docs/HALF_PRECISION.md (against the fp32 model, next to the reference) instead of the
tolerances; a quantized pair (either model has MatMulNBits, QuantizeLinear, DequantizeLinear...)
by the NLL budget of docs/QUANTIZATION.md: the candidate's extra NLL over the fp32 model on the
texts (the public-domain texts flashnorm ships, `--shipped-text NAME`, `--text` or
`--input-ids`) at most `--budget-ratio` times the reference's, judged by the ratio's 95 %
interval (paired bootstrap over segments of the text, seeded): exit 0 within the budget, 1 over
it, 4 inconclusive (the interval spans the line; the report says how much more text would
settle it), with greedy tokens reported against both."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

import numpy as np

from flashnorm.errors import FlashNormError
from flashnorm.paths import Input, Output
from flashnorm.tools.options import (
    add_model_input_options,
    add_shapes_option,
    add_tensorrt_options,
    at_least,
    file_inputs,
    onnx_inputs,
    positive,
)
from flashnorm.validate.budget import MAX_RATIO, MAX_TOP1_DROP_POINTS
from flashnorm.validate.comparison import DEFAULT_ATOL, DEFAULT_MAX_REL_L2, DEFAULT_RTOL
from flashnorm.validate.feeds import FeedOptions, build_feeds
from flashnorm.validate.bootstrap import DEFAULT_BLOCK, DEFAULT_SEED
from flashnorm.validate.likelihood import DEFAULT_WINDOW
from flashnorm.validate.runners import OPTIMIZATION_LEVELS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("reference", help="the reference model (e.g. the exported original)")
    parser.add_argument("candidate", help="the model under test (e.g. the FlashNorm-optimized one)")
    add_model_input_options(parser)
    limits = parser.add_argument_group("pass/fail")
    limits.add_argument("--atol", type=at_least(0.0, float), default=DEFAULT_ATOL,
                        help=f"absolute tolerance, elementwise (default {DEFAULT_ATOL:g})")
    limits.add_argument("--rtol", type=at_least(0.0, float), default=DEFAULT_RTOL,
                        help=f"relative tolerance, elementwise; an element fails only beyond both (default {DEFAULT_RTOL:g})")
    limits.add_argument("--max-rel-l2", type=at_least(0.0, float), default=DEFAULT_MAX_REL_L2,
                        help=f"largest allowed ‖a−b‖₂/‖ref‖₂ per output (default {DEFAULT_MAX_REL_L2:g})")
    limits.add_argument("--budget", metavar="FP32_MODEL",
                        help="judge a half-precision candidate by the error budget instead of the tolerances: "
                             "FP32_MODEL is the fp32 export of the same model; per output the candidate's rel L2 "
                             "error against it at most --budget-ratio times the reference's, and for logits its "
                             "top-1 agreement at most --budget-top1-points lower (docs/HALF_PRECISION.md). A "
                             "quantized pair is judged by its NLL on real text instead: the candidate's extra NLL over "
                             "FP32_MODEL at most --budget-ratio times the reference's, or +0.002 nats where the "
                             "reference's is ≤ 0, judged by the ratio's 95 %% interval (docs/QUANTIZATION.md): exit "
                             "0 within (the interval under the line), 1 over (above it), 4 inconclusive (it spans "
                             "the line); every shipped public-domain text unless --shipped-text NAME, --text or "
                             "--input-ids")
    limits.add_argument("--budget-ratio", type=positive(float), default=MAX_RATIO, metavar="R",
                        help=f"with --budget: the largest allowed error ratio (default {MAX_RATIO:g})")
    limits.add_argument("--budget-top1-points", type=at_least(0.0, float), default=MAX_TOP1_DROP_POINTS, metavar="P",
                        help="with --budget: the largest allowed drop of top-1 agreement with the fp32 model, in "
                             f"percentage points (default {MAX_TOP1_DROP_POINTS:g}; one position of N moves it by "
                             "100/N, so judge it on thousands of positions)")
    limits.add_argument("--budget-window", type=at_least(1), default=DEFAULT_WINDOW, metavar="TOKENS",
                        help="quantized pairs under --budget: tokens per forward pass when measuring the NLL "
                             f"(the text is cut into windows of this many; default {DEFAULT_WINDOW})")
    limits.add_argument("--budget-segment", type=at_least(1), default=DEFAULT_BLOCK, metavar="TOKENS",
                        help="quantized pairs under --budget: tokens per segment the bootstrap resamples (contiguous, "
                             f"so that neighbouring tokens' dependence is kept; default {DEFAULT_BLOCK})")
    limits.add_argument("--budget-seed", type=at_least(0), default=DEFAULT_SEED, metavar="N",
                        help=f"quantized pairs under --budget: the bootstrap's seed (default {DEFAULT_SEED}; printed "
                             "and in the report)")
    limits.add_argument("--generate", type=at_least(0), default=0, metavar="N",
                        help="also generate N tokens greedily from both models on ONNX Runtime (even with "
                             "--trt/--engine: the engine is not run in a generation loop); fail if any differs")
    runtime = parser.add_argument_group("ONNX Runtime")
    runtime.add_argument("--providers", default="CPUExecutionProvider",
                         help="comma-separated execution providers (default CPUExecutionProvider)")
    runtime.add_argument("--optimization-level", choices=OPTIMIZATION_LEVELS, default="all",
                         help="ONNX Runtime graph optimization level for both models (default all)")
    tensorrt = add_tensorrt_options(
        parser, "TensorRT (the candidate runs on TensorRT through Polygraphy; needs `tensorrt` or `tensorrt_rtx`). "
        "Exit code 3: the engine was built but cannot run on this machine, so nothing was compared")
    tensorrt.add_argument("--trt", action="store_true",
                          help="build the candidate ONNX into a TensorRT engine in memory and run it there")
    tensorrt.add_argument("--engine", metavar="PLAN",
                          help="run this prebuilt engine as the candidate (implies --trt; the candidate ONNX "
                               "still gives the input and output names)")
    add_shapes_option(tensorrt, "optimization profile for --trt (default: exactly the shapes of the inputs fed)",
                      old_spelling="--trt-shapes")


def paths(args: argparse.Namespace) -> tuple[list[Input], list[Output]]:
    read = onnx_inputs("reference model", args.reference) + onnx_inputs("candidate model", args.candidate)
    read += onnx_inputs("budget model", args.budget) + file_inputs("engine", [args.engine])
    read += file_inputs("plugin library", args.plugin) + file_inputs("tokenizer", [args.tokenizer])
    return read, []


def run(args: argparse.Namespace) -> dict[str, Any]:
    from onnx import TensorProto

    from flashnorm.validate.bfloat16 import BFLOAT16, FLOAT, emulated_session, emulating_runner_factory, precision
    from flashnorm.validate.budget import check_same_inputs, judge_budget
    from flashnorm.validate.comparison import compare_models
    from flashnorm.validate.generate import compare_generation
    from flashnorm.validate.runners import make_session, onnxrt_runner_factory

    providers = [p.strip() for p in args.providers.split(",") if p.strip()]
    if args.budget and _quantized_pair(args):
        return run_quantized_budget(args, providers)
    if args.budget:
        # Before any model runs: a missing file, a half "fp32" model or other inputs are one-line errors.
        check_same_inputs(args.budget, args.reference, args.candidate)
        kind = precision(args.budget)[0]
        if kind != FLOAT:
            raise FlashNormError(f"--budget {args.budget} is {TensorProto.DataType.Name(kind).lower()}, not float32: "
                                 f"the budget measures both half models against the fp32 export")
    options = FeedOptions(**{field.name: getattr(args, field.name) for field in dataclasses.fields(FeedOptions)})
    feeds, description, first_ids = build_feeds(args.reference, args.candidate, options)
    # A missing candidate is compare_models' one-line error, below.
    precisions = {role: precision(path) for role, path in (("reference", args.reference), ("candidate", args.candidate))
                  if os.path.isfile(path)}
    bfloat16 = [role for role, (kind, _) in precisions.items() if kind == BFLOAT16]
    if bfloat16 and providers != ["CPUExecutionProvider"]:
        raise FlashNormError(f"the {' and '.join(bfloat16)} model is bfloat16: it runs emulated on ONNX Runtime's "
                             f"CPU provider only (ONNX Runtime has no bfloat16 MatMul); drop --providers {args.providers}")
    if bfloat16:  # bfloat16 models run emulated, any other model as it is
        factory = emulating_runner_factory(optimization_level=args.optimization_level)
    else:
        factory = onnxrt_runner_factory(providers=providers, optimization_level=args.optimization_level)
    candidate_factory = tensorrt_candidate(args, feeds) or factory
    tolerances = dict(atol=args.atol, rtol=args.rtol, max_rel_l2=args.max_rel_l2, inputs_description=description)
    if args.budget:
        fp32_factory = onnxrt_runner_factory(providers=providers, optimization_level=args.optimization_level)
        budget, comparison = judge_budget(
            args.budget, args.reference, args.candidate, feeds, runners=(fp32_factory, factory, candidate_factory),
            max_ratio=args.budget_ratio, max_top1_drop_points=args.budget_top1_points, **tolerances)
        report = {**comparison.to_dict(), "tolerances_passed": comparison.passed, "budget": budget.to_dict(),
                  "passed": budget.passed}
    else:
        report = compare_models(args.reference, args.candidate, feeds, runners=(factory, candidate_factory),
                                **tolerances).to_dict()
    report["precision"] = {role: text for role, (_, text) in precisions.items()}

    def session(path):
        if precision(path)[0] == BFLOAT16:
            return emulated_session(str(path), optimization_level=args.optimization_level)
        return make_session(path, providers=providers, optimization_level=args.optimization_level)

    if args.generate:
        generation = compare_generation(args.reference, args.candidate, first_ids[0], args.generate,
                                        session_factory=session)
        # Both models generate on ONNX Runtime whatever ran the candidate above: said in the report.
        report["generation"] = {**generation.to_dict(), "runner": f"onnxruntime ({', '.join(providers)})"}
        report["passed"] = report["passed"] and generation.passed
    return report


def _quantized_pair(args: argparse.Namespace) -> bool:
    from flashnorm.validate.likelihood import quantized_ops

    return any(os.path.isfile(path) and quantized_ops(path) for path in (args.reference, args.candidate))


def run_quantized_budget(args: argparse.Namespace, providers: list[str]) -> dict[str, Any]:
    """`--budget` on a quantized pair: the NLL budget (validate/likelihood.py) on the shipped
    texts (all, or `--shipped-text NAME`), `--text` or `--input-ids`, all three models on ONNX
    Runtime one after another. The report's `exit_code`: 0 within, 1 over, 4 inconclusive."""
    from flashnorm.validate.bfloat16 import FLOAT, precision
    from flashnorm.validate.inputs import parse_input_ids, tokenize, tokenizer_for
    from flashnorm.validate.likelihood import SHIPPED_TEXTS, judge_nll_budget, shipped_text, shipped_text_names

    for path in (args.budget, args.reference, args.candidate):
        if not os.path.isfile(path):
            raise FlashNormError(f"model {path} does not exist")
    if args.trt or args.engine:
        raise FlashNormError("the quantized budget runs every model on ONNX Runtime; drop --trt/--engine")
    if not args.budget_ratio > 0:
        raise FlashNormError(f"--budget-ratio must be positive, got {args.budget_ratio:g}")
    kind = precision(args.budget)[0]
    if kind != FLOAT or _is_quantized(args.budget):
        raise FlashNormError(f"--budget {args.budget} is not a float32 model: the quantized budget measures both "
                             "quantized models against the float export")
    if args.input_ids is not None:
        texts, text = {"--input-ids": parse_input_ids(args.input_ids).reshape(-1).tolist()}, "--input-ids"
    elif args.text is not None:
        tokenizer = tokenizer_for(args.budget, args.tokenizer)
        texts, text = {"--text": tokenize(args.text, tokenizer).reshape(-1).tolist()}, "--text"
    else:
        names = shipped_text_names(args.shipped_text)
        tokenizer = tokenizer_for(args.budget, args.tokenizer)
        texts = {name: tokenize(shipped_text(name), tokenizer).reshape(-1).tolist() for name in names}
        text = (f"the shipped text {names[0]} ({SHIPPED_TEXTS[names[0]][1]})" if len(names) == 1
                else f"the {len(names)} shipped public-domain texts ({', '.join(names)})")
    budget = judge_nll_budget(args.budget, args.reference, args.candidate, texts, text=text,
                              optimization_level=args.optimization_level, providers=providers,
                              window=args.budget_window, greedy=max(args.generate, 0) or 32,
                              max_extra_ratio=args.budget_ratio, block=args.budget_segment, seed=args.budget_seed)
    return {"quantized_budget": budget.to_dict(), "passed": budget.passed, "exit_code": budget.exit_code}


def _is_quantized(path: str) -> bool:
    from flashnorm.validate.likelihood import quantized_ops

    return bool(quantized_ops(path))


def tensorrt_candidate(args: argparse.Namespace, feeds: list[dict[str, np.ndarray]]):
    """The TensorRT runner factory for the candidate when --trt or --engine is given, else
    None. TensorRT is imported here, so a missing installation is reported before any run."""
    if not (args.trt or args.engine):
        return None
    from flashnorm.engine import select_backend, shape_ranges_from_feeds, trt_runner_factory
    from flashnorm.engine.shapes import parse_shape_specs

    select_backend(args.backend, args.plugin)
    shapes = parse_shape_specs(args.shapes) or shape_ranges_from_feeds(feeds)
    return trt_runner_factory(backend=args.backend, plugins=args.plugin, shapes=shapes, engine_path=args.engine)


def verdict(report: dict[str, Any]) -> str:
    """The one line a failed comparison ends with on stderr, -q or not: what failed first, and
    the seed that replays the inputs."""
    seed = (report.get("inputs") or {}).get("seed")
    replay = f"; seed {seed} (--seed {seed} replays these inputs)" if seed is not None else ""
    quantized = report.get("quantized_budget")
    if quantized:
        from flashnorm.validate.bootstrap import describe

        return f"quantized budget on {quantized['text']}: {describe(quantized['interval'])}"
    budget = report.get("budget")
    failing = [o for o in (budget or {}).get("outputs", []) if not o["passed"]]
    if budget and failing:
        o = failing[0]
        return (f"output {o['name']}: rel L2 error {o['ratio']:.3f}x the reference's against the fp32 model (budget "
                f"{budget['max_ratio']:g}x, top-1 at most {budget['max_top1_drop_points']:g} points lower){replay}")
    failing = [o for o in report.get("outputs", []) if not o["passed"]]
    if failing:
        o = failing[0]
        return (f"output {o['name']}: max abs {o['max_abs']:.3g}, rel L2 {o['rel_l2']:.3g}"
                + (f", {o['nonfinite']} NaN/Inf mismatches" if o.get("nonfinite") else "")
                + f" (atol {report['atol']:g}, rtol {report['rtol']:g}, max rel L2 {report['max_rel_l2']:g})"
                + (f"; {len(failing) - 1} more outputs fail" if len(failing) > 1 else "") + replay)
    if report.get("missing_outputs"):
        return f"the candidate lacks the reference's outputs {report['missing_outputs']}"
    if not report.get("outputs"):
        return "the models have no output in common"
    generation = report.get("generation") or {}
    if generation and not generation.get("identical", True):
        return (f"greedy tokens differ from position {generation['first_divergence']} of "
                f"{len(generation['reference_tokens'])}{replay}")
    return "the comparison failed (see the report)" + replay


def format_text(report: dict[str, Any], verbose: bool = False) -> str:
    from flashnorm.validate.budget import format_budget
    from flashnorm.validate.comparison import ComparisonReport, OutputError, format_report

    if "quantized_budget" in report:
        from flashnorm.validate.likelihood import format_nll_budget

        return format_nll_budget(report["quantized_budget"])
    fields = {k: v for k, v in report.items() if k in ComparisonReport.__dataclass_fields__}
    fields["outputs"] = [OutputError(**o) for o in report["outputs"]]
    budget = report.get("budget")
    if budget:
        fields["passed"] = report["tolerances_passed"]
    text = format_report(ComparisonReport(**fields))
    if budget:
        text += " — not judged: --budget judges\n" + format_budget(budget)
    for role, how in report.get("precision", {}).items():
        text += f"\n{role} ran in {how}"
    generation = report.get("generation")
    if generation:
        n = len(generation["reference_tokens"])
        label = f"generation on {generation['runner']}"
        if generation["identical"]:
            text += f"\n{label}: {n} greedy tokens identical"
        else:
            text += f"\n{label}: FAILED, tokens differ from position {generation['first_divergence']} of {n}"
        text += f"\n  reference: {generation['reference_tokens']}\n  candidate: {generation['candidate_tokens']}"
        if not generation["identical"]:
            text += "\nFAILED"
    return text
