"""TensorRT: build engines from FlashNorm ONNX files with the FlashNormMatMul plugin, load
them, and run them under Polygraphy for comparisons.

Importing this package never imports `tensorrt`; each function that needs it imports it and
raises FlashNormError with what to install where it is missing.
"""

from flashnorm.engine.build import BuildOptions, build_engine_file, build_serialized_engine, deserialize_engine
from flashnorm.engine.loader import TENSORRT_MISSING, import_tensorrt, load_plugins
from flashnorm.engine.runner import trt_runner_factory
from flashnorm.engine.shapes import ShapeRange, parse_shape, parse_shape_spec, shape_ranges_from_feeds

__all__ = [
    "BuildOptions", "ShapeRange", "TENSORRT_MISSING", "build_engine_file", "build_serialized_engine",
    "deserialize_engine", "import_tensorrt", "load_plugins", "parse_shape", "parse_shape_spec",
    "shape_ranges_from_feeds", "trt_runner_factory",
]
