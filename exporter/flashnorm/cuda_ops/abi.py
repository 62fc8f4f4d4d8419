"""The C ABI of the kernel library in ctypes, declaration for declaration: the enums, the problem
struct and the prototypes of the functions this binding calls, from
``plugins/flashnorm/include/flashnorm/flashnorm.h``; and where the library is loaded from.

Nothing here imports torch. ``tests/test_contract.py`` compiles the header and checks this mirror
against it: every C enum's names and values, the struct's fields (names, order, offsets, sizes),
and each prototype's parameter count and sizes; and that every function named here is exported
by a built ``libflashnorm.so``.
"""

from __future__ import annotations

import ctypes
import enum
import os
import threading
from pathlib import Path

from flashnorm.contract import MAX_OUTPUTS
from flashnorm.errors import FlashNormError


class Dtype(enum.IntEnum):
    """``flashnorm_dtype`` (``FLASHNORM_DTYPE_*``)."""

    F32 = 0
    F16 = 1
    BF16 = 2


class Strategy(enum.IntEnum):
    """``flashnorm_strategy`` (``FLASHNORM_STRATEGY_*``)."""

    AUTO = 0
    TWO_STREAM = 1
    FUSED = 2
    PRENORM = 3
    EPILOGUE_SCALE = 4


class Statistic(enum.IntEnum):
    """``flashnorm_statistic`` (``FLASHNORM_STATISTIC_*``)."""

    RMS = 0
    VARIANCE = 1


class Status(enum.IntEnum):
    """``flashnorm_status`` (``FLASHNORM_STATUS_*``)."""

    OK = 0
    INVALID_ARGUMENT = 1
    UNSUPPORTED = 2
    WORKSPACE_TOO_SMALL = 3
    CUDA_ERROR = 4
    CUBLAS_ERROR = 5


# Each C enum (its typedef name) → its mirror and the prefix its C names share.
C_ENUMS: dict[str, tuple[type[enum.IntEnum], str]] = {
    "flashnorm_dtype": (Dtype, "FLASHNORM_DTYPE_"),
    "flashnorm_strategy": (Strategy, "FLASHNORM_STRATEGY_"),
    "flashnorm_statistic": (Statistic, "FLASHNORM_STATISTIC_"),
    "flashnorm_status": (Status, "FLASHNORM_STATUS_"),
}


class Problem(ctypes.Structure):
    """``flashnorm_problem``, field for field (an enum is a C ``int``)."""

    _fields_ = [
        ("m", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("n", ctypes.c_int64),
        ("num_outputs", ctypes.c_int32),
        ("split_sizes", ctypes.c_int64 * MAX_OUTPUTS),
        ("dtype", ctypes.c_int),
        ("eps", ctypes.c_float),
        ("strategy", ctypes.c_int),
        ("multiprocessors", ctypes.c_int32),
        ("statistic", ctypes.c_int),
    ]


# context, problem, x, w, bias (NULL: none), outputs, workspace, workspace bytes, stream
_MATMUL_ARGS = [
    ctypes.c_void_p,
    ctypes.POINTER(Problem),
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.POINTER(ctypes.c_void_p),
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_void_p,
]

# The functions this binding calls: name → (return type, parameter types); None returns void.
PROTOTYPES: dict[str, tuple[type | None, list[type]]] = {
    "flashnorm_context_create": (ctypes.c_int, [ctypes.POINTER(ctypes.c_void_p)]),
    "flashnorm_workspace_size": (ctypes.c_size_t, [ctypes.POINTER(Problem)]),
    "flashnorm_resolve_strategy": (ctypes.c_int, [ctypes.POINTER(Problem)]),
    "flashnorm_current_multiprocessors": (ctypes.c_int32, []),
    "flashnorm_matmul": (ctypes.c_int, _MATMUL_ARGS),
    # ... with the residual and the sum after x
    "flashnorm_add_matmul": (ctypes.c_int, _MATMUL_ARGS[:3] + [ctypes.c_void_p, ctypes.c_void_p] + _MATMUL_ARGS[3:]),
    "flashnorm_status_string": (ctypes.c_char_p, [ctypes.c_int]),
    "flashnorm_context_last_error": (ctypes.c_char_p, [ctypes.c_void_p]),
    "flashnorm_testing_set_side_delay": (None, [ctypes.c_void_p, ctypes.c_int64]),
    "flashnorm_testing_set_fused_tuning": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32]),
    "flashnorm_testing_set_epilogue_scale_tiles": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int32]),
    "flashnorm_testing_epilogue_scale_tiles_name": (ctypes.c_char_p, [ctypes.c_int32]),
    "flashnorm_strategy_available": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int]),
    "flashnorm_testing_join_dropped": (ctypes.c_int, []),
}

_REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_LIBRARY = _REPO_ROOT / "build" / "plugins" / "flashnorm" / "libflashnorm.so"

_library: ctypes.CDLL | None = None
_library_lock = threading.Lock()


def library_path() -> Path:
    """Where the kernel library is loaded from (``FLASHNORM_LIBRARY`` or the default build path)."""
    override = os.environ.get("FLASHNORM_LIBRARY")
    return Path(override) if override else DEFAULT_LIBRARY


def load() -> ctypes.CDLL:
    """The kernel library, loaded once per process with every prototype of ``PROTOTYPES`` set."""
    global _library
    with _library_lock:
        if _library is not None:
            return _library
        path = library_path()
        if not path.is_file():
            raise FlashNormError(
                f"kernel library not found at {path}: build it with "
                "`cmake -S . -B build -G Ninja && cmake --build build` or set FLASHNORM_LIBRARY"
            )
        lib = ctypes.CDLL(str(path))
        for name, (restype, argtypes) in PROTOTYPES.items():
            function = getattr(lib, name)
            function.argtypes = argtypes
            function.restype = restype
        _library = lib
        return lib


def status_text(lib: ctypes.CDLL, status: int) -> str:
    """The library's words for a ``flashnorm_status``."""
    return lib.flashnorm_status_string(status).decode()
