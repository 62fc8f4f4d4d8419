"""TensorRT build progress on stderr, through IProgressMonitor (TensorRT ≥ 10.0)."""

from __future__ import annotations

import sys
import time
from typing import Any, Optional


def make_progress_monitor(trt: Any, enabled: bool = True) -> Optional[Any]:
    """An IProgressMonitor that prints each top-level phase and its step counts at most once a
    second, or None where the bindings lack the interface (or when disabled)."""
    base = getattr(trt, "IProgressMonitor", None)
    if base is None or not enabled:
        return None

    class StderrProgressMonitor(base):
        def __init__(self) -> None:
            base.__init__(self)
            self._steps: dict[str, int] = {}
            self._parents: dict[str, Optional[str]] = {}
            self._start = time.monotonic()
            self._last = 0.0

        def _print(self, text: str) -> None:
            print(f"flashnorm build: {text} ({time.monotonic() - self._start:.1f} s)", file=sys.stderr, flush=True)

        def phase_start(self, phase_name, parent_phase, num_steps):
            self._steps[phase_name] = num_steps
            self._parents[phase_name] = parent_phase
            if parent_phase is None:
                self._print(f"{phase_name}: started")

        def step_complete(self, phase_name, step):
            now = time.monotonic()
            if self._parents.get(phase_name) is None and now - self._last >= 1.0:
                self._last = now
                self._print(f"{phase_name}: {step + 1}/{self._steps.get(phase_name, '?')}")
            return True  # never cancel the build

        def phase_finish(self, phase_name):
            if self._parents.pop(phase_name, None) is None:
                self._print(f"{phase_name}: done")
            self._steps.pop(phase_name, None)

    return StderrProgressMonitor()
