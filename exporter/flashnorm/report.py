"""Machine-readable reports: every pass and every command returns one."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Iterable

from flashnorm.files import atomic_write


@dataclasses.dataclass
class SiteDecision:
    """What a pass did at one norm site, and why."""

    site: str
    action: str  # e.g. "folded", "skipped", "cancelled", "deferred"
    reason: str = ""
    details: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class PassReport:
    """The result of one pass: graph in, graph + this report out."""

    name: str
    decisions: list[SiteDecision] = dataclasses.field(default_factory=list)

    def add(self, site: str, action: str, reason: str = "", **details: Any) -> None:
        self.decisions.append(SiteDecision(site, action, reason, details))

    def count(self, action: str) -> int:
        return sum(1 for d in self.decisions if d.action == action)

    def to_dict(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for decision in self.decisions:
            counts[decision.action] = counts.get(decision.action, 0) + 1
        return {
            "pass": self.name,
            "counts": counts,
            "sites": [dataclasses.asdict(d) for d in self.decisions],
        }


def grouped_reasons(decisions: Iterable[tuple[str, str]]) -> list[tuple[str, list[str]]]:
    """(reason, sites) for (site, reason) pairs whose reasons differ only in the names they
    quote: each reason once, names elided where its sites disagree, in order of first sight."""
    groups: dict[str, tuple[list[str], list[str]]] = {}
    for site, reason in decisions:
        reasons, sites = groups.setdefault(re.sub(r"'[^']*'", "'…'", reason), ([], []))
        reasons.append(reason)
        sites.append(site)
    return [(reasons[0] if len(set(reasons)) == 1 else key, sites) for key, (reasons, sites) in groups.items()]


def to_jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_jsonable(dataclasses.asdict(value))
    if hasattr(value, "to_dict"):
        return to_jsonable(value.to_dict())
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return value.item()
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return value


def write_json_report(path: str | os.PathLike[str], report: Any) -> None:
    """Write a report as JSON, atomically (a failure never leaves half a file)."""
    text = json.dumps(to_jsonable(report), indent=2, sort_keys=False) + "\n"
    with atomic_write(path, "w") as handle:
        handle.write(text)
