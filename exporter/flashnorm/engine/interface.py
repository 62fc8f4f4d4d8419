"""An engine's inputs and outputs, read from the engine itself: each I/O tensor's name, TensorRT
data type and shape (-1 for a variable dimension), and the ranges of optimization profile 0
(the one a server uses unless told otherwise). What `serve` declares for a `.plan` comes from here.

Needs `tensorrt` and the plugin libraries the engine was built with (loaded before it is
deserialized); without `tensorrt`, `TensorRTMissing`.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
from pathlib import Path
from typing import Iterable, Mapping

from flashnorm.engine.shapes import ShapeRange
from flashnorm.errors import FlashNormError


class TensorRTMissing(FlashNormError):
    """`tensorrt` is not importable, so an engine cannot be read here."""


@dataclasses.dataclass(frozen=True)
class EngineTensor:
    """One I/O tensor of an engine: its name, TensorRT data type name (`FLOAT`, `HALF`, `BF16`,
    `INT32`, ...), full shape (-1 = variable) and direction."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    is_input: bool


@dataclasses.dataclass(frozen=True)
class EngineInterface:
    """An engine's I/O tensors in the engine's order and, for each input with a variable
    dimension, its range in optimization profile 0 (input name → range)."""

    tensors: tuple[EngineTensor, ...]
    profile: Mapping[str, ShapeRange] = dataclasses.field(default_factory=dict)

    @property
    def inputs(self) -> tuple[EngineTensor, ...]:
        return tuple(tensor for tensor in self.tensors if tensor.is_input)

    @property
    def outputs(self) -> tuple[EngineTensor, ...]:
        return tuple(tensor for tensor in self.tensors if not tensor.is_input)


def read_interface(
    plan_path: str | os.PathLike[str], plugin_paths: Iterable[str | os.PathLike[str]] = ()
) -> EngineInterface:
    """Deserialize a TensorRT engine (plugins loaded first) and read its I/O tensors and the shape
    ranges of its optimization profile 0."""
    try:
        import tensorrt as trt
    except ImportError:
        raise TensorRTMissing("reading inputs and outputs from a .plan needs TensorRT, which is not importable here") from None
    for plugin in plugin_paths:
        # The plugin registers its creator when loaded (REGISTER_TENSORRT_PLUGIN), which is
        # also how Triton loads it; RTLD_GLOBAL lets TensorRT find the symbols.
        ctypes.CDLL(os.fspath(plugin), mode=ctypes.RTLD_GLOBAL)
    logger = trt.Logger(trt.Logger.ERROR)
    runtime = trt.Runtime(logger)
    engine = runtime.deserialize_cuda_engine(Path(plan_path).read_bytes())
    if engine is None:
        raise FlashNormError(
            f"TensorRT could not deserialize {plan_path} (wrong TensorRT version, or a plugin missing?)"
        )
    tensors: list[EngineTensor] = []
    profile: dict[str, ShapeRange] = {}
    for index in range(engine.num_io_tensors):
        name = engine.get_tensor_name(index)
        is_input = engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
        tensor = EngineTensor(name, engine.get_tensor_dtype(name).name, tuple(engine.get_tensor_shape(name)), is_input)
        tensors.append(tensor)
        if is_input and -1 in tensor.shape and engine.num_optimization_profiles > 0:
            minimum, optimum, maximum = (tuple(shape) for shape in engine.get_tensor_profile_shape(name, 0))
            profile[name] = ShapeRange(minimum, optimum, maximum)
    return EngineInterface(tuple(tensors), profile)
