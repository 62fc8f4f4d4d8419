"""`flashnorm build MODEL.onnx -o model.plan --plugin libflashnorm_plugin.so`: a TensorRT engine
with the FlashNormMatMul plugin (strongly typed, plugin override, one optimization profile
from --shapes, optional timing cache). Needs the `tensorrt` Python package; where it is
missing, says what to install and exits non-zero."""

from __future__ import annotations

import argparse
from typing import Any

from flashnorm.engine.build import BuildOptions, build_engine_file
from flashnorm.engine.shapes import parse_shape_specs
from flashnorm.errors import FlashNormError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="ONNX model, typically the output of `flashnorm optimize --passes fold,cancel,defer`")
    parser.add_argument("-o", "--output", required=True, help="engine file to write (written atomically)")
    parser.add_argument("--plugin", action="append", default=[], metavar="LIB",
                        help="plugin library to register first, e.g. build/lib/libflashnorm_plugin.so (repeatable)")
    parser.add_argument("--shapes", nargs="+", action="extend", default=[], metavar="NAME:MIN,OPT,MAX",
                        help="optimization profile of a dynamic input, shapes as 1x64 "
                             "(e.g. input_ids:1x1,1x64,1x512); one shape fixes it")
    parser.add_argument("--timing-cache", metavar="PATH",
                        help="read tactic timings from PATH if it exists, and write them back after the build")
    parser.add_argument("--workspace", type=int, metavar="MIB", help="builder workspace limit in MiB")
    parser.add_argument("--verbose", action="store_true", help="TensorRT's verbose log")


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.workspace is not None and args.workspace <= 0:
        raise FlashNormError(f"--workspace must be a positive number of MiB, got {args.workspace}")
    options = BuildOptions(
        plugins=args.plugin,
        shapes=parse_shape_specs(args.shapes),
        timing_cache=args.timing_cache,
        workspace_bytes=None if args.workspace is None else args.workspace << 20,
        progress=not args.quiet,
        verbose=args.verbose,
    )
    return build_engine_file(args.model, args.output, options)


def format_text(report: dict[str, Any]) -> str:
    profile = ", ".join(f"{name}:{shapes}" for name, shapes in report["profile"].items()) or "static shapes"
    lines = [
        f"{report['input']} → {report['output']} ({report['engine_bytes'] / 2**20:.1f} MiB, TensorRT "
        f"{report['tensorrt']}, {report['build_seconds']} s)",
        f"  FlashNormMatMul: {report['flashnorm_plugin_layers']} of {report['flashnorm_nodes']} nodes run the plugin",
        f"  profile: {profile}",
    ]
    if report.get("note"):
        lines.append(f"  note: {report['note']}")
    return "\n".join(lines)
