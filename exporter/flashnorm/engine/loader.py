"""Import TensorRT on demand and load plugin libraries into its registry."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any, Iterable

from flashnorm.errors import FlashNormError

TENSORRT_MISSING = (
    "TensorRT's Python builder is not installed: pip install tensorrt-cu13 (or tensorrt-cu12), "
    "which fetches NVIDIA's libraries from pypi.nvidia.com; TensorRT 10.x or 11.x"
)

PLUGIN_NAME, PLUGIN_VERSION, PLUGIN_NAMESPACE = "FlashNormMatMul", "1", "flashnorm"

# Plugin libraries already registered in this process (a second registration of the same
# creator would fail): resolved path → how it was loaded.
_loaded: dict[str, str] = {}


def import_tensorrt() -> Any:
    """The `tensorrt` module, or FlashNormError saying what to install."""
    try:
        import tensorrt
    except ImportError:
        raise FlashNormError(TENSORRT_MISSING) from None
    return tensorrt


def tensorrt_version(trt: Any) -> tuple[int, int]:
    major, minor = (int(p) for p in trt.__version__.split(".")[:2])
    return major, minor


def load_plugins(trt: Any, paths: Iterable[str | os.PathLike[str]]) -> list[str]:
    """Register each plugin library with TensorRT's plugin registry (once per process).

    `IPluginRegistry.load_library` is used where it exists (the library's getCreators entry
    point; the registry owns the creators); older bindings fall back to a plain dlopen, where
    the library registers itself. Raises FlashNormError when a file is missing, refused, or
    does not provide the FlashNormMatMul creator."""
    registry = trt.get_plugin_registry()
    loaded = []
    for path in paths:
        library = Path(path).resolve()
        if not library.is_file():
            raise FlashNormError(f"plugin library {path} does not exist")
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
    if loaded and registry.get_creator(PLUGIN_NAME, PLUGIN_VERSION, PLUGIN_NAMESPACE) is None:
        raise FlashNormError(
            f"no {PLUGIN_NAME} creator (version {PLUGIN_VERSION}, namespace {PLUGIN_NAMESPACE!r}) "
            f"after loading {', '.join(loaded)}: is it libflashnorm_plugin.so?"
        )
    return loaded
