"""Graph passes: each takes a graph and returns (graph, PassReport); no pass reads another's
internals. `run_passes` applies them in order; `optimize_file` is the whole file-to-file job
behind `flashnorm optimize`."""

from __future__ import annotations

import importlib
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import onnx_graphsurgeon as gs

from flashnorm.errors import FlashNormError, require_file
from flashnorm.report import PassReport

# Pass name → (module under flashnorm.passes, which defines a function of the same name; the
# `run_passes` options that function takes). Imported on first use, so a missing or broken pass
# does not break the others.
PASSES: dict[str, tuple[str, tuple[str, ...]]] = {
    "fold": ("fold", ("untie", "quant_limit", "for_quantization")),
    "cancel": ("cancel", ()),
    "defer": ("defer", ()),
}
DEFAULT_PASSES: tuple[str, ...] = ("fold", "cancel")


def _known(name: str) -> tuple[str, tuple[str, ...]]:
    if name not in PASSES:
        raise FlashNormError(f"unknown pass {name!r}; available: {', '.join(PASSES)}")
    return PASSES[name]


def get_pass(name: str) -> Callable[..., tuple[gs.Graph, PassReport]]:
    module_name = f"flashnorm.passes.{_known(name)[0]}"
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
        _known(name)
    return list(names)


def run_passes(graph: gs.Graph, names: Sequence[str], *, untie: bool = False,
               quant_limit: Optional[float] = None,
               for_quantization: Optional[str] = None) -> tuple[gs.Graph, list[PassReport]]:
    """Apply the named passes in order, each with the options it takes (`untie`, `quant_limit`:
    fold, None: `flashnorm.passes.quantized.DEFAULT_QUANT_LIMIT`; `for_quantization`: fold).
    An option given to passes none of which takes it, a negative or NaN `quant_limit`, or an
    unknown format is one line (FlashNormError) before any pass runs. Missing element types (the
    legacy torch exporter writes none) are inferred first: passes that build new nodes need them."""
    from flashnorm.match.shapes import annotate_types

    from flashnorm.passes.quantized import DEFAULT_QUANT_LIMIT

    names = parse_pass_names(names)
    _check_options(names, untie, quant_limit, for_quantization)
    options = {"untie": untie, "quant_limit": DEFAULT_QUANT_LIMIT if quant_limit is None else quant_limit,
               "for_quantization": for_quantization}
    passes = [(get_pass(name), PASSES[name][1]) for name in names]
    annotate_types(graph)
    reports = []
    for function, takes in passes:
        graph, report = function(graph, **{option: options[option] for option in takes})
        graph.cleanup().toposort()
        reports.append(report)
    return graph, reports


def _check_options(names: Sequence[str], untie: bool, quant_limit: Optional[float],
                   for_quantization: Optional[str]) -> None:
    """One line for options that cannot do what they say: one that none of the chosen passes
    takes (it would do nothing), a negative or NaN quant limit, an unknown format."""
    from flashnorm.quantization_aware import rule

    given = {"untie": untie, "quant_limit": quant_limit is not None, "for_quantization": for_quantization is not None}
    taken = {option for name in names for option in PASSES[name][1]}
    for option, is_given in given.items():
        if is_given and option not in taken:
            takers = " or ".join(name for name, (_, options) in PASSES.items() if option in options)
            raise FlashNormError(f"--{option.replace('_', '-')} is an option of the {takers} pass; "
                                 f"--passes {','.join(names)} does not run it")
    if quant_limit is not None and not quant_limit >= 0:
        raise FlashNormError(f"--quant-limit must be at least 0, got {quant_limit}")
    rule(for_quantization)


def _check_writable(destination: Path) -> None:
    """Fail before any work if `destination`'s folder takes no new file: a real probe, since
    permission bits say nothing about /proc, read-only mounts or full disks."""
    directory = destination.parent if str(destination.parent) else Path(".")
    if not directory.is_dir():
        raise FlashNormError(f"cannot write {destination}: directory {directory} does not exist")
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=f".{destination.name}.", suffix=".probe"):
            pass
    except OSError as exc:
        raise FlashNormError(f"cannot write {destination}: {exc.strerror or exc}") from None


def optimize_file(
    in_path: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    passes: str | Sequence[str] = DEFAULT_PASSES,
    untie: bool = False,
    *,
    external_data: Optional[bool] = None,
    quant_limit: Optional[float] = None,
    for_quantization: Optional[str] = None,
) -> dict[str, Any]:
    """Load `in_path`, run `passes`, save to `out_path` (atomically; the input is never
    written). Raises FlashNormError for bad input: unknown pass, an option none of `passes`
    takes, unreadable or invalid model, no norm found, unwritable output."""
    from flashnorm import modelio
    from flashnorm.match import find_norm_candidates

    names = parse_pass_names(passes)
    _check_options(names, untie, quant_limit, for_quantization)
    source, destination = Path(in_path), Path(out_path)
    require_file("model", source)
    if destination.exists() and destination.resolve() == source.resolve():
        raise FlashNormError(f"output {destination} is the input; FlashNorm never overwrites its input")
    _check_writable(destination)
    graph = modelio.load(source)
    found = find_norm_candidates(graph)
    if not found.sites:
        why = f" ({len(found.rejected)} near-misses: {found.rejected[0].reason})" if found.rejected else ""
        raise FlashNormError(f"no RMSNorm or LayerNorm found in {source}{why}")
    graph, reports = run_passes(graph, names, untie=untie, quant_limit=quant_limit, for_quantization=for_quantization)
    modelio.save(graph, destination, external_data=external_data)
    summary: dict[str, int] = {}
    for report in reports:
        for action, count in report.to_dict()["counts"].items():
            summary[f"{report.name}.{action}"] = count
    return {
        "input": str(source),
        "output": str(destination),
        "passes": names,
        "untie": untie,
        **({"quant_limit": quant_limit} if quant_limit is not None else {}),
        **({"for_quantization": for_quantization} if for_quantization else {}),
        "norm_sites": len(found.sites),
        "summary": summary,
        "reports": [r.to_dict() for r in reports],
    }
