"""`flashnorm optimize IN.onnx -o OUT.onnx`: fold gains, cancel redundant norms (and defer,
where asked) and save the result; the input is never modified."""

from __future__ import annotations

import argparse
from typing import Any

from flashnorm.passes import DEFAULT_PASSES, PASSES, optimize_file


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="input ONNX model (never modified)")
    parser.add_argument("-o", "--output", required=True, help="where to write the optimized model")
    parser.add_argument("--passes", default=",".join(DEFAULT_PASSES),
                        help=f"comma-separated passes in order (available: {', '.join(PASSES)}; "
                             f"default: {','.join(DEFAULT_PASSES)})")
    parser.add_argument("--untie", action="store_true",
                        help="fold into a private copy of a weight shared with other nodes (tied LM head)")
    parser.add_argument("--external-data", action=argparse.BooleanOptionalAction, default=None,
                        help="store weights in OUT.onnx.data (default: as the input did, or when over ~1.8 GB)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    return optimize_file(args.model, args.output, args.passes, args.untie, external_data=args.external_data)


def format_text(report: dict[str, Any]) -> str:
    """The human-readable summary the CLI prints: counts per pass, and why sites were skipped."""
    lines = [f"{report['input']} → {report['output']}: {report['norm_sites']} RMSNorm sites"]
    for pass_report in report["reports"]:
        counts = ", ".join(f"{n} {action}" for action, n in pass_report["counts"].items()) or "nothing to do"
        lines.append(f"  {pass_report['pass']}: {counts}")
        for site in pass_report["sites"]:
            if site["reason"]:
                lines.append(f"    {site['site']}: {site['action']}: {site['reason']}")
    return "\n".join(lines)
