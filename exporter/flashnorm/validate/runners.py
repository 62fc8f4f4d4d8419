"""Runners: what executes a model during a comparison.

A runner factory takes `(model_path, runner_name)` and returns a Polygraphy runner. ONNX
Runtime is the reference backend here; another backend (TensorRT) plugs in as one more
factory without touching the comparison. onnxruntime and polygraphy's backends are imported
only when a runner is built.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

from flashnorm.errors import FlashNormError

RunnerFactory = Callable[[str, str], Any]
"""(model path, runner name) → a Polygraphy runner (an object with activate/infer/deactivate)."""

OPTIMIZATION_LEVELS = ("disable", "basic", "extended", "all")


def session_options(optimization_level: str = "all") -> Any:
    """ONNX Runtime session options at one of OPTIMIZATION_LEVELS (FlashNormError for another)."""
    import onnxruntime as ort

    if optimization_level not in OPTIMIZATION_LEVELS:
        raise FlashNormError(f"unknown optimization level {optimization_level!r}; choose from {OPTIMIZATION_LEVELS}")
    options = ort.SessionOptions()
    options.graph_optimization_level = {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }[optimization_level]
    return options


def make_session(
    model_path: str | os.PathLike[str],
    *,
    providers: Sequence[str] = ("CPUExecutionProvider",),
    optimization_level: str = "all",
    threads: int | None = None,
):
    """An ONNX Runtime session for `model_path` (external data is read beside the file). ONNX
    Runtime opens the model and its data by name: our reader checks them first (inside the
    model's folder, regular files, every tensor's bytes there), and the session is refused if any
    of them changed while ONNX Runtime read them (docs/SECURITY.md)."""
    import onnxruntime as ort

    from flashnorm.modelio import unchanged_model

    available = ort.get_available_providers()
    missing = [p for p in providers if p not in available]
    if missing:
        raise FlashNormError(f"requested ONNX Runtime provider(s) {missing}; available: {available}")
    options = session_options(optimization_level)
    if threads:
        options.intra_op_num_threads = threads
    read = unchanged_model(model_path)
    try:
        session = ort.InferenceSession(os.fspath(model_path), sess_options=options, providers=list(providers))
    except Exception as exc:  # onnxruntime raises its own unexported exception types
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise FlashNormError(f"ONNX Runtime cannot load {model_path}: {first_line[:300]}") from None
    read.check()
    return session


def onnxrt_runner_factory(
    *, providers: Sequence[str] = ("CPUExecutionProvider",), optimization_level: str = "all"
) -> RunnerFactory:
    """A factory of Polygraphy ONNX Runtime runners with these session settings."""

    def build(model_path: str, name: str):
        from polygraphy.backend.onnxrt import OnnxrtRunner

        # A callable: the session is created when the runner activates, and freed after.
        return OnnxrtRunner(
            lambda: make_session(model_path, providers=providers, optimization_level=optimization_level),
            name=name,
        )

    return build


def raise_run_failure(error: Exception, what: str) -> None:
    """Re-raise an error ONNX Runtime, Polygraphy or TensorRT raised while `what` ran (a model
    that cannot run on these inputs: too long for it, out of memory, a bad feed) as one line;
    return for anything else (not theirs: a bug the caller lets through)."""
    module = type(error).__module__ or ""
    if module.split(".")[0] in ("onnxruntime", "polygraphy", "tensorrt", "tensorrt_rtx"):
        lines = str(error).strip().splitlines()
        reason = lines[0][:300] if lines else type(error).__name__
        raise FlashNormError(f"{what} failed while running: {reason}") from None
