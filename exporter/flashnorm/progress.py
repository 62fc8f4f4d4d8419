"""Progress for long work (loading and saving models, passes, exports, engine builds), on stderr
so that stdout stays the report.

On a terminal a live tqdm bar; in a log (stderr not a terminal) a plain `label: i/n (elapsed)`
line at most every `interval` seconds and a final one; nothing at all once `Progress.enabled`
is False (the CLI's -q).
"""

from __future__ import annotations

import sys
import time
from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")
_MIB = 1 << 20


def _terminal() -> bool:
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


class Progress:
    """Progress of `total` steps (None: unknown) of `unit`. A bar appears only for work that
    lasts longer than `interval` seconds."""

    enabled = True

    def __init__(self, label: str, total: int | None = None, interval: float = 1.0, unit: str = "it") -> None:
        self.label, self.total, self.interval = label, total, interval
        self.start = self._last = time.monotonic()
        self.done = 0
        self._bar = None
        if self.enabled and _terminal():
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=label, unit=unit, file=sys.stderr, delay=interval,
                             unit_scale=unit == "B", unit_divisor=1024, dynamic_ncols=True)

    def step(self, amount: int = 1) -> None:
        self.done += amount
        if self._bar is not None:
            self._bar.update(amount)
            return
        now = time.monotonic()
        if self.enabled and now - self._last >= self.interval:
            self._last = now
            self._print(now)

    def finish(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled:
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


class ByteProgress(Progress):
    """Progress of a byte count: a bar in bytes on a terminal, lines in MiB in a log; the final
    line only for work long enough to have shown progress."""

    def __init__(self, label: str, total_bytes: int) -> None:
        super().__init__(label, total_bytes, unit="B")
        self._log_label = f"{label} (MiB)"

    def finish(self) -> None:
        if self._bar is not None or time.monotonic() - self.start >= self.interval:
            super().finish()

    def _print(self, now: float) -> None:
        print(f"{self._log_label}: {self.done // _MIB}/{-(-self.total // _MIB)} ({now - self.start:.1f} s)",
              file=sys.stderr, flush=True)
