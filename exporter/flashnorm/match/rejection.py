"""Why a structure that looked like an RMSNorm was not accepted as one."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class RejectedCandidate:
    """A near-miss: reported by `flashnorm inspect`, never touched by a pass."""

    name: str
    """The node (or output tensor) where the candidate was found."""

    spelling: str
    reason: str


class Rejected(Exception):
    """Raised inside a matcher to abandon a candidate with a reason."""
