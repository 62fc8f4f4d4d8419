"""Build a TensorRT engine from a FlashNorm ONNX file.

A strongly typed network (the plugin receives exactly the ONNX tensor types; TensorRT 11 has
no other kind), the ONNX parser's plugin override on where it exists (TensorRT ≥ 10.15; the
node's `plugin_namespace` attribute already selects the plugin there), one optimization
profile from the given min/opt/max shapes, an optional timing cache, progress on stderr.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import onnx

from flashnorm.engine.loader import import_tensorrt, load_plugins, tensorrt_version
from flashnorm.engine.progress import make_progress_monitor
from flashnorm.engine.shapes import ShapeRange
from flashnorm.errors import FlashNormError
from flashnorm.io import atomic_write


@dataclasses.dataclass
class BuildOptions:
    plugins: Sequence[str | os.PathLike[str]] = ()
    shapes: Mapping[str, ShapeRange] = dataclasses.field(default_factory=dict)
    timing_cache: Optional[str | os.PathLike[str]] = None
    workspace_bytes: Optional[int] = None
    progress: bool = True
    verbose: bool = False


def flashnorm_node_names(onnx_path: str | os.PathLike[str]) -> list[str]:
    """Names of the FlashNormMatMul nodes of a model (read without its weights)."""
    model = onnx.load(os.fspath(onnx_path), load_external_data=False)
    return [n.name for n in model.graph.node if n.op_type == "FlashNormMatMul" and n.domain == "flashnorm"]


def _parse_network(trt: Any, builder: Any, logger: Any, onnx_path: Path) -> tuple[Any, Any]:
    flags = 0
    strongly_typed = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    if strongly_typed is not None:
        flags |= 1 << int(strongly_typed)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    override = getattr(getattr(trt, "OnnxParserFlag", None), "ENABLE_PLUGIN_OVERRIDE", None)
    if override is not None:
        parser.set_flag(override)
    if not parser.parse_from_file(os.fspath(onnx_path)):
        errors = [parser.get_error(i).desc() for i in range(parser.num_errors)]
        first = errors[0] if errors else "no error message"
        raise FlashNormError(f"TensorRT's ONNX parser rejected {onnx_path}: {first}"
                             + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""))
    return network, parser


def _profile(trt: Any, builder: Any, network: Any, shapes: Mapping[str, ShapeRange]) -> tuple[Optional[Any], dict]:
    inputs = {network.get_input(i).name: tuple(network.get_input(i).shape) for i in range(network.num_inputs)}
    unknown = sorted(set(shapes) - set(inputs))
    if unknown:
        raise FlashNormError(f"--shapes names unknown input(s) {unknown}; the network's inputs: {sorted(inputs)}")
    dynamic = {name: shape for name, shape in inputs.items() if any(d < 0 for d in shape)}
    missing = sorted(set(dynamic) - set(shapes))
    if missing:
        described = ", ".join(f"{n}{list(dynamic[n])}" for n in missing)
        raise FlashNormError(f"dynamic input(s) {described} need --shapes NAME:MIN,OPT,MAX (e.g. {missing[0]}:"
                             + ",".join("x".join("1" if d < 0 else str(d) for d in dynamic[missing[0]]) for _ in range(3))
                             + ")")
    if not shapes:
        return None, {}
    profile = builder.create_optimization_profile()
    used = {}
    for name, shape_range in shapes.items():
        declared = inputs[name]
        if len(declared) != len(shape_range.minimum) or any(
            d >= 0 and not (lo == d == hi) for d, lo, hi in zip(declared, shape_range.minimum, shape_range.maximum)
        ):
            raise FlashNormError(f"--shapes {name}:{shape_range.describe()} does not fit the input's shape {list(declared)}")
        profile.set_shape(name, shape_range.minimum, shape_range.optimum, shape_range.maximum)
        used[name] = shape_range.describe()
    return profile, used


def _plugin_layers(trt: Any, network: Any) -> list[str]:
    kind = getattr(trt.LayerType, "PLUGIN_V3", None)
    return [network.get_layer(i).name for i in range(network.num_layers) if network.get_layer(i).type == kind]


def build_serialized_engine(onnx_path: str | os.PathLike[str], options: BuildOptions) -> tuple[bytes, dict]:
    """Parse and build; returns the serialized engine and a report. Raises FlashNormError for
    missing TensorRT, bad input, a parser error, a plugin that did not take, a failed build."""
    source = Path(onnx_path)
    if not source.is_file():
        raise FlashNormError(f"model {source} does not exist or is not a file")
    trt = import_tensorrt()
    logger = trt.Logger(trt.Logger.VERBOSE if options.verbose else trt.Logger.WARNING)
    plugins = load_plugins(trt, options.plugins)
    builder = trt.Builder(logger)
    network, _parser = _parse_network(trt, builder, logger, source)

    expected = flashnorm_node_names(source)
    plugin_layers = _plugin_layers(trt, network)
    # The parser names a layer after its node (possibly with a suffix).
    flashnorm_layers = [layer for layer in plugin_layers if any(node in layer for node in expected)]
    if plugins and expected and not plugin_layers:
        raise FlashNormError(
            f"the plugin is loaded but TensorRT {trt.__version__} built all {len(expected)} FlashNormMatMul nodes "
            "from their reference functions (TensorRT 10.0-10.6 prefer model-local functions over plugins)"
        )

    config = builder.create_builder_config()
    if options.workspace_bytes is not None:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(options.workspace_bytes))
    profile, profile_shapes = _profile(trt, builder, network, options.shapes)
    if profile is not None:
        config.add_optimization_profile(profile)
    monitor = make_progress_monitor(trt, options.progress)
    if monitor is not None:
        config.progress_monitor = monitor
    cache_path = Path(options.timing_cache) if options.timing_cache else None
    if cache_path is not None:
        cached = cache_path.read_bytes() if cache_path.is_file() else b""
        cache = config.create_timing_cache(cached)
        config.set_timing_cache(cache, ignore_mismatch=False)

    start = time.monotonic()
    serialized = builder.build_serialized_network(network, config)
    seconds = time.monotonic() - start
    if serialized is None:
        raise FlashNormError(f"TensorRT could not build an engine from {source} (see TensorRT's messages above)")
    plan = bytes(memoryview(serialized))
    if cache_path is not None:
        with atomic_write(cache_path, "wb") as handle:
            handle.write(bytes(memoryview(config.get_timing_cache().serialize())))

    report = {
        "input": str(source),
        "tensorrt": trt.__version__,
        "plugins": plugins,
        "strongly_typed": True,
        "plugin_override": hasattr(getattr(trt, "OnnxParserFlag", None), "ENABLE_PLUGIN_OVERRIDE"),
        "profile": profile_shapes,
        "flashnorm_nodes": len(expected),
        "flashnorm_plugin_layers": len(flashnorm_layers),
        "timing_cache": str(cache_path) if cache_path else None,
        "build_seconds": round(seconds, 2),
        "engine_bytes": len(plan),
    }
    if expected and not plugins:
        report["note"] = ("no --plugin given: FlashNormMatMul nodes were built from their reference functions "
                          "(or from a plugin already registered in this process)")
    return plan, report


def build_engine_file(onnx_path: str | os.PathLike[str], plan_path: str | os.PathLike[str],
                      options: BuildOptions) -> dict:
    """Build and write the engine atomically (a failed build leaves no file behind)."""
    destination = Path(plan_path)
    if destination.exists() and destination.resolve() == Path(onnx_path).resolve():
        raise FlashNormError(f"output {destination} is the input model")
    plan, report = build_serialized_engine(onnx_path, options)
    with atomic_write(destination, "wb") as handle:
        handle.write(plan)
    report["output"] = str(destination)
    return report


def deserialize_engine(plan_path: str | os.PathLike[str], plugins: Sequence[str | os.PathLike[str]] = ()) -> Any:
    """Load an engine file (after registering `plugins`)."""
    trt = import_tensorrt()
    source = Path(plan_path)
    if not source.is_file():
        raise FlashNormError(f"engine {source} does not exist or is not a file")
    load_plugins(trt, plugins)
    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    engine = runtime.deserialize_cuda_engine(source.read_bytes())
    if engine is None:
        major, minor = tensorrt_version(trt)
        raise FlashNormError(f"TensorRT {major}.{minor} cannot load {source}: built by another TensorRT version, "
                             "for another GPU, or without its plugin registered (--plugin)")
    return engine
