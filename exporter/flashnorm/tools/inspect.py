"""`flashnorm inspect MODEL.onnx`: every norm site — kind (RMSNorm or LayerNorm), spelling, eps,
gain convention and statistics, consumers — and whether fold, cancel and (after fold) defer
apply, and if not, why."""

from __future__ import annotations

import argparse
from typing import Any

from flashnorm.errors import FlashNormError
from flashnorm.passes.dry_run import inspect_graph
from flashnorm.paths import Input, Output
from flashnorm.report import grouped_reasons
from flashnorm.tools.options import add_quant_limit_option, onnx_inputs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="ONNX model to inspect")
    parser.add_argument("--untie", action="store_true",
                        help="judge fold as `optimize --untie` would (copy tied weights)")
    add_quant_limit_option(parser)


def paths(args: argparse.Namespace) -> tuple[list[Input], list[Output]]:
    return onnx_inputs("model", args.model), []


def format_text(report: dict[str, Any], verbose: bool = False) -> str:
    """The human-readable form the CLI prints: one row per site, then why fold, cancel or
    defer does not apply, one line per step and reason naming its first site and how many
    share it (`verbose`: one line per site and step)."""
    if not report["sites"]:
        lines = ["no RMSNorm or LayerNorm sites found"]
    else:
        header = ("#", "site", "kind", "spelling", "eps", "gain", "min", "mean", "max", "neg", "consumers", "fold",
                  "cancel", "defer")
        rows = []
        for i, s in enumerate(report["sites"]):
            g = s["gain"]
            stats = ("-",) * 4 if g is None else (f"{g['min']:.3g}", f"{g['mean']:.3g}", f"{g['max']:.3g}", str(g["negatives"]))
            rows.append((str(i), _short(s["name"], 40), s["kind"], s["spelling"], f"{s['eps']:.3g}", s["gain_convention"],
                         *stats,
                         _short(", ".join(c.split()[0] for c in s["consumers"]), 30),
                         *("yes" if s[step]["applies"] else "no" for step in ("fold", "cancel", "defer"))))
        widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
        lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in [header, *rows]]
        lines.append("")
        lines += _reasons(report["sites"], verbose)
        for i, s in enumerate(report["sites"]):
            rounding = s["fold"].get("rounding")
            g = s["gain"]
            if rounding and g:
                lines.append(f"#{i} fold in {rounding['weight_dtype']}: |g| in [{g['abs_min']:.3g}, {g['abs_max']:.3g}], "
                             f"largest |g·W| {rounding['largest_folded_value']:.3g}, weights change by "
                             f"{rounding['estimated_output_rel_l2']:.2g} (rel L2), at most {rounding['max_relative_change']:.2g} "
                             "per element")
        lines += _quantized_lines(report)
        lines += _dequantized_lines(report["sites"], verbose)
        lines.append(f"{report['norm_sites']} sites, {report['foldable']} foldable, {report['cancellable']} cancellable, "
                     f"{report['deferrable']} deferrable after fold, {report['weightless']} already weightless")
    for r in report["rejected"]:
        lines.append(f"rejected {r['spelling']} at {r['name']}: {r['reason']}")
    return "\n".join(lines)


def _quantized_lines(report: dict[str, Any]) -> list[str]:
    """Per site with quantized consumers: each weight's format, exact or requantized, its error."""
    lines = []
    for i, s in enumerate(report["sites"]):
        quantized = s["fold"].get("quantized")
        if not quantized:
            continue
        for w in quantized["weights"]:
            how = "exact" if w["exact"] else (f"requantized: rel error {w['rel_error']:.3g}, {w['noise_ratio']:.3g}x "
                                              f"the format's own noise (limit {report.get('quant_limit', 0):g})")
            lines.append(f"#{i} fold into {w['consumer']} ({w['format']}): {how}")
    return lines


def _dequantized_lines(sites: list[dict[str, Any]], verbose: bool) -> list[str]:
    """Deferrable sites whose node will read weights the graph dequantizes: per weight
    (`verbose`), or one line per kind of dequantization naming the first site."""
    weights = [(f"#{i}", d) for i, s in enumerate(sites) for d in s["defer"].get("dequantized", [])]
    if verbose:
        return [f"{site} defer reads a weight the graph dequantizes ({d}); it stays quantized in the file"
                for site, d in weights]
    kinds: dict[str, list[str]] = {}
    for site, d in weights:
        kinds.setdefault(d.rsplit(": ", 1)[-1], []).append(site)
    return [f"{group[0]} defer reads weights the graph dequantizes ({kind}: {_count(len(group), 'weight')} at "
            f"{_count(len(set(group)), 'site')}); they stay quantized in the file" for kind, group in kinds.items()]


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _reasons(sites: list[dict[str, Any]], verbose: bool) -> list[str]:
    """Why each step does not apply: per site and step, or grouped by reason."""
    refused = [(f"#{i}", step, s[step]["reason"]) for i, s in enumerate(sites)
               for step in ("fold", "cancel", "defer") if not s[step]["applies"]]
    if verbose:
        return [f"{site} {step}: {reason}" for site, step, reason in refused]
    lines = []
    for step in ("fold", "cancel", "defer"):
        decisions = [(site, reason) for site, refused_step, reason in refused if refused_step == step]
        for reason, group in grouped_reasons(decisions):
            count = f" ({len(group)} sites)" if len(group) > 1 else ""
            lines.append(f"{group[0]} {step}: {reason}{count}")
    return lines


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else "…" + text[-(width - 1):]


def run(args: argparse.Namespace) -> dict[str, Any]:
    from flashnorm import contract, modelio

    graph = modelio.load(args.model)
    legacy = contract.legacy_encoding(((node.op, node.domain) for node in graph.nodes), ())
    if legacy:
        raise FlashNormError(f"{args.model}: {legacy}")
    return {"model": str(args.model), **inspect_graph(graph, untie=args.untie, quant_limit=args.quant_limit)}
