"""Build a TensorRT engine from a FlashNorm ONNX file.

A strongly typed network (the plugin receives exactly the ONNX tensor types; TensorRT 11 and
TensorRT-RTX have no other kind), the ONNX parser's plugin override on where it exists
(TensorRT ≥ 10.15; the node's `plugin_namespace` attribute already selects the plugin there),
one optimization profile from the given min/opt/max shapes, an optional timing cache, progress
on stderr, and a summary of what the engine is made of. Backends: flashnorm.engine.loader.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from flashnorm import contract, signals
from flashnorm.engine.loader import (
    RTX_HAS_NO_PLUGINS, Backend, import_backend, load_plugins, registered_flashnorm_creators,
)
from flashnorm.engine.progress import make_progress_monitor
from flashnorm.engine.shapes import ShapeRange
from flashnorm.errors import FlashNormError, require_file
from flashnorm.files import atomic_write
from flashnorm.untrusted import InputFile


@dataclasses.dataclass
class BuildOptions:
    plugins: Sequence[str | os.PathLike[str]] = ()
    shapes: Mapping[str, ShapeRange] = dataclasses.field(default_factory=dict)
    timing_cache: Optional[str | os.PathLike[str]] = None
    workspace_bytes: Optional[int] = None
    progress: bool = True
    verbose: bool = False
    backend: str = "auto"
    optimization_level: Optional[int] = None
    """The builder's optimization level (0-5, TensorRT's default 3): lower builds faster."""
    inspect: bool = True
    """Deserialize the engine once more for TensorRT's engine inspector (where it can run)."""


def flashnorm_node_names(onnx_path: str | os.PathLike[str]) -> list[str]:
    """Names of the FlashNormMatMul<N> nodes of a model (read without its weights). A model
    written with the older encoding is refused with what to do."""
    from flashnorm.modelio import read_header

    model = read_header(onnx_path)
    legacy = contract.legacy_encoding(((n.op_type, n.domain) for n in model.graph.node),
                                      ((f.name, f.domain, f.overload) for f in model.functions))
    if legacy:
        raise FlashNormError(f"{onnx_path}: {legacy}")
    return [n.name for n in model.graph.node if contract.is_deferred_node(n.op_type, n.domain)]


def select_backend(requested: str, plugins: Sequence[Any]) -> Backend:
    """The backend to build with; `--plugin` on one without plugin layers is refused before
    anything is loaded (TensorRT-RTX's parser aborts the process on a plugin node)."""
    backend = import_backend(requested)
    if plugins and not backend.hosts_plugins:
        raise FlashNormError(RTX_HAS_NO_PLUGINS if requested != "auto" else
                             f"--plugin needs TensorRT with plugin layers, and only {backend.describe()} is installed: "
                             + RTX_HAS_NO_PLUGINS)
    return backend


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
    if not signals.run_stoppable(parser.parse_from_file, os.fspath(onnx_path), keep=(logger, builder, network)):
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
        try:
            profile.set_shape(name, shape_range.minimum, shape_range.optimum, shape_range.maximum)
        except (RuntimeError, TypeError, ValueError) as exc:  # the bindings' checks of the sizes
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise FlashNormError(f"TensorRT refused --shapes {name}:{shape_range.describe()}: {reason.rstrip('.')}") from None
        used[name] = shape_range.describe()
    return profile, used


def network_summary(trt: Any, network: Any, flashnorm_nodes: Sequence[str]) -> dict[str, Any]:
    """What TensorRT's parser made of the model: layers by type, and the layers that carry the
    norms: the mean reductions (REDUCE, AVG) of the norms computed from their decomposition (one per
    RMSNorm, two per LayerNorm or FlashNormMatMul reference body: its mean, then its mean of
    squares), one plugin layer per FlashNormMatMul node that runs the plugin."""
    types: collections.Counter[str] = collections.Counter()
    mean_reductions, plugin_layers = 0, []
    reduce_layer = getattr(trt, "IReduceLayer", None)
    plugin_kind = getattr(trt.LayerType, "PLUGIN_V3", None)
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        types[layer.type.name] += 1
        if layer.type == trt.LayerType.REDUCE and reduce_layer is not None:
            layer.__class__ = reduce_layer  # the bindings' way to reach the subclass's fields
            mean_reductions += layer.op == trt.ReduceOperation.AVG
        elif plugin_kind is not None and layer.type == plugin_kind:
            plugin_layers.append(layer.name)
    return {
        "layers": network.num_layers,
        "layer_types": dict(sorted(types.items(), key=lambda item: (-item[1], item[0]))),
        "mean_reductions": mean_reductions,
        # The parser names a plugin layer after its node (possibly with a suffix).
        "flashnorm_plugin_layers": sum(any(node in layer for node in flashnorm_nodes) for layer in plugin_layers),
    }


