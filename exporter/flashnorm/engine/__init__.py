"""TensorRT: build engines from FlashNorm ONNX files (TensorRT with the FlashNormMatMul plugin,
or TensorRT-RTX from the nodes' reference functions), load them, and run them under Polygraphy
for comparisons; read an engine's inputs and outputs (`read_interface`).

Importing this package never imports `tensorrt` or `tensorrt_rtx`; each function that needs it imports it and
raises FlashNormError with what to install where it is missing.
"""

from flashnorm.engine.build import (
    BuildOptions, build_engine_file, build_serialized_engine, deserialize_engine, select_backend,
)
from flashnorm.engine.interface import EngineInterface, EngineTensor, TensorRTMissing, read_interface
from flashnorm.engine.loader import BACKENDS, TENSORRT_MISSING, TENSORRT_RTX_MISSING, Backend, import_backend, load_plugins
from flashnorm.engine.runner import trt_runner_factory
from flashnorm.engine.shapes import ShapeRange, parse_shape, parse_shape_spec, shape_ranges_from_feeds

__all__ = [
    "BACKENDS", "Backend", "BuildOptions", "EngineInterface", "EngineTensor", "ShapeRange", "TENSORRT_MISSING",
    "TENSORRT_RTX_MISSING", "TensorRTMissing",
    "build_engine_file", "build_serialized_engine", "deserialize_engine", "import_backend", "load_plugins",
    "select_backend", "parse_shape", "parse_shape_spec", "read_interface",
    "shape_ranges_from_feeds", "trt_runner_factory",
]
