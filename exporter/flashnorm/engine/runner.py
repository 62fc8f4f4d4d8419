"""TensorRT as a runner for `flashnorm.validate.compare_models`: the candidate ONNX file is
built into an engine in memory (or a prebuilt engine file is loaded) and run by Polygraphy's
TrtRunner against the ONNX Runtime reference. With TensorRT-RTX, Polygraphy is switched to it
(its POLYGRAPHY_USE_TENSORRT_RTX setting) before its TensorRT backend is imported."""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Mapping, Optional, Sequence

from flashnorm.engine.build import BuildOptions, build_serialized_engine, load_engine, select_backend
from flashnorm.engine.loader import Backend, load_plugins
from flashnorm.engine.shapes import ShapeRange
from flashnorm.errors import FlashNormError, NotCompared, require_file
from flashnorm.progress import Progress

RunnerFactory = Callable[[str, str], Any]
"""(model path, runner name) → a Polygraphy runner, as in flashnorm.validate.runners."""


def _polygraphy_trt_runner(backend: Backend) -> Any:
    """Polygraphy's TrtRunner, importing Polygraphy's TensorRT backend for `backend`."""
    from polygraphy import config

    wanted = backend.name == "tensorrt-rtx"
    if config.USE_TENSORRT_RTX != wanted:
        if "polygraphy.backend.trt" in sys.modules:
            raise FlashNormError(f"Polygraphy's TensorRT backend is already imported for the other TensorRT in this "
                                 f"process; cannot run {backend.describe()} here")
        config.USE_TENSORRT_RTX = wanted
        os.environ["POLYGRAPHY_USE_TENSORRT_RTX"] = "1" if wanted else "0"
    from polygraphy.backend.trt import TrtRunner

    return TrtRunner


def trt_runner_factory(
    *,
    backend: str = "auto",
    plugins: Sequence[str | os.PathLike[str]] = (),
    shapes: Optional[Mapping[str, ShapeRange]] = None,
    engine_path: Optional[str | os.PathLike[str]] = None,
    timing_cache: Optional[str | os.PathLike[str]] = None,
) -> RunnerFactory:
    """A factory of Polygraphy TrtRunners. With `engine_path` the runner loads that engine
    (the model path only names the ONNX file the comparison reads its signature from);
    otherwise it builds the model with `plugins` and a profile from `shapes`. The engine is
    built and loaded when the factory is called, before anything runs: a machine that cannot
    run it raises NotCompared (after the build was checked), a missing TensorRT FlashNormError."""

    def build(model_path: str, name: str):
        chosen = select_backend(backend, plugins)
        trt = chosen.module
        load_plugins(trt, plugins)
        if engine_path is not None:
            plan = require_file("engine", engine_path).read_bytes()
            built = f"engine {engine_path}"
        else:
            plan, report = build_serialized_engine(model_path, BuildOptions(
                backend=backend, plugins=plugins, shapes=dict(shapes or {}), timing_cache=timing_cache,
                progress=Progress.enabled, inspect=False))  # the engine is loaded right below
            built = f"{chosen.describe()} built the engine ({report['engine_bytes'] / 2**20:.1f} MiB, 0 parser errors)"
        engine, why = load_engine(trt, plan)
        if engine is None:
            raise NotCompared(f"{built}, but {chosen.describe()} cannot run it here: {why}")
        return _polygraphy_trt_runner(chosen)(engine, name=name)

    return build