# The parser names the nodes of a model-local function's body after their outputs, the same
# for every node that uses the function, and warns once per body node and use (SmolLM2's 60
# deferred nodes: hundreds of lines). Harmless: those tensors are internal to each use.
_REPEATED_FUNCTION_NODE = "already exists, the output tensors of this new instance will not be queryable"


def _build_logger(trt: Any, verbose: bool, quiet: bool = False) -> Any:
    """TensorRT's messages on stderr, as trt.Logger prints them (none with `quiet`, -q: the
    first error reaches the user in the command's one line), with the parser's warnings about
    repeated function-body node names counted instead of printed."""
    shown = trt.ILogger.Severity.VERBOSE if verbose else trt.ILogger.Severity.WARNING
    errors = (trt.ILogger.Severity.ERROR, trt.ILogger.Severity.INTERNAL_ERROR)

    class BuildLogger(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.repeated_function_nodes = 0
            self.first_error = ""

        def log(self, severity, message):
            if signals.stop_requested():  # the command is stopping: its last line is the stop's
                return
            if severity in errors and not self.first_error:
                self.first_error = str(message).strip().splitlines()[0] if str(message).strip() else ""
            if _REPEATED_FUNCTION_NODE in message and not verbose:
                self.repeated_function_nodes += 1
            elif int(severity) <= int(shown) and not (quiet and not verbose):
                print(f"[TensorRT] [{severity.name}] {message}", file=sys.stderr, flush=True)

    return BuildLogger()


def load_engine(trt: Any, plan: bytes) -> tuple[Optional[Any], str]:
    """The deserialized engine, or None and what the runtime said (its errors are collected,
    not printed: not being able to run an engine here is an answer, not a failure)."""

    class Collecting(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, severity, message):
            if severity in (trt.ILogger.Severity.ERROR, trt.ILogger.Severity.INTERNAL_ERROR):
                self.errors.append(str(message).strip())

    logger = Collecting()
    engine = trt.Runtime(logger).deserialize_cuda_engine(plan)
    if engine is not None:
        return engine, ""
    return None, (logger.errors[0] if logger.errors else "the runtime refused the engine without saying why")


def inspect_engine(trt: Any, plan: bytes) -> dict[str, Any]:
    """TensorRT's engine inspector, summarized: layer count, layers by type and the layers
    whose names carry a norm or a FlashNormMatMul node. The inspector needs the engine
    deserialized, which needs a GPU the backend supports: elsewhere it says why not."""
    engine, why = load_engine(trt, plan)
    if engine is None:
        return {"available": False, "reason": f"the engine cannot be deserialized here: {why}"}
    inspector = engine.create_engine_inspector()
    layers = json.loads(inspector.get_engine_information(trt.LayerInformationFormat.JSON)).get("Layers", [])
    types: collections.Counter[str] = collections.Counter()
    norm_layers = []
    for layer in layers:
        name = layer.get("Name", "") if isinstance(layer, dict) else str(layer)
        types[layer.get("LayerType", "unknown") if isinstance(layer, dict) else "unknown"] += 1
        lowered = name.lower()
        if "norm" in lowered or contract.OP_TYPE_PREFIX.lower() in lowered or "mean" in lowered:
            norm_layers.append(name)
    return {"available": True, "layers": len(layers),
            "layer_types": dict(sorted(types.items(), key=lambda item: (-item[1], item[0]))),
            "norm_layers": norm_layers}


def build_serialized_engine(onnx_path: str | os.PathLike[str], options: BuildOptions) -> tuple[bytes, dict]:
    """Parse and build; returns the serialized engine and a report. Raises FlashNormError for
    missing TensorRT, bad input, a parser error, a plugin that did not take, a failed build."""
    source = require_file("model", onnx_path)
    expected = flashnorm_node_names(source)
    # TensorRT's parser opens the model and its data by name: our own reader checks them first
    # (inside the model's folder, regular files, every tensor's bytes there; one line each), and
    # the plan is refused if any of them changes before it is returned.
    from flashnorm.modelio import unchanged_model

    read = unchanged_model(source)
    backend = select_backend(options.backend, options.plugins)
    trt = backend.module
    logger = _build_logger(trt, options.verbose, quiet=not options.progress)
    plugins = load_plugins(trt, options.plugins)
    if expected and not backend.hosts_plugins and registered_flashnorm_creators(trt):
        raise FlashNormError(f"a FlashNormMatMul plugin creator is registered with {backend.describe()}, whose parser "
                             "aborts the process on a plugin node: build in a process that has not loaded the plugin")
    builder = trt.Builder(logger)
    network, _parser = _parse_network(trt, builder, logger, source)

    summary = network_summary(trt, network, expected)
    if plugins and expected and not summary["flashnorm_plugin_layers"]:
        raise FlashNormError(
            f"the plugin is loaded but {backend.describe()} built all {len(expected)} FlashNormMatMul nodes "
            "from their reference functions (TensorRT 10.0-10.6 prefer model-local functions over plugins)"
        )

    config = builder.create_builder_config()
    profiling = getattr(trt, "ProfilingVerbosity", None)
    if profiling is not None:
        config.profiling_verbosity = profiling.DETAILED  # layer names and tactics for the inspector
    if options.optimization_level is not None:
        config.builder_optimization_level = int(options.optimization_level)
    if options.workspace_bytes is not None:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(options.workspace_bytes))
    profile, profile_shapes = _profile(trt, builder, network, options.shapes)
    if profile is not None:
        config.add_optimization_profile(profile)
    monitor = make_progress_monitor(trt, options.progress)
    if monitor is not None:
        config.progress_monitor = monitor
    cache_path = Path(options.timing_cache) if options.timing_cache else None
    # TensorRT-RTX chooses kernels when the engine first runs: its timing-cache calls are
    # documented no-ops, so the cache is neither read nor written there.
    use_cache = cache_path is not None and backend.name == "tensorrt"
    if use_cache:
        cached = _read_timing_cache(cache_path)
        cache = config.create_timing_cache(cached)
        config.set_timing_cache(cache, ignore_mismatch=False)

    start = time.monotonic()
    serialized = signals.run_stoppable(builder.build_serialized_network, network, config,
                                       keep=(logger, builder, _parser, monitor, profile, plugins))
    seconds = time.monotonic() - start
    if serialized is None and signals.stop_requested():
        signals.raise_stop()
    if serialized is None:
        raise FlashNormError(f"{backend.describe()} could not build an engine from {source}: "
                             + (logger.first_error or "it gave no reason"))
    plan = bytes(memoryview(serialized))
    read.check()
    if use_cache:
        with atomic_write(cache_path, "wb") as handle:
            handle.write(bytes(memoryview(config.get_timing_cache().serialize())))

    report = {
        "input": str(source),
        "backend": backend.name,
        "tensorrt": backend.version,
        "plugins": plugins,
        "strongly_typed": True,
        "plugin_override": hasattr(getattr(trt, "OnnxParserFlag", None), "ENABLE_PLUGIN_OVERRIDE"),
        "profile": profile_shapes,
        "optimization_level": options.optimization_level,
        "flashnorm_nodes": len(expected),
        "flashnorm_plugin_layers": summary["flashnorm_plugin_layers"],
        "timing_cache": str(cache_path) if use_cache else None,
        "build_seconds": round(seconds, 2),
        "engine_bytes": len(plan),
        "network": summary,
        "engine_inspector": inspect_engine(trt, plan) if options.inspect else {
            "available": False, "reason": "not asked for"},
        "parser_warnings_suppressed": logger.repeated_function_nodes,
    }
    if cache_path is not None and not use_cache:
        report["timing_cache_note"] = f"{cache_path} not used: TensorRT-RTX selects kernels at run time"
    if expected and not plugins:
        report["note"] = ("FlashNormMatMul nodes were built from their reference functions" if not backend.hosts_plugins
                          else "no --plugin given: FlashNormMatMul nodes were built from their reference functions "
                               "(or from a plugin already registered in this process)")
    return plan, report


def _read_timing_cache(path: Path) -> bytes:
    """The timing cache's bytes (none if it does not exist yet); a FIFO or device is refused."""
    if not os.path.lexists(path):
        return b""
    cache = InputFile(path, "timing cache")
    try:
        return cache.read_at(0, cache.size)
    finally:
        cache.close()


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


def deserialize_engine(plan_path: str | os.PathLike[str], plugins: Sequence[str | os.PathLike[str]] = (),
                       backend: str = "auto") -> Any:
    """Load an engine file (after registering `plugins`)."""
    chosen = select_backend(backend, plugins)
    source = require_file("engine", plan_path)
    load_plugins(chosen.module, plugins)
    plan = InputFile(source, "engine")
    try:
        engine, why = load_engine(chosen.module, plan.read_at(0, plan.size))
    finally:
        plan.close()
    if engine is None:
        raise FlashNormError(f"{chosen.describe()} cannot load {source} ({why}): built by another TensorRT version, "
                             "for another GPU, or without its plugin registered (--plugin)")
    return engine
