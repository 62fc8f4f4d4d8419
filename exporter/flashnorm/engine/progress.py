"""TensorRT build progress through IProgressMonitor (TensorRT ≥ 10.0), shown by
`flashnorm.progress` (a bar per top-level build phase on a terminal, plain lines in a log), and
the way a build stops: TensorRT runs the build in native code and swallows exceptions raised in
its callbacks, so Ctrl-C or SIGTERM cancels the build by the monitor returning False at the next
step (`flashnorm.signals`)."""

from __future__ import annotations

from typing import Any, Optional

from flashnorm import signals
from flashnorm.progress import Progress


def make_progress_monitor(trt: Any, enabled: bool = True) -> Optional[Any]:
    """An IProgressMonitor that cancels the build once SIGINT or SIGTERM arrived and, when
    `enabled`, shows each top-level phase and its steps; None where the bindings lack the
    interface."""
    base = getattr(trt, "IProgressMonitor", None)
    if base is None:
        return None

    class BuildProgressMonitor(base):
        def __init__(self) -> None:
            base.__init__(self)
            self._phases: dict[str, Progress] = {}

        def phase_start(self, phase_name, parent_phase, num_steps):
            try:
                if enabled and parent_phase is None:
                    self._phases[phase_name] = Progress(f"flashnorm build: {phase_name}", total=num_steps)
            except KeyboardInterrupt:  # the signal handler ran here: the next step cancels
                pass

        def step_complete(self, phase_name, step):
            try:
                progress = self._phases.get(phase_name)
                if progress is not None:
                    progress.step(step + 1 - progress.done)
            except KeyboardInterrupt:
                pass
            return not signals.stop_requested()

        def phase_finish(self, phase_name):
            try:
                progress = self._phases.pop(phase_name, None)
                if progress is not None:
                    progress.finish()
            except KeyboardInterrupt:
                pass

    return BuildProgressMonitor()
