"""`flashnorm inspect MODEL.onnx`: every RMSNorm site — spelling, eps, gain convention and
statistics, consumers — and whether fold, cancel and (after fold) defer apply, and if not, why."""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from flashnorm.match import NormSite, find_norm_candidates, find_norm_sites
from flashnorm.match.shapes import inferred_shapes
from flashnorm.passes.cancel import NotCancellable, plan_cancel
from flashnorm.passes.fold import NotFoldable, fold, plan_fold
from flashnorm.progress import Progress


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="ONNX model to inspect")
    parser.add_argument("--untie", action="store_true",
                        help="judge fold as `optimize --untie` would (copy tied weights)")


def inspect_graph(graph: gs.Graph, *, untie: bool = False) -> dict[str, Any]:
    """The inspect report for an already loaded graph (changes nothing)."""
    with inferred_shapes(graph, keep_types=False):
        return _inspect(graph, untie)


def _inspect(graph: gs.Graph, untie: bool) -> dict[str, Any]:
    deferrable = _defer_after_fold(graph, untie)
    found = find_norm_candidates(graph)
    graph_outputs = frozenset(t.name for t in graph.outputs)
    sites = []
    for site in found.sites:
        try:
            edits = plan_fold(site, graph_outputs, untie=untie)
            fold = {"applies": True, "reason": "",
                    "untied": [e.weight.name for e in edits if e.shared_with]}
        except NotFoldable as exc:
            fold = {"applies": False, "reason": str(exc)}
        try:
            plan = plan_cancel(site, found.sites, graph_outputs)
            cancel = {"applies": True, "reason": "", "downstream": [d.name for d in plan.downstream]}
        except NotCancellable as exc:
            cancel = {"applies": False, "reason": str(exc)}
        defer = deferrable.get(site.name, {"applies": False, "reason": "not found again after fold"})
        sites.append({
            "name": site.name,
            "spelling": site.spelling,
            "eps": site.eps,
            "input": site.input.name,
            "hidden_size": site.hidden_size,
            "gain_convention": site.gain_convention,
            "gain": _gain_stats(site),
            "weightless": site.is_weightless,
            "consumers": [f"{n.op} {n.name}" for n in site.consumers],
            "fold": fold,
            "cancel": cancel,
            "defer": defer,
        })
    return {
        "norm_sites": len(sites),
        "foldable": sum(s["fold"]["applies"] for s in sites),
        "cancellable": sum(s["cancel"]["applies"] for s in sites),
        "deferrable": sum(s["defer"]["applies"] for s in sites),
        "sites": sites,
        "rejected": [{"name": r.name, "spelling": r.spelling, "reason": r.reason} for r in found.rejected],
    }


def _defer_after_fold(graph: gs.Graph, untie: bool) -> dict[str, dict[str, Any]]:
    """Whether `optimize --passes fold,defer` would defer each site: defer needs a weightless
    norm, so it is judged on a folded copy (site names are output names, which fold keeps)."""
    from flashnorm.passes.defer import NotDeferrable, plan_defer

    shown, Progress.enabled = Progress.enabled, False  # a rehearsal, not a fold the user asked for
    try:
        folded, _ = fold(graph.copy(), untie=untie)
    finally:
        Progress.enabled = shown
    graph_outputs = frozenset(t.name for t in folded.outputs)
    result = {}
    for site in find_norm_sites(folded):
        try:
            plan_defer(site, graph_outputs)
            result[site.name] = {"applies": True, "reason": ""}
        except NotDeferrable as exc:
            result[site.name] = {"applies": False, "reason": str(exc)}
    return result


def _gain_stats(site: NormSite) -> dict[str, Any] | None:
    if site.gain is None:
        return None
    g = site.gain
    return {"min": float(g.min()), "max": float(g.max()), "mean": float(g.mean()),
            "negatives": int(np.count_nonzero(g < 0)), "size": int(g.size)}


def format_text(report: dict[str, Any]) -> str:
    """The human-readable form the CLI prints: one row per site, reasons underneath."""
    if not report["sites"]:
        lines = ["no RMSNorm sites found"]
    else:
        header = ("#", "site", "spelling", "eps", "gain", "min", "mean", "max", "neg", "consumers", "fold", "cancel",
                  "defer")
        rows = []
        for i, s in enumerate(report["sites"]):
            g = s["gain"]
            stats = ("-",) * 4 if g is None else (f"{g['min']:.3g}", f"{g['mean']:.3g}", f"{g['max']:.3g}", str(g["negatives"]))
            rows.append((str(i), _short(s["name"], 40), s["spelling"], f"{s['eps']:.3g}", s["gain_convention"], *stats,
                         _short(", ".join(c.split()[0] for c in s["consumers"]), 30),
                         *("yes" if s[step]["applies"] else "no" for step in ("fold", "cancel", "defer"))))
        widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
        lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in [header, *rows]]
        lines.append("")
        for i, s in enumerate(report["sites"]):
            for step in ("fold", "cancel", "defer"):
                if not s[step]["applies"]:
                    lines.append(f"#{i} {step}: {s[step]['reason']}")
        lines.append(f"{report['norm_sites']} sites, {report['foldable']} foldable, {report['cancellable']} cancellable, "
                     f"{report['deferrable']} deferrable after fold")
    for r in report["rejected"]:
        lines.append(f"rejected {r['spelling']} at {r['name']}: {r['reason']}")
    return "\n".join(lines)


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else "…" + text[-(width - 1):]


def run(args: argparse.Namespace) -> dict[str, Any]:
    from flashnorm import io

    graph = io.load(args.model)
    return {"model": str(args.model), **inspect_graph(graph, untie=args.untie)}
