"""Import a TensorRT backend on demand and load plugin libraries into its registry.

Two backends share one API family (`nvinfer1`, the same open-source ONNX parser):
- `tensorrt`: TensorRT 10.x/11.x, with plugin layers: FlashNormMatMul nodes run the plugin;
- `tensorrt-rtx`: TensorRT for RTX (`tensorrt_rtx`), no plugin layers: FlashNormMatMul nodes
  are built from their model-local reference functions. It builds ahead of time on a machine
  without a GPU, and runs only on the GPUs it supports.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib
import os
from pathlib import Path
from typing import Any, Iterable

from flashnorm import contract
from flashnorm.errors import FlashNormError, missing_file

BACKENDS = ("auto", "tensorrt", "tensorrt-rtx")

TENSORRT_MISSING = (
    "TensorRT's Python builder is not installed: pip install tensorrt-cu13 (or tensorrt-cu12), "
    "which fetches NVIDIA's libraries from pypi.nvidia.com; TensorRT 10.x or 11.x"
)
TENSORRT_RTX_MISSING = (
    "TensorRT for RTX is not installed: pip install tensorrt-rtx-cu13==1.7.1.116 "
    "(or pip install 'flashnorm[tensorrt-rtx]')"
)
NO_BACKEND = (
    "no TensorRT backend is installed: pip install tensorrt-cu13 (TensorRT with the FlashNorm plugin; "
    "NVIDIA's index) or pip install tensorrt-rtx-cu13==1.7.1.116 (TensorRT for RTX: reference functions, no plugin)"
)
RTX_HAS_NO_PLUGINS = (
    "TensorRT for RTX has no plugin layers, so --plugin cannot be used with it (FlashNormMatMul nodes are "
    "built from their reference functions without it); use --backend tensorrt for the plugin"
)


@dataclasses.dataclass(frozen=True)
class Backend:
    """A TensorRT flavour as imported: its name, Python module and version."""

    name: str
    module: Any

    @property
    def version(self) -> str:
        return str(self.module.__version__)

    @property
    def hosts_plugins(self) -> bool:
        """Whether networks of this backend can hold plugin layers (TensorRT-RTX: no)."""
        return self.name == "tensorrt"

    def describe(self) -> str:
        return f"{'TensorRT' if self.name == 'tensorrt' else 'TensorRT-RTX'} {self.version}"


_MODULES = {"tensorrt": "tensorrt", "tensorrt-rtx": "tensorrt_rtx"}
_MISSING = {"tensorrt": TENSORRT_MISSING, "tensorrt-rtx": TENSORRT_RTX_MISSING}


def import_backend(requested: str = "auto") -> Backend:
    """The backend asked for ('auto': TensorRT where importable, else TensorRT-RTX), or
    FlashNormError saying what to install."""
    if requested not in BACKENDS:
        raise FlashNormError(f"unknown TensorRT backend {requested!r}; choose from {', '.join(BACKENDS)}")
    for name in (("tensorrt", "tensorrt-rtx") if requested == "auto" else (requested,)):
        try:
            return Backend(name, importlib.import_module(_MODULES[name]))
        except ImportError:
            continue
    raise FlashNormError(NO_BACKEND if requested == "auto" else _MISSING[requested])

# Plugin libraries already registered in this process (a second registration of the same
# creator would fail): resolved path → how it was loaded.
_loaded: dict[str, str] = {}


def registered_flashnorm_creators(trt: Any) -> list[str]:
    """The FlashNormMatMul<N> creators registered in this process's registry of `trt`."""
    registry = trt.get_plugin_registry()
    names = [contract.op_type(n) for n in range(1, contract.MAX_OUTPUTS + 1)]
    return [name for name in names if registry.get_creator(name, contract.PLUGIN_VERSION, contract.PLUGIN_NAMESPACE)]


def load_plugins(trt: Any, paths: Iterable[str | os.PathLike[str]]) -> list[str]:
    """Register each plugin library with TensorRT's plugin registry (once per process).

    `IPluginRegistry.load_library` is used where it exists (the library's getCreators entry
    point; the registry owns the creators); older bindings fall back to a plain dlopen, where
    the library registers itself. Raises FlashNormError when a file is missing, refused, or
    does not provide the FlashNormMatMul creators."""
    registry = trt.get_plugin_registry()
    loaded = []
    for path in paths:
        library = Path(path).resolve()
        if not library.is_file():
            raise missing_file("plugin library", path)
        key = str(library)
        if key not in _loaded:
            if hasattr(registry, "load_library"):
                if registry.load_library(key) is None:
                    raise FlashNormError(f"TensorRT refused plugin library {library} (see TensorRT's messages above)")
                _loaded[key] = "loadLibrary"
            else:
                try:
                    ctypes.CDLL(key)
                except OSError as exc:
                    raise FlashNormError(f"cannot load plugin library {library}: {exc}") from None
                _loaded[key] = "dlopen"
        loaded.append(key)
    if loaded:
        registered = registered_flashnorm_creators(trt)
        missing = [contract.op_type(n) for n in range(1, contract.MAX_OUTPUTS + 1) if contract.op_type(n) not in registered]
        if missing:
            raise FlashNormError(
                f"no {missing[0]} creator (version {contract.PLUGIN_VERSION}, namespace {contract.PLUGIN_NAMESPACE!r}) "
                f"after loading {', '.join(loaded)}: is it libflashnorm_plugin.so?"
            )
    return loaded
