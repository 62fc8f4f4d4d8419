"""SIGINT and SIGTERM stop every command cleanly: each raises an exception in the main thread
(`KeyboardInterrupt` for SIGINT, its subclass `Terminated` for SIGTERM), so every staged write
and temporary folder is removed by the `except`/`finally` blocks already guarding it, and the
CLI exits 130 or 143 with one line. Native work that cannot be interrupted mid-call (a TensorRT
engine build) polls `stop_requested()` from its progress callbacks and cancels itself."""

from __future__ import annotations

import contextlib
import signal
from typing import Iterator

_received: list[int] = []


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived: stop as for Ctrl-C, with exit status 143."""


def stop_requested() -> bool:
    """Whether SIGINT or SIGTERM arrived since `handling_stops` began."""
    return bool(_received)


def exit_status() -> int:
    """128 + the number of the first stopping signal received (130 for SIGINT, 143 for SIGTERM)."""
    return 128 + (_received[0] if _received else signal.SIGINT)


def raise_stop() -> None:
    """Raise the exception of the first stopping signal received (for code that saw
    `stop_requested()` after native work returned)."""
    raise Terminated() if _received and _received[0] == signal.SIGTERM else KeyboardInterrupt()


def _handle(signum: int, frame: object) -> None:
    _received.append(signum)
    raise_stop()


@contextlib.contextmanager
def handling_stops() -> Iterator[None]:
    """Within the block, SIGINT and SIGTERM raise in the main thread (see the module docstring);
    the previous handlers come back after it."""
    _received.clear()
    previous = {sig: signal.signal(sig, _handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
