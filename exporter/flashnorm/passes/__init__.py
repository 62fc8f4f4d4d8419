"""Graph passes: each takes a graph and returns (graph, PassReport); no pass reads another's
internals. `run_passes` applies them in order; `optimize_file` is the whole file-to-file job
behind `flashnorm optimize`."""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import onnx_graphsurgeon as gs

from flashnorm.errors import FlashNormError
from flashnorm.report import PassReport

# Pass name → module under flashnorm.passes; each module defines a function of the same name.
# Imported on first use, so a missing or broken pass does not break the others.
PASSES: dict[str, str] = {"fold": "fold", "cancel": "cancel", "defer": "defer"}
DEFAULT_PASSES: tuple[str, ...] = ("fold", "cancel")


def get_pass(name: str) -> Callable[..., tuple[gs.Graph, PassReport]]:
    if name not in PASSES:
        raise FlashNormError(f"unknown pass {name!r}; available: {', '.join(PASSES)}")
    module_name = f"flashnorm.passes.{PASSES[name]}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        raise FlashNormError(f"pass {name!r} is not available in this installation") from None
    return getattr(module, name)


def parse_pass_names(names: str | Sequence[str]) -> list[str]:
    """'fold,cancel' or ['fold', 'cancel'] → validated list (unknown names: FlashNormError)."""
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",")]
    names = [n for n in names if n]
    if not names:
        raise FlashNormError(f"no passes given; available: {', '.join(PASSES)}")
    for name in names:
        if name not in PASSES:
            raise FlashNormError(f"unknown pass {name!r}; available: {', '.join(PASSES)}")
    return list(names)


def run_passes(graph: gs.Graph, names: Sequence[str], *, untie: bool = False) -> tuple[gs.Graph, list[PassReport]]:
    """Apply the named passes in order; `untie` reaches the fold pass only. Missing element
    types (the legacy torch exporter writes none) are inferred first: passes that build new
    nodes need them."""
    from flashnorm.match.shapes import annotate_types

    names = parse_pass_names(names)
    annotate_types(graph)
    reports = []
    for name in names:
        function = get_pass(name)
        graph, report = function(graph, untie=untie) if name == "fold" else function(graph)
        graph.cleanup().toposort()
        reports.append(report)
    return graph, reports


def optimize_file(
    in_path: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    passes: str | Sequence[str] = DEFAULT_PASSES,
    untie: bool = False,
    *,
    external_data: Optional[bool] = None,
) -> dict[str, Any]:
    """Load `in_path`, run `passes`, save to `out_path` (atomically; the input is never
    written). Raises FlashNormError for bad input: unknown pass, unreadable or invalid
    model, no RMSNorm found, unwritable output."""
    from flashnorm import io
    from flashnorm.match import find_norm_candidates

    names = parse_pass_names(passes)
    source, destination = Path(in_path), Path(out_path)
    if not source.is_file():
        raise FlashNormError(f"input {source} does not exist or is not a file")
    if destination.exists() and destination.resolve() == source.resolve():
        raise FlashNormError(f"output {destination} is the input; FlashNorm never overwrites its input")
    directory = destination.parent if str(destination.parent) else Path(".")
    if not directory.is_dir() or not os.access(directory, os.W_OK):
        raise FlashNormError(f"cannot write {destination}: directory {directory} is missing or not writable")
    graph = io.load(source)
    found = find_norm_candidates(graph)
    if not found.sites:
        why = f" ({len(found.rejected)} near-misses: {found.rejected[0].reason})" if found.rejected else ""
        raise FlashNormError(f"no RMSNorm found in {source}{why}")
    graph, reports = run_passes(graph, names, untie=untie)
    io.save(graph, destination, external_data=external_data)
    summary: dict[str, int] = {}
    for report in reports:
        for action, count in report.to_dict()["counts"].items():
            summary[f"{report.name}.{action}"] = count
    return {
        "input": str(source),
        "output": str(destination),
        "passes": names,
        "untie": untie,
        "norm_sites": len(found.sites),
        "summary": summary,
        "reports": [r.to_dict() for r in reports],
    }
