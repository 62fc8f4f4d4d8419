"""`flashnorm fold-checkpoint SOURCE -o OUT_DIR`: a Hugging Face directory (safetensors,
sharded or not), a GGUF file or `--model smollm2-135m` → a Hugging Face checkpoint whose
foldable RMSNorms are weightless, their gains moved into the following linear weights."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from flashnorm.checkpoint import fold_checkpoint
from flashnorm.export.sources import load_tokenizer, resolve_source
from flashnorm.passes.quantization_aware import FORMATS
from flashnorm.paths import Input, Output
from flashnorm.tools.options import (
    DTYPE_CHOICES,
    add_model_source_options,
    at_least,
    dtype_option,
    model_source,
    source_inputs,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_source_options(parser)
    parser.add_argument("-o", "--output", required=True, help="the folded checkpoint's directory (missing or empty)")
    parser.add_argument("--force", action="store_true", help="replace OUTPUT even if it is a non-empty directory")
    parser.add_argument("--untie", action="store_true",
                        help="give a tied LM head its own folded weight (tie_word_embeddings becomes false); "
                             "by default the head stays tied and the final norm keeps its gain")
    parser.add_argument("--dtype", type=dtype_option("long", allow_auto=True), default="auto", metavar="TYPE",
                        help=f"stored dtype of floating tensors ({DTYPE_CHOICES}, auto; default auto: as stored; "
                             "float32 for GGUF)")
    parser.add_argument("--int8-limit", type=at_least(1.0, float), metavar="RATIO",
                        help="for a checkpoint that will be quantized to int8 per channel: leave a norm unfolded "
                             "where folding is estimated to raise its consumers' int8 error by more than RATIO "
                             "(each folded site's estimate is in the report; 1.3 kept SmolLM2-135M's measured "
                             "int8 logits error within 1.1x of the unfolded model's)")
    parser.add_argument("--for-quantization", metavar="FORMAT", choices=sorted(FORMATS),
                        help="the checkpoint will be quantized after folding: fold only the norms whose fold is "
                             "predicted to keep that quantizer's weight error within the format's share (as optimize "
                             f"--for-quantization; {', '.join(sorted(FORMATS))}; int4-b32 for onnxruntime-genai's "
                             "builder default); each site's predicted error ratio is in the report")
    parser.add_argument("--check-int8", action="store_true",
                        help="also quantize the original and the folded model to int8 (weight-only, per channel) "
                             "and compare their logits errors on a sample text against the float32 original")


def paths(args: argparse.Namespace) -> tuple[list[Input], list[Output]]:
    return source_inputs(args), [Output("checkpoint", Path(args.output), folder=True)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    source = model_source(args)
    tokenizer = load_tokenizer(source) if args.check_int8 else None  # a missing one fails before any work
    report = fold_checkpoint(source, args.output, untie=args.untie, dtype=args.dtype, force=args.force,
                             int8_limit=args.int8_limit, for_quantization=args.for_quantization)
    if tokenizer is not None:
        report["int8"] = _check_int8(source, report["output"], tokenizer)
        report["passed"] = report["int8"]["passed"]  # a failed check exits 1, as compare does
    return report


def _check_int8(source: Any, output: str, tokenizer: Any) -> dict[str, Any]:
    from flashnorm.checkpoint.quantize import SAMPLE_TEXT, int8_check
    from flashnorm.export.sources import load_causal_lm

    ids = tokenizer(SAMPLE_TEXT, return_tensors="pt")["input_ids"]
    result = int8_check(load_causal_lm(source), load_causal_lm(resolve_source(output)), ids)
    result["layers"] = result["layers"][:10]  # the worst ten; every layer over the limit is in layers_over_limit
    return result


def format_text(report: dict[str, Any], verbose: bool = False) -> str:
    """Header, left-alone norms grouped by reason (-v: one line each), range growth, counts,
    and the int8 check when it ran."""
    from flashnorm.report import grouped_reasons

    lines = [f"{report['source']} → {report['output']} ({report['architecture']}, {report['shards']} shard(s), "
             f"{report['tensors']} tensors, {report['seconds']} s)"]
    alone = [(s["name"], s["reason"]) for s in report["sites"] if s["status"] != "folded"]
    if verbose:
        lines += [f"  left alone: {name}: {reason}" for name, reason in alone]
    else:
        for reason, names in grouped_reasons(alone):
            more = f" and {len(names) - 1} more like it" if len(names) > 1 else ""
            lines.append(f"  left alone: {names[0]}{more}: {reason}")
    worst = report["largest_range_growth"]
    if worst["weight"]:
        lines.append(f"  largest per-channel range growth: ×{worst['factor']:.3g} ({worst['weight']})")
    lines.append(f"{report['norm_sites']} norm sites, {report['folded']} folded, {report['left_alone']} left alone")
    if "int8" in report:
        q = report["int8"]
        verdict = "within" if q["passed"] else "OVER"
        lines.append(f"int8 weight-only logits error vs float32 original: original {q['original_int8_error']:.4g}, "
                     f"folded {q['folded_int8_error']:.4g}, ratio {q['ratio']:.3f} ({verdict} the {q['limit']}× limit)")
        for row in q["layers_over_limit"][:10]:
            lines.append(f"  {row['layer']}: layer output error ×{row['ratio']:.2f} ({row['original_error']:.3g} → {row['folded_error']:.3g})")
        if len(q["layers_over_limit"]) > 10:
            lines.append(f"  ... {len(q['layers_over_limit']) - 10} more layers over the limit (--report)")
    return "\n".join(lines)
