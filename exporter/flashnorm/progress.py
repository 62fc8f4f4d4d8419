"""Progress for long work, on stderr so that stdout stays the report."""

from __future__ import annotations

import sys
import time
from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")


class Progress:
    """Prints `label: i/n (elapsed)` at most every `interval` seconds, and a final line."""

    enabled = True

    def __init__(self, label: str, total: int | None = None, interval: float = 1.0) -> None:
        self.label, self.total, self.interval = label, total, interval
        self.start = self._last = time.monotonic()
        self.done = 0

    def step(self, amount: int = 1) -> None:
        self.done += amount
        now = time.monotonic()
        if self.enabled and now - self._last >= self.interval:
            self._last = now
            self._print(now)

    def finish(self) -> None:
        if self.enabled:
            self._print(time.monotonic())

    def _print(self, now: float) -> None:
        of = f"/{self.total}" if self.total is not None else ""
        print(f"{self.label}: {self.done}{of} ({now - self.start:.1f} s)", file=sys.stderr, flush=True)


def track(items: Iterable[T], label: str, total: int | None = None) -> Iterator[T]:
    progress = Progress(label, total)
    for item in items:
        yield item
        progress.step()
    progress.finish()
