"""`flashnorm build MODEL.onnx -o model.plan [--backend auto|tensorrt|tensorrt-rtx] [--plugin LIB]`:
a TensorRT engine, strongly typed, with one optimization profile from --shapes and an optional
timing cache. TensorRT runs FlashNormMatMul nodes with the plugin; TensorRT-RTX (no plugin
layers) builds them from their reference functions. Where neither is installed, says what to
install and exits non-zero."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from flashnorm.engine.build import BuildOptions, build_engine_file
from flashnorm.engine.shapes import parse_shape_specs
from flashnorm.paths import Input, Output
from flashnorm.tools.options import (
    FILE_OUTPUT, INT64_LIMIT, add_shapes_option, add_tensorrt_options, file_inputs, onnx_inputs, positive,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="ONNX model, typically the output of `flashnorm optimize --passes fold,cancel,defer`")
    parser.add_argument("-o", "--output", required=True, help="engine file to write" + FILE_OUTPUT)
    add_tensorrt_options(parser)
    add_shapes_option(parser, "optimization profile of a dynamic input, shapes as 1x64 "
                              "(e.g. input_ids:1x1,1x64,1x512); one shape fixes it")
    parser.add_argument("--timing-cache", metavar="PATH",
                        help="read tactic timings from PATH if it exists, and write them back after the build "
                             "(TensorRT; TensorRT-RTX picks kernels at run time and ignores it)" + FILE_OUTPUT)
    parser.add_argument("--workspace", type=positive(int, highest=INT64_LIMIT >> 20), metavar="MIB",
                        help=f"builder workspace limit in MiB (at most {INT64_LIMIT >> 20}: TensorRT takes the bytes "
                             "as an int64)")
    parser.add_argument("--optimization-level", type=int, choices=range(6), metavar="0-5",
                        help="the builder's optimization level (TensorRT's default 3; lower builds faster, "
                             "higher searches more kernels)")


def paths(args: argparse.Namespace) -> tuple[list[Input], list[Output]]:
    outputs = [Output("engine", Path(args.output))]
    if args.timing_cache:
        outputs.append(Output("timing cache", Path(args.timing_cache)))
    return onnx_inputs("model", args.model) + file_inputs("plugin library", args.plugin), outputs


def run(args: argparse.Namespace) -> dict[str, Any]:
    options = BuildOptions(
        plugins=args.plugin,
        shapes=parse_shape_specs(args.shapes),
        timing_cache=args.timing_cache,
        workspace_bytes=None if args.workspace is None else args.workspace << 20,
        progress=not args.quiet,
        verbose=args.verbose,
        backend=args.backend,
        optimization_level=args.optimization_level,
    )
    return build_engine_file(args.model, args.output, options)


def format_text(report: dict[str, Any], verbose: bool = False) -> str:
    profile = ", ".join(f"{name}:{shapes}" for name, shapes in report["profile"].items()) or "static shapes"
    backend = "TensorRT" if report["backend"] == "tensorrt" else "TensorRT-RTX"
    network = report["network"]
    types = ", ".join(f"{kind} {count}" for kind, count in network["layer_types"].items())
    lines = [
        f"{report['input']} → {report['output']} ({report['engine_bytes'] / 2**20:.1f} MiB, {backend} "
        f"{report['tensorrt']}, {report['build_seconds']} s)",
        f"  FlashNormMatMul: {report['flashnorm_plugin_layers']} of {report['flashnorm_nodes']} nodes run the plugin",
        f"  network: {network['layers']} layers ({types})",
        f"  norms: {network['mean_reductions']} mean reductions (one per RMSNorm, two per LayerNorm or "
        f"FlashNormMatMul reference body), "
        f"{network['flashnorm_plugin_layers']} FlashNorm plugin layers",
        f"  profile: {profile}",
    ]
    inspector = report["engine_inspector"]
    if inspector["available"]:
        lines.append(f"  engine: {inspector['layers']} layers after fusion; norm layers: "
                     + (", ".join(inspector["norm_layers"]) or "none named"))
    else:
        lines.append(f"  engine inspector: {inspector['reason']}")
    for key in ("timing_cache_note", "note"):
        if report.get(key):
            lines.append(f"  note: {report[key]}")
    return "\n".join(lines)
