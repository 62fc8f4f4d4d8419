"""`flashnorm fold-checkpoint SOURCE -o OUT_DIR`: a Hugging Face directory (safetensors,
sharded or not), a GGUF file or `--model smollm2-135m` → a Hugging Face checkpoint whose
foldable RMSNorms are weightless, their gains moved into the following linear weights."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from flashnorm.checkpoint import fold_checkpoint
from flashnorm.export.sources import load_tokenizer, resolve_source
from flashnorm.quantization_aware import FORMATS
from flashnorm.paths import Input, Output
from flashnorm.tools.options import (
    DTYPE_CHOICES,
    FOLDER_OUTPUT,
    DeprecatedAlias,
    add_model_source_options,
    at_least,
    dtype_option,
    model_source,
    source_inputs,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_source_options(parser)
    parser.add_argument("-o", "--output", required=True, help="the folded checkpoint's directory" + FOLDER_OUTPUT)
    parser.add_argument("--force", action="store_true", help="replace OUTPUT even if it is a non-empty directory")
    parser.add_argument("--untie", action="store_true",
                        help="give a tied LM head its own folded weight (tie_word_embeddings becomes false); "
                             "by default the head stays tied and the final norm keeps its gain")
    parser.add_argument("--dtype", type=dtype_option("long", allow_auto=True), default="auto", metavar="TYPE",
                        help=f"stored dtype of floating tensors ({DTYPE_CHOICES}, auto; default auto: as stored; "
                             "float32 for GGUF)")
    parser.add_argument("--int8-limit", type=at_least(1.0, float), metavar="RATIO", action=DeprecatedAlias,
                        replacement="--for-quantization int8",
                        why="one selection of the norms to fold before a quantizer, shared with optimize; "
                            "--int8-limit still works in this release and goes in the next",
                        help="deprecated (still works in this release, removed in the next): use --for-quantization "
                             "int8, the one selection optimize shares (SmolLM2-135M, --check-int8: it folds 11 norms "
                             "at 0.91x the unfolded model's int8 error; --int8-limit 1.3 folds 55 at 1.04x; "
                             "docs/CHECKPOINTS.md). Leaves a norm unfolded where folding is estimated to raise its "
                             "consumers' int8 per-channel error by more than RATIO")
    parser.set_defaults(int8_limit=None)
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
    result["quantized_layers"] = len(result["layers"])
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
                     f"folded {q['folded_int8_error']:.4g}, ratio {q['ratio']:.3f} ({verdict} the check's "
                     f"{q['limit']}× limit, which judges the logits)")
        grown = q["layers_over_limit"]
        if grown:
            of = f" of {q['quantized_layers']}" if "quantized_layers" in q else ""
            lines.append(f"  not judged: {len(grown)}{of} quantized layers' own output error grew more than {q['limit']}× "
                         "(each on its own input), the worst:")
        for row in grown[:10]:
            lines.append(f"  {row['layer']}: layer output error ×{row['ratio']:.2f} ({row['original_error']:.3g} → {row['folded_error']:.3g})")
        if len(grown) > 10:
            lines.append(f"  ... and {len(grown) - 10} more such layers (--report lists them)")
    return "\n".join(lines)


def verdict(report: dict[str, Any]) -> str:
    """The one line a failed --check-int8 ends with on stderr."""
    q = report["int8"]
    return (f"--check-int8: the folded model's int8 logits error is {q['ratio']:.3f}× the original's, over the "
            f"{q['limit']}× limit")
