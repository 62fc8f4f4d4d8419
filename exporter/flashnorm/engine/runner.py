"""TensorRT as a runner for `flashnorm.validate.compare_models`: the candidate ONNX file is
built into an engine in memory (or a prebuilt engine file is loaded) and run by Polygraphy's
TrtRunner against the ONNX Runtime reference."""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Optional, Sequence

from flashnorm.engine.build import BuildOptions, build_serialized_engine, deserialize_engine
from flashnorm.engine.loader import import_tensorrt, load_plugins
from flashnorm.engine.shapes import ShapeRange

RunnerFactory = Callable[[str, str], Any]
"""(model path, runner name) → a Polygraphy runner, as in flashnorm.validate.runners."""


def trt_runner_factory(
    *,
    plugins: Sequence[str | os.PathLike[str]] = (),
    shapes: Optional[Mapping[str, ShapeRange]] = None,
    engine_path: Optional[str | os.PathLike[str]] = None,
    timing_cache: Optional[str | os.PathLike[str]] = None,
) -> RunnerFactory:
    """A factory of Polygraphy TrtRunners. With `engine_path` the runner loads that engine
    (the model path only names the ONNX file the comparison reads its signature from);
    otherwise it builds the model with `plugins` and a profile from `shapes`. TensorRT is
    imported (and its absence reported) when the factory is called, not when it is made."""

    def build(model_path: str, name: str):
        trt = import_tensorrt()
        from polygraphy.backend.trt import TrtRunner

        load_plugins(trt, plugins)

        def engine():
            if engine_path is not None:
                return deserialize_engine(engine_path, plugins)
            plan, _ = build_serialized_engine(
                model_path, BuildOptions(plugins=plugins, shapes=dict(shapes or {}), timing_cache=timing_cache)
            )
            runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
            return runtime.deserialize_cuda_engine(plan)

        return TrtRunner(engine, name=name)

    return build
