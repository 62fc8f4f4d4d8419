"""A stand-in for the parts of the `tensorrt` module that flashnorm.engine.build drives.

It models what the build code relies on — the ONNX parser makes a plugin layer from a
FlashNormMatMul<N> node only while that creator is registered, dynamic input dimensions are
-1, a build returns a serialized blob, a timing cache round-trips, the runtime cannot
deserialize the blob (there is no GPU) — and
records every setting, so tests can check what FlashNorm asked TensorRT for. It does not
pretend to build anything: the "engine" is a JSON record of the request.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import enum

import onnx

from flashnorm import contract


def make_module(version: str = "10.15.1") -> types.ModuleType:
    trt = types.ModuleType("tensorrt")
    trt.__version__ = version

    class ILogger:
        class Severity(enum.IntEnum):
            INTERNAL_ERROR, ERROR, WARNING, INFO, VERBOSE = 0, 1, 2, 3, 4

        def __init__(self):
            pass

    class Runtime:
        def __init__(self, logger):
            self.logger = logger

        def deserialize_cuda_engine(self, plan):
            self.logger.log(ILogger.Severity.ERROR, "no CUDA device in this stand-in")
            return None

    class NetworkDefinitionCreationFlag:
        STRONGLY_TYPED = 2

    class OnnxParserFlag:
        ENABLE_PLUGIN_OVERRIDE = 3

    class LayerType(enum.Enum):
        PLUGIN_V3 = "PLUGIN_V3"
        REDUCE = "REDUCE"
        OTHER = "OTHER"

    class MemoryPoolType:
        WORKSPACE = "WORKSPACE"

    class IProgressMonitor:
        def __init__(self):
            pass

    class Registry:
        def __init__(self):
            self.creators = set()
            self.libraries = []

        def load_library(self, path):
            self.libraries.append(path)
            if "flashnorm" in Path(path).name:
                self.creators.update((contract.op_type(n), "1", "flashnorm") for n in range(1, contract.MAX_OUTPUTS + 1))
            return object()

        def get_creator(self, name, version, namespace):
            return (name, version, namespace) if (name, version, namespace) in self.creators else None

    registry = Registry()

    class Tensor:
        def __init__(self, name, shape):
            self.name, self.shape = name, shape

    class Layer:
        def __init__(self, name, kind):
            self.name, self.type = name, kind

    class Network:
        def __init__(self, flags):
            self.flags = flags
            self.inputs, self.layers = [], []

        num_inputs = property(lambda self: len(self.inputs))
        num_layers = property(lambda self: len(self.layers))

        def get_input(self, i):
            return self.inputs[i]

        def get_layer(self, i):
            return self.layers[i]

    class Error:
        def __init__(self, text):
            self.text = text

        def desc(self):
            return self.text

    class OnnxParser:
        def __init__(self, network, logger):
            self.network, self.flags, self.errors = network, set(), []

        def set_flag(self, flag):
            self.flags.add(flag)

        num_errors = property(lambda self: len(self.errors))

        def get_error(self, i):
            return self.errors[i]

        def parse_from_file(self, path):
            try:
                model = onnx.load(path, load_external_data=False)
            except Exception as exc:  # the real parser reports, it does not raise
                self.errors.append(Error(f"cannot read {path}: {exc}"))
                return False
            initializers = {i.name for i in model.graph.initializer}
            for value in model.graph.input:
                if value.name in initializers:
                    continue
                dims = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in value.type.tensor_type.shape.dim)
                self.network.inputs.append(Tensor(value.name, dims))
            for node in model.graph.node:
                plugin = registry.get_creator(node.op_type, "1", "flashnorm") is not None
                kind = LayerType.PLUGIN_V3 if (contract.is_deferred_node(node.op_type, node.domain) and plugin) else (
                    LayerType.REDUCE if node.op_type == "ReduceMean" else LayerType.OTHER)
                self.network.layers.append(Layer(node.name, kind))
            self.network.parser_flags = sorted(self.flags)
            return True

    class TimingCache:
        def __init__(self, data):
            self.data = bytes(data)

        def serialize(self):
            return self.data + b"+timed"

    class Profile:
        def __init__(self):
            self.shapes = {}

        def set_shape(self, name, minimum, optimum, maximum):
            self.shapes[name] = [list(minimum), list(optimum), list(maximum)]

    class Config:
        def __init__(self):
            self.pools, self.profiles, self.cache, self.progress_monitor = {}, [], None, None

        def set_memory_pool_limit(self, pool, size):
            self.pools[pool] = size

        def add_optimization_profile(self, profile):
            self.profiles.append(profile)

        def create_timing_cache(self, data):
            return TimingCache(data)

        def set_timing_cache(self, cache, ignore_mismatch):
            self.cache = cache

        def get_timing_cache(self):
            return self.cache

    class Builder:
        fail = False

        def __init__(self, logger):
            self.logger = logger

        def create_network(self, flags):
            return Network(flags)

        def create_builder_config(self):
            return Config()

        def create_optimization_profile(self):
            return Profile()

        def build_serialized_network(self, network, config):
            if Builder.fail:
                return None
            monitor = config.progress_monitor
            if monitor is not None:
                monitor.phase_start("Building engine", None, 2)
                monitor.step_complete("Building engine", 0)
                monitor.step_complete("Building engine", 1)
                monitor.phase_finish("Building engine")
            record = {
                "strongly_typed": bool(network.flags & (1 << NetworkDefinitionCreationFlag.STRONGLY_TYPED)),
                "parser_flags": network.parser_flags,
                "profiles": [p.shapes for p in config.profiles],
                "workspace": config.pools.get(MemoryPoolType.WORKSPACE),
                "timing_cache": None if config.cache is None else config.cache.data.decode(),
                "progress_monitor": monitor is not None,
            }
            return json.dumps(record).encode()

    trt.ILogger, trt.Runtime, trt.Builder, trt.OnnxParser = ILogger, Runtime, Builder, OnnxParser
    trt.NetworkDefinitionCreationFlag, trt.OnnxParserFlag, trt.LayerType = NetworkDefinitionCreationFlag, OnnxParserFlag, LayerType
    trt.MemoryPoolType, trt.IProgressMonitor = MemoryPoolType, IProgressMonitor
    trt.get_plugin_registry = lambda: registry
    return trt
