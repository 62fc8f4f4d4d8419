"""TensorRT build progress through IProgressMonitor (TensorRT ≥ 10.0), shown by
`flashnorm.progress`: a bar per top-level build phase on a terminal, plain lines in a log."""

from __future__ import annotations

from typing import Any, Optional

from flashnorm.progress import Progress


def make_progress_monitor(trt: Any, enabled: bool = True) -> Optional[Any]:
    """An IProgressMonitor that shows each top-level phase and its steps, or None where the
    bindings lack the interface (or when disabled)."""
    base = getattr(trt, "IProgressMonitor", None)
    if base is None or not enabled:
        return None

    class BuildProgressMonitor(base):
        def __init__(self) -> None:
            base.__init__(self)
            self._phases: dict[str, Progress] = {}

        def phase_start(self, phase_name, parent_phase, num_steps):
            if parent_phase is None:
                self._phases[phase_name] = Progress(f"flashnorm build: {phase_name}", total=num_steps)

        def step_complete(self, phase_name, step):
            progress = self._phases.get(phase_name)
            if progress is not None:
                progress.step(step + 1 - progress.done)
            return True  # never cancel the build

        def phase_finish(self, phase_name):
            progress = self._phases.pop(phase_name, None)
            if progress is not None:
                progress.finish()

    return BuildProgressMonitor()
