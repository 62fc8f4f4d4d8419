"""SIGINT and SIGTERM stop every command cleanly: each raises an exception in the main thread
(`KeyboardInterrupt` for SIGINT, its subclass `Terminated` for SIGTERM), so every staged write
and temporary folder is removed by the `except`/`finally` blocks already guarding it, and the
CLI exits 130 or 143 with one line. Native work that cannot be interrupted mid-call (TensorRT's
parser and builder: one step of a build runs for seconds) goes through `run_stoppable`: it runs
in a worker thread while the main thread waits, so a signal stops the command at once; the
worker is abandoned (the build's progress monitor cancels it at its next step, and the CLI
leaves the process without waiting for it)."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Callable, Iterator, TypeVar

_received: list[int] = []
_abandoned: list[tuple[threading.Event, tuple[Any, ...]]] = []
"""Workers left running by a stop, with what they keep alive."""
_WAIT_SECONDS = 0.05
"""How often the main thread wakes while native work runs (the signal handler runs between)."""

T = TypeVar("T")


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


def run_stoppable(function: Callable[..., T], *args: Any, keep: tuple[Any, ...] = ()) -> T:
    """`function(*args)` in a worker thread, its result or its exception returned or raised here.
    A signal's exception, raised in the main thread while it waits, leaves the worker behind: it
    must touch no file (its caller writes what it returns) and should stop by itself soon (a
    build's monitor cancels it). `keep`: objects native code holds pointers to without owning
    them (TensorRT's logger, builder, monitor), alive as long as the worker runs, not only as long
    as the caller's frame. For native calls that release the GIL (TensorRT's do)."""
    outcome: dict[str, Any] = {}
    finished = threading.Event()

    def work() -> None:
        try:
            outcome["value"] = function(*args)
        except BaseException as exc:  # handed to the waiting thread
            outcome["error"] = exc
        finally:
            finished.set()

    worker = threading.Thread(target=work, name=f"flashnorm-{getattr(function, '__name__', 'work')}", daemon=True)
    worker.start()
    try:
        # An Event, not Thread.join: a join interrupted by a signal marks the thread stopped
        # (CPython 3.11's bpo-45274 handling releases the running thread's lock).
        while not finished.wait(_WAIT_SECONDS):
            pass
    except BaseException:
        _abandoned.append((finished, keep))
        raise
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def abandoned_work() -> bool:
    """Whether a `run_stoppable` worker left behind by a stop is still running (the CLI then
    exits at once: the interpreter's normal exit would run its cleanup beside native code)."""
    _abandoned[:] = [(finished, keep) for finished, keep in _abandoned if not finished.is_set()]
    return bool(_abandoned)
