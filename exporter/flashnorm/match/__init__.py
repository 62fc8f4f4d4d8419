"""Find every RMSNorm and LayerNorm in a graph, whatever spelling the exporter used.

One module per spelling family (`decomposed`, `fused`), each returning the same `NormSite`
(its `kind` 'rms' or 'layer'); every site is accepted only after `selfcheck` has run its nodes
on random inputs.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import onnx_graphsurgeon as gs

from flashnorm.match import decomposed, fused
from flashnorm.match.rejection import Rejected, RejectedCandidate
from flashnorm.match.selfcheck import self_check
from flashnorm.match.site import NormSite

__all__ = ["MatchResult", "NormSite", "RejectedCandidate", "find_norm_candidates", "find_norm_sites"]


@dataclasses.dataclass
class MatchResult:
    sites: list[NormSite]
    rejected: list[RejectedCandidate]


def find_norm_candidates(graph: gs.Graph, rng: Optional[np.random.Generator] = None) -> MatchResult:
    """Every accepted norm site (graph order) and every near-miss with the reason."""
    graph_outputs = frozenset(t.name for t in graph.outputs)
    sites: list[NormSite] = []
    rejected: list[RejectedCandidate] = []
    claimed: set[int] = set()
    for node in graph.nodes:
        if id(node) in claimed:
            continue
        if decomposed.is_candidate(node):
            family, spelling = decomposed, decomposed.SPELLING
        elif fused.is_candidate(node):
            family, spelling = fused, node.op
        else:
            continue
        try:
            site = family.match(node, graph_outputs)
            self_check(site, graph.opset, rng)
        except Rejected as exc:
            rejected.append(RejectedCandidate(node.name or node.outputs[0].name, spelling, str(exc)))
            continue
        except (KeyError, IndexError, TypeError, ValueError) as exc:  # a malformed node: skip it, say so
            rejected.append(RejectedCandidate(node.name or node.outputs[0].name, spelling,
                                              f"could not read the candidate: {exc!r}"))
            continue
        claimed.update(id(n) for n in site.nodes)
        sites.append(site)
    return MatchResult(sites, rejected)


def find_norm_sites(graph: gs.Graph) -> list[NormSite]:
    """Every RMSNorm and LayerNorm site in `graph`, each verified numerically."""
    return find_norm_candidates(graph).sites
