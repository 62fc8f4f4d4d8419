"""A dry run of the passes: at every norm site (RMSNorm or LayerNorm), whether fold, cancel and
(after fold) defer would apply, and if not, why — from the passes' own plans, changing nothing.
`flashnorm inspect` prints it."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from flashnorm.match import NormSite, find_norm_candidates, find_norm_sites
from flashnorm.match.shapes import inferred_shapes
from flashnorm.passes.cancel import NotCancellable, plan_cancel
from flashnorm.passes.fold import NotFoldable, fold, plan_fold, site_rounding
from flashnorm.passes.quantized import DEFAULT_QUANT_LIMIT, site_quant_error
from flashnorm.progress import Progress


def inspect_graph(graph: gs.Graph, *, untie: bool = False, quant_limit: float | None = None) -> dict[str, Any]:
    """The inspect report for an already loaded graph (changes nothing). `quant_limit`: as
    `optimize --quant-limit` (None: the default); quantized sites report their measured error."""
    limit = DEFAULT_QUANT_LIMIT if quant_limit is None else quant_limit
    with inferred_shapes(graph, keep_types=False):
        report = _inspect(graph, untie, limit)
    return {**report, "quant_limit": limit}


def _inspect(graph: gs.Graph, untie: bool, quant_limit: float) -> dict[str, Any]:
    deferrable = _defer_after_fold(graph, untie, quant_limit)
    found = find_norm_candidates(graph)
    graph_outputs = frozenset(t.name for t in graph.outputs)
    sites = []
    for site in found.sites:
        try:
            edits = plan_fold(site, graph_outputs, untie=untie, quant_limit=quant_limit)
            fold = {"applies": True, "reason": "",
                    "untied": [e.weight.name for e in edits if e.shared_with]}
            rounding = site_rounding(edits)
            if rounding:
                fold["rounding"] = rounding
            quantized = site_quant_error(edits)
            if quantized:
                fold["quantized"] = quantized
        except NotFoldable as exc:
            fold = {"applies": False, "reason": str(exc), **exc.details}
        try:
            plan = plan_cancel(site, found.sites, graph_outputs)
            cancel = {"applies": True, "reason": "", "downstream": [d.name for d in plan.downstream]}
        except NotCancellable as exc:
            cancel = {"applies": False, "reason": str(exc)}
        defer = deferrable.get(site.name, {"applies": False, "reason": "not found again after fold"})
        sites.append({
            "name": site.name,
            "spelling": site.spelling,
            "kind": site.kind,
            "eps": site.eps,
            "input": site.input.name,
            "hidden_size": site.hidden_size,
            "gain_convention": site.gain_convention,
            "gain": _gain_stats(site),
            "bias": _bias_stats(site),
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
        "weightless": sum(s["weightless"] for s in sites),
        "sites": sites,
        "rejected": [{"name": r.name, "spelling": r.spelling, "reason": r.reason} for r in found.rejected],
    }


def _defer_after_fold(graph: gs.Graph, untie: bool, quant_limit: float) -> dict[str, dict[str, Any]]:
    """Whether `optimize --passes fold,defer` would defer each site: defer needs a weightless
    norm, so it is judged on a folded copy (site names are output names, which fold keeps)."""
    from flashnorm.passes.defer import GainKept, NotDeferrable, plan_defer

    shown, Progress.enabled = Progress.enabled, False  # a rehearsal, not a fold the user asked for
    try:
        folded, _ = fold(graph.copy(), untie=untie, quant_limit=quant_limit)
    finally:
        Progress.enabled = shown
    graph_outputs = frozenset(t.name for t in folded.outputs)
    result = {}
    for site in find_norm_sites(folded):
        try:
            plan = plan_defer(site, graph_outputs)
            result[site.name] = {"applies": True, "reason": "", "dequantized": plan.dequantized_weights()}
        except GainKept:  # judged after the fold: it is the fold that left the gain
            result[site.name] = {"applies": False,
                                 "reason": "fold leaves the gain here (its reason says why); defer needs a weightless norm"}
        except NotDeferrable as exc:
            result[site.name] = {"applies": False, "reason": str(exc)}
    return result


def _bias_stats(site: NormSite) -> dict[str, Any] | None:
    """A LayerNorm's bias: what the fold moves into its consumers' biases."""
    if site.bias is None:
        return None
    return {"min": float(site.bias.min()), "max": float(site.bias.max()), "abs_max": float(np.abs(site.bias).max()),
            "size": int(site.bias.size)}


def _gain_stats(site: NormSite) -> dict[str, Any] | None:
    if site.gain is None:
        return None
    g = site.gain
    magnitudes = np.abs(g[g != 0])
    return {"min": float(g.min()), "max": float(g.max()), "mean": float(g.mean()),
            "negatives": int(np.count_nonzero(g < 0)), "size": int(g.size),
            # What a half-precision fold multiplies into the weights: a large |g| on small
            # weight entries, or Gemma's 1+w near 0, is where g·W leaves the type's range.
            "abs_max": float(np.abs(g).max()), "abs_min": float(magnitudes.min()) if magnitudes.size else 0.0,
            "dtype": site.gain_dtype.name if site.gain_dtype is not None else None}