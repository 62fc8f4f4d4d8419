"""`flashnorm export SOURCE -o model.onnx`: a Hugging Face directory or GGUF file (or
`--model smollm2-135m`) → an ONNX graph. A causal LM goes from input_ids, attention_mask and
position_ids to logits, with dynamic batch and sequence (`--kv-cache` adds past/present keys
and values); an encoder (ViT, DINOv2, CLIP's towers, the Whisper encoder, BERT) from its
pixel_values, input_ids + attention_mask or input_features to last_hidden_state and its pooled
output, with a dynamic batch (flashnorm.export.encoders)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from flashnorm.errors import FlashNormError
from flashnorm.export.encoders import TOWERS
from flashnorm.export.onnx_export import DEFAULT_OPSET, torch_dtype_name
from flashnorm.paths import Input, Output
from flashnorm.tools.options import (
    DTYPE_CHOICES, FILE_OUTPUT, add_model_source_options, at_least, dtype_option, model_source, onnx_outputs, source_inputs,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_source_options(parser)
    parser.add_argument("-o", "--output", required=True, help="where to write the ONNX model (and its .data file)"
                        + FILE_OUTPUT)
    parser.add_argument("--dynamo", action="store_true",
                        help=f"use torch's dynamo exporter (default opset {DEFAULT_OPSET[True]}; emits "
                             f"RMSNormalization) instead of the legacy TorchScript exporter (opset {DEFAULT_OPSET[False]})")
    parser.add_argument("--opset", type=at_least(7), help="ONNX opset (default: 17 legacy, 23 dynamo)")
    parser.add_argument("--dtype", default="fp32", metavar="TYPE", type=dtype_option("short"),
                        help=f"weights and activations in this type ({DTYPE_CHOICES}; default fp32); each "
                             "RMSNorm is still computed in fp32 inside the graph, and the logits are in this type")
    parser.add_argument("--fold", action="store_true",
                        help="fold every foldable norm's gain into the following linear weights before exporting, "
                             "in float64, each weight rounded once to --dtype (the recommended half-precision "
                             "artifact: the same weights as fold-checkpoint --dtype float16|bfloat16 then export; "
                             "a tied LM head stays tied and the final norm keeps its gain)")
    parser.add_argument("--kv-cache", action="store_true",
                        help="causal LMs: add past_key_values.<i>.key/value inputs and present.<i>.key/value outputs")
    parser.add_argument("--tower", choices=TOWERS,
                        help="a CLIP folder: export this tower (pixel_values → image_embeds, or input_ids + "
                             "attention_mask → text_embeds; both with last_hidden_state)")


def paths(args: argparse.Namespace) -> tuple[list[Input], list[Output]]:
    return source_inputs(args), onnx_outputs(args.output)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from flashnorm.export.onnx_export import export_source
    dtype = torch_dtype_name(args.dtype)
    source = model_source(args)
    output = Path(args.output)
    if output.suffix.lower() != ".onnx":
        raise FlashNormError(f"output {output} should end in .onnx")
    if args.opset is not None and not 7 <= args.opset <= 25:
        raise FlashNormError(f"opset {args.opset} is out of range (7..25)")
    if not args.fold:
        return export_source(source, output, dynamo=args.dynamo, opset=args.opset, kv_cache=args.kv_cache, dtype=dtype,
                             tower=args.tower)
    from flashnorm.checkpoint.fold import fold_loaded_model
    from flashnorm.export.encoders import load_encoder
    from flashnorm.export.onnx_export import say
    from flashnorm.export.sources import classify_source, load_causal_lm

    encoder = classify_source(source, args.tower)
    say(f"loading {source.describe()} in float32 to fold")
    model = load_causal_lm(source, "float32") if encoder is None else load_encoder(source.directory, encoder)
    fold = fold_loaded_model(model, round_to=None if dtype == "float32" else dtype)
    say(f"folded {fold['folded']} norms in float64, rounded once to {dtype}")
    report = export_source(source, output, dynamo=args.dynamo, opset=args.opset, kv_cache=args.kv_cache, dtype=dtype,
                           model=model, tower=args.tower)
    report["fold"] = fold
    return report


def format_text(report: dict[str, Any], verbose: bool = False) -> str:
    if report.get("encoder"):
        return _format_encoder(report, verbose)
    kv = ", KV cache" if report["kv_cache"] else ""
    tie = ""
    if report["tied_lm_head"]:
        kept = "kept tied: one initializer" if report["lm_head_tied_in_onnx"] else "UNTIED by the exporter: two copies"
        tie = f"; tied LM head {kept}"
    folded = _folded_lines(report, verbose)
    return (
        f"{report['source']} → {report['output']} ({report['exporter']} exporter, opset {report['opset']}, "
        f"{report['dtype']}{kv}){tie}\n"
        f"  logits in {report['logits_dtype']}\n"
        f"  inputs: {', '.join(report['inputs'][:3])}{' + past keys/values' if report['kv_cache'] else ''}\n"
        f"  {report['parameters']:,} parameters; loaded in {report['load_seconds']} s, exported in "
        f"{report['export_seconds']} s, {report['seconds']} s in all{folded}"
    )


def _folded_lines(report: dict[str, Any], verbose: bool) -> str:
    if not report.get("fold"):
        return ""
    fold = report["fold"]
    lines = f"\n  folded {fold['folded']} norms before rounding to {report['dtype']}, {fold['left_alone']} left alone"
    if verbose:
        lines += "".join(f"\n    left alone: {s['name']}: {s['reason']}" for s in fold["sites_left_alone"])
    return lines


def _format_encoder(report: dict[str, Any], verbose: bool) -> str:
    norms = "pre-LN" if report["pre_ln"] else "post-LN: its norms feed the residual, nothing folds"
    return (
        f"{report['source']} → {report['output']} ({report['encoder']} encoder, {norms}; {report['exporter']} "
        f"exporter, opset {report['opset']}, {report['dtype']})\n"
        f"  inputs: {', '.join(report['inputs'])} (dynamic batch)\n"
        f"  outputs: {', '.join(report['outputs'])} (pooled: {report['pooled_output']}, {report['output_dtype']})\n"
        f"  {report['parameters']:,} parameters; loaded in {report['load_seconds']} s, exported in "
        f"{report['export_seconds']} s, {report['seconds']} s in all{_folded_lines(report, verbose)}"
    )
