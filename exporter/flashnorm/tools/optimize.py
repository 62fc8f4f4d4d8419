"""`flashnorm optimize IN.onnx -o OUT.onnx`: fold gains, cancel redundant norms (and defer,
where asked) and save the result; the input is never modified."""

from __future__ import annotations

import argparse
from typing import Any

from flashnorm.passes import DEFAULT_PASSES, PASSES, optimize_file
from flashnorm.quantization_aware import FORMATS
from flashnorm.paths import Input, Output
from flashnorm.report import grouped_reasons
from flashnorm.tools.options import FILE_OUTPUT, add_quant_limit_option, onnx_inputs, onnx_outputs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="input ONNX model (never modified)")
    parser.add_argument("-o", "--output", required=True, help="where to write the optimized model (and its .data file)"
                        + FILE_OUTPUT)
    parser.add_argument("--passes", default=",".join(DEFAULT_PASSES),
                        help=f"comma-separated passes in order (available: {', '.join(PASSES)}; "
                             f"default: {','.join(DEFAULT_PASSES)}); --untie, --for-quantization and --quant-limit "
                             "are fold's options, refused when the passes do not include fold")
    parser.add_argument("--untie", action="store_true",
                        help="fold into a private copy of a weight shared with other nodes (tied LM head)")
    parser.add_argument("--for-quantization", metavar="FORMAT", choices=sorted(FORMATS),
                        help="the model will be quantized after folding: fold only the sites whose fold is predicted "
                             "to keep that quantizer's weight error within the format's share of the unfolded model's "
                             "(simulated round-to-nearest; "
                             + "; ".join(f"{k}: {v.description} (share {v.share * 100:g} %%)" for k, v in FORMATS.items())
                             + "); each site's predicted error ratio is in the report (docs/QUANTIZATION.md). For a "
                               "float model: one whose norms already feed quantized consumers is refused (fold it "
                               "without this option)")
    parser.add_argument("--external-data", action=argparse.BooleanOptionalAction, default=None,
                        help="store weights in OUT.onnx.data (default: as the input did, or when over ~1.8 GB)")
    add_quant_limit_option(parser)


def paths(args: argparse.Namespace) -> tuple[list[Input], list[Output]]:
    return onnx_inputs("input model", args.model), onnx_outputs(args.output)


def run(args: argparse.Namespace) -> dict[str, Any]:
    return optimize_file(args.model, args.output, args.passes, args.untie, external_data=args.external_data,
                         quant_limit=args.quant_limit, for_quantization=args.for_quantization)


def format_text(report: dict[str, Any], verbose: bool = False) -> str:
    """The human-readable summary the CLI prints: counts per pass, then why sites were
    skipped, one line per reason with its count (`verbose`: one line per site)."""
    lines = [f"{report['input']} → {report['output']}: {report['norm_sites']} RMSNorm sites"]
    for pass_report in report["reports"]:
        counts = ", ".join(f"{n} {action}" for action, n in pass_report["counts"].items()) or "nothing to do"
        lines.append(f"  {pass_report['pass']}: {counts}")
        rounded = [site["details"]["rounding"] for site in pass_report["sites"] if site.get("details", {}).get("rounding")]
        if rounded:
            lines.append(f"    {len(rounded)} sites rounded g·W to {rounded[0]['weight_dtype']} once: weights change by at most "
                         f"{max(r['estimated_output_rel_l2'] for r in rounded):.2g} rel L2 per site (the estimated "
                         f"change of its projections' outputs), {max(r['max_relative_change'] for r in rounded):.2g} "
                         "per element (subnormal results included)")
        lines += _quantized_lines(pass_report["sites"])
        explained = [site for site in pass_report["sites"] if site["reason"]]
        if verbose:
            lines += [f"    {site['site']}: {site['action']}: {site['reason']}" for site in explained]
            continue
        for action in dict.fromkeys(site["action"] for site in explained):
            decisions = [(site["site"], site["reason"]) for site in explained if site["action"] == action]
            for reason, sites in grouped_reasons(decisions):
                where = sites[0] if len(sites) == 1 else f"{len(sites)} sites, e.g. {sites[0]}"
                lines.append(f"    {action} ({where}): {reason}")
    return "\n".join(lines)


def _quantized_lines(sites: list[dict[str, Any]]) -> list[str]:
    """One line for the sites folded into quantized weights: how many exactly, and the largest
    requantization error of the others."""
    folded = [s["details"]["quantized"] for s in sites if s["action"] == "folded" and s.get("details", {}).get("quantized")]
    if not folded:
        return []
    exact = sum(q["exact"] for q in folded)
    line = f"    {len(folded)} sites folded into quantized weights, {exact} exactly"
    requantized = [q for q in folded if not q["exact"]]
    if requantized:
        line += (f"; {len(requantized)} requantized: at most {max(q['rel_error'] for q in requantized):.2g} rel error, "
                 f"{max(q['noise_ratio'] for q in requantized):.2g}x the format's own noise")
    return [line]
