"""The PyTorch binding of the FlashNorm CUDA library (``libflashnorm.so``, C ABI in
``plugins/flashnorm/include/flashnorm/flashnorm.h``; the kernels are ``plugins/flashnorm/kernels/``).

    y_i = (x · W*)[:, cols_i] ⊙ rsqrt(mean(x², -1) + eps)

Ways in:

- ``flashnorm_matmul(x, w, eps, splits, strategy, out=None)``: a direct ctypes call (outputs may
  be supplied with ``out``). torch.compile cannot trace it: it breaks the graph at every call.
- ``flashnorm_add_matmul(x, residual, w, eps, ...)`` and ``torch.ops.flashnorm.add_matmul``: the
  residual add in front of the norm (h = x + residual) in the same call; returns h too. In a
  decode step the fused kernel does the add as it reads x, so the add costs no kernel.
- ``torch.ops.flashnorm.matmul(x, w, eps, splits, strategy)`` (also ``matmul_op``): the same call
  registered as a PyTorch custom op, with a fake implementation for shapes, so torch.compile
  compiles the model around it without a graph break and CUDA graphs capture it. CUDA tensors run
  the library; CPU tensors run the same arithmetic in PyTorch (``reference_matmul``), so models
  and tests can trace and check the op on a machine without a GPU. Under Inductor, ``"auto"``
  keeps the library call where AUTO picks the fused kernel and becomes PyTorch ops elsewhere
  (``inductor_form``).

The library is found through the environment variable ``FLASHNORM_LIBRARY`` or, failing that,
at ``build/plugins/flashnorm/libflashnorm.so`` under the repository root (build it with
``cmake -S . -B build -G Ninja && cmake --build build``).

Execution contexts. The library keeps per-context state (a side stream, two events, a cuBLASLt
handle, an algorithm cache). This module creates one context per (CUDA device, host thread),
lazily, on the first call from that thread on that device, and keeps it for the life of the
process. Creating a context is not allowed inside a CUDA-graph capture, so call
``flashnorm_matmul`` (or ``warm_up``) once on each thread and device before capturing; the
first call of a new shape may happen inside a capture (the cuBLASLt heuristic query is host-only).

Every call runs on ``torch.cuda.current_stream()``; its device workspace comes from torch's
caching allocator, so a captured call draws it from the graph's private pool.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from flashnorm.contract import MAX_OUTPUTS
from flashnorm.errors import FlashNormError

STRATEGIES = {"auto": 0, "two_stream": 1, "fused": 2, "prenorm": 3, "epilogue_scale": 4}
_STRATEGY_NAMES = {value: name for name, value in STRATEGIES.items()}
_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_LIBRARY = _REPO_ROOT / "build" / "plugins" / "flashnorm" / "libflashnorm.so"


class _Problem(ctypes.Structure):
    _fields_ = [
        ("m", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("n", ctypes.c_int64),
        ("num_outputs", ctypes.c_int32),
        ("split_sizes", ctypes.c_int64 * MAX_OUTPUTS),
        ("dtype", ctypes.c_int),
        ("eps", ctypes.c_float),
        ("strategy", ctypes.c_int),
    ]


_library: ctypes.CDLL | None = None
_library_lock = threading.Lock()
_contexts = threading.local()


def library_path() -> Path:
    """Where the kernel library is loaded from (``FLASHNORM_LIBRARY`` or the default build path)."""
    override = os.environ.get("FLASHNORM_LIBRARY")
    return Path(override) if override else DEFAULT_LIBRARY


def _load() -> ctypes.CDLL:
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
        lib.flashnorm_context_create.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        lib.flashnorm_context_create.restype = ctypes.c_int
        lib.flashnorm_workspace_size.argtypes = [ctypes.POINTER(_Problem)]
        lib.flashnorm_workspace_size.restype = ctypes.c_size_t
        lib.flashnorm_resolve_strategy.argtypes = [ctypes.POINTER(_Problem)]
        lib.flashnorm_resolve_strategy.restype = ctypes.c_int
        # context, problem, x, w, outputs, workspace, workspace bytes, stream
        matmul_args = [
            ctypes.c_void_p,
            ctypes.POINTER(_Problem),
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_void_p,
        ]
        lib.flashnorm_matmul.argtypes = matmul_args
        lib.flashnorm_matmul.restype = ctypes.c_int
        # ... with the residual and the sum after x
        lib.flashnorm_add_matmul.argtypes = matmul_args[:3] + [ctypes.c_void_p, ctypes.c_void_p] + matmul_args[3:]
        lib.flashnorm_add_matmul.restype = ctypes.c_int
        lib.flashnorm_status_string.argtypes = [ctypes.c_int]
        lib.flashnorm_status_string.restype = ctypes.c_char_p
        lib.flashnorm_context_last_error.argtypes = [ctypes.c_void_p]
        lib.flashnorm_context_last_error.restype = ctypes.c_char_p
        lib.flashnorm_testing_set_side_delay.argtypes = [ctypes.c_void_p, ctypes.c_int64]
        lib.flashnorm_testing_set_side_delay.restype = None
        lib.flashnorm_testing_set_fused_tuning.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32]
        lib.flashnorm_testing_set_fused_tuning.restype = ctypes.c_int
        lib.flashnorm_testing_set_epilogue_scale_tiles.argtypes = [ctypes.c_void_p, ctypes.c_int32]
        lib.flashnorm_testing_set_epilogue_scale_tiles.restype = ctypes.c_int
        lib.flashnorm_testing_epilogue_scale_tiles_name.argtypes = [ctypes.c_int32]
        lib.flashnorm_testing_epilogue_scale_tiles_name.restype = ctypes.c_char_p
        lib.flashnorm_strategy_available.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.flashnorm_strategy_available.restype = ctypes.c_int
        lib.flashnorm_testing_join_dropped.argtypes = []
        lib.flashnorm_testing_join_dropped.restype = ctypes.c_int
        _library = lib
        return lib


def _context(device: torch.device) -> ctypes.c_void_p:
    """This thread's context on `device`, created on first use (never inside a capture)."""
    per_thread = getattr(_contexts, "by_device", None)
    if per_thread is None:
        per_thread = _contexts.by_device = {}
    index = _cuda_device(device).index
    context = per_thread.get(index)
    if context is not None:
        return context
    if torch.cuda.is_current_stream_capturing():
        raise FlashNormError(
            "no FlashNorm context yet for this thread and device, and one cannot be created "
            "inside a CUDA-graph capture: call flashnorm_matmul (or warm_up) once before capturing"
        )
    lib = _load()
    context = ctypes.c_void_p()
    with torch.cuda.device(index):
        status = lib.flashnorm_context_create(ctypes.byref(context))
    if status != 0:
        raise FlashNormError(f"flashnorm_context_create failed: {lib.flashnorm_status_string(status).decode()}")
    per_thread[index] = context
    return context


def _problem(m: int, k: int, splits: Sequence[int], dtype: torch.dtype, eps: float, strategy: str) -> _Problem:
    if dtype not in _DTYPES:
        raise FlashNormError(f"dtype {dtype} is not supported; supported: float32, float16, bfloat16")
    if strategy not in STRATEGIES:
        raise FlashNormError(f"strategy {strategy!r} is unknown; known: {sorted(STRATEGIES)}")
    if not 1 <= len(splits) <= MAX_OUTPUTS:
        raise FlashNormError(f"{len(splits)} splits requested; 1 to {MAX_OUTPUTS} are supported")
    problem = _Problem()
    problem.m = m
    problem.k = k
    problem.n = sum(splits)
    problem.num_outputs = len(splits)
    for index, size in enumerate(splits):
        problem.split_sizes[index] = size
    problem.dtype = _DTYPES[dtype]
    problem.eps = eps
    problem.strategy = STRATEGIES[strategy]
    return problem


def resolve_strategy(
    m: int, k: int, n: int, dtype: torch.dtype = torch.bfloat16, splits: Sequence[int] | None = None
) -> str:
    """The strategy ``"auto"`` picks for an [m, k] × [k, n] problem split into ``splits`` (None: one
    output): ``"fused"``, ``"two_stream"``, ``"prenorm"`` (which depends on the narrowest split) or,
    in builds with the CUTLASS kernel, ``"epilogue_scale"``."""
    splits = [n] if splits is None else [int(size) for size in splits]
    if sum(splits) != n:
        raise FlashNormError(f"splits {splits} must sum to N={n}")
    problem = _problem(m, k, splits, dtype, 1e-6, "auto")
    return _STRATEGY_NAMES[_load().flashnorm_resolve_strategy(ctypes.byref(problem))]


def workspace_size(
    m: int, k: int, splits: Sequence[int], dtype: torch.dtype = torch.bfloat16, strategy: str = "auto"
) -> int:
    """Bytes of device workspace a call needs for this problem or any smaller m (0 for the fused kernel)."""
    problem = _problem(m, k, [int(size) for size in splits], dtype, 1e-6, strategy)
    return int(_load().flashnorm_workspace_size(ctypes.byref(problem)))


def flashnorm_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    eps: float,
    splits: Sequence[int] | None = None,
    strategy: str = "auto",
    out: list[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """``(x · w)[:, split_i] * rsqrt(mean(x², -1) + eps)`` for each split, on the current stream.

    x is [..., K] (flattened to [M, K]; made contiguous if it is not), w is [K, N] row-major
    contiguous with the norm gain already folded in, ``splits`` are column counts summing to N
    (None: one output). Returns one tensor [..., N_i] per split; ``out`` may supply them
    (contiguous, right shape, dtype and device) so that nothing is allocated for outputs.
    Where column views of one output serve the caller (q, k, v as ``(x @ W).split(...)`` gives
    them), one split is faster beyond the fused kernel's rows: one GEMM covers all of N
    (docs/BENCHMARKS.md, "One output").
    """
    return _library_call(x, None, w, eps, splits, strategy, out)[1]


def flashnorm_add_matmul(
    x: torch.Tensor,
    residual: torch.Tensor,
    w: torch.Tensor,
    eps: float,
    splits: Sequence[int] | None = None,
    strategy: str = "auto",
    out: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The residual add in front of the norm, as a decoder layer has it: ``h = x + residual``
    (rounded to x's dtype, as that add computes) and ``flashnorm_matmul(h, w, eps, splits)``, in
    one library call. Returns ``(h, outputs)``, h shaped like x. The fused kernel forms h as it
    reads x and writes it from the same launch; the other strategies run the add first. ``out``
    may supply ``[h, *outputs]`` (contiguous; h must not overlap x or residual)."""
    if out is not None and len(out) < 1:
        raise FlashNormError("out must hold the sum h and one tensor per split")
    return _library_call(x, residual, w, eps, splits, strategy, out and out[1:], out and out[0])


def _library_call(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    w: torch.Tensor,
    eps: float,
    splits: Sequence[int] | None,
    strategy: str,
    out: list[torch.Tensor] | None,
    out_sum: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """flashnorm_matmul (residual None) or flashnorm_add_matmul: (the sum or None, the outputs)."""
    splits = _checked_splits(x, w, splits, strategy)
    if not x.is_cuda:
        raise FlashNormError(f"x and w are on {x.device}; flashnorm_matmul needs a CUDA device")
    k = w.shape[0]
    lead_shape = tuple(x.shape[:-1])
    x2d = x.reshape(-1, k).contiguous()
    m = x2d.shape[0]
    if residual is not None:
        _check_like_x(x, residual)
        residual2d = residual.reshape(-1, k).contiguous()
        if out_sum is None:
            total = torch.empty_like(x2d)
        else:
            _check_like_x(x, out_sum, "the sum's output tensor")
            if not out_sum.is_contiguous():
                raise FlashNormError("the sum's output tensor must be contiguous")
            total = out_sum.view(m, k)
    if out is None:
        out = [torch.empty(*lead_shape, size, dtype=x.dtype, device=x.device) for size in splits]
    else:
        if len(out) != len(splits):
            raise FlashNormError(f"{len(out)} output tensors given for {len(splits)} splits")
        for tensor, size in zip(out, splits):
            if tensor.shape != (*lead_shape, size) or tensor.dtype != x.dtype or tensor.device != x.device:
                raise FlashNormError(
                    f"output {tuple(tensor.shape)} {tensor.dtype} {tensor.device} does not match "
                    f"{(*lead_shape, size)} {x.dtype} {x.device}"
                )
            if not tensor.is_contiguous():
                raise FlashNormError("output tensors must be contiguous")
    lib = _load()
    context = _context(x.device)
    problem = _problem(m, k, splits, x.dtype, eps, strategy)
    workspace_bytes = lib.flashnorm_workspace_size(ctypes.byref(problem))
    workspace = torch.empty(max(workspace_bytes, 1), dtype=torch.uint8, device=x.device)
    pointers = (ctypes.c_void_p * MAX_OUTPUTS)(*[tensor.data_ptr() for tensor in out])
    stream = torch.cuda.current_stream(x.device).cuda_stream
    workspace_args = (pointers, workspace.data_ptr(), workspace_bytes, stream)
    if residual is None:
        status = lib.flashnorm_matmul(context, ctypes.byref(problem), x2d.data_ptr(), w.data_ptr(), *workspace_args)
    else:
        status = lib.flashnorm_add_matmul(
            context,
            ctypes.byref(problem),
            x2d.data_ptr(),
            residual2d.data_ptr(),
            total.data_ptr(),
            w.data_ptr(),
            *workspace_args,
        )
    if status != 0:
        detail = lib.flashnorm_context_last_error(context).decode()
        raise FlashNormError(f"flashnorm_matmul failed ({lib.flashnorm_status_string(status).decode()}): {detail}")
    return (None if residual is None else total.view(x.shape)), out


def _check_like_x(x: torch.Tensor, tensor: torch.Tensor, name: str = "residual") -> None:
    """`tensor` (the residual, or the sum's output) must have x's shape, dtype and device."""
    if tensor.shape != x.shape or tensor.dtype != x.dtype or tensor.device != x.device:
        raise FlashNormError(
            f"{name} {tuple(tensor.shape)} {tensor.dtype} {tensor.device} does not match "
            f"x {tuple(x.shape)} {x.dtype} {x.device}"
        )


def _checked_splits(x: torch.Tensor, w: torch.Tensor, splits: Sequence[int] | None, strategy: str) -> list[int]:
    """The column counts of the outputs, after checking x, w and splits agree (any device)."""
    if x.dtype != w.dtype:
        raise FlashNormError(f"x is {x.dtype} but w is {w.dtype}; both must have one dtype")
    if x.device != w.device:
        raise FlashNormError(f"x ({x.device}) and w ({w.device}) must be on one device")
    if w.dim() != 2 or not w.is_contiguous():
        raise FlashNormError(f"w must be a contiguous [K, N] matrix, got shape {tuple(w.shape)}")
    if x.dtype not in _DTYPES:
        raise FlashNormError(f"dtype {x.dtype} is not supported; supported: float32, float16, bfloat16")
    if strategy not in STRATEGIES:
        raise FlashNormError(f"strategy {strategy!r} is unknown; known: {sorted(STRATEGIES)}")
    k, n = w.shape
    if x.dim() < 1 or x.shape[-1] != k:
        raise FlashNormError(f"x has {x.shape[-1] if x.dim() else 'no'} features but w has {k} rows")
    splits = [n] if splits is None else [int(size) for size in splits]
    if not 1 <= len(splits) <= MAX_OUTPUTS:
        raise FlashNormError(f"{len(splits)} splits requested; 1 to {MAX_OUTPUTS} are supported")
    if sum(splits) != n or any(size <= 0 for size in splits):
        raise FlashNormError(f"splits {splits} must be positive and sum to N={n}")
    return splits


def reference_matmul(x: torch.Tensor, w: torch.Tensor, eps: float, splits: Sequence[int]) -> list[torch.Tensor]:
    """The op's arithmetic in PyTorch: fp32 accumulation and fp32 RMS, each split rounded once to
    x's dtype (what the library's fused and two-stream strategies compute)."""
    x32 = x.float()
    inv_rms = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    y = (x32 @ w.float()) * inv_rms
    return [part.to(x.dtype).contiguous() for part in y.split(list(splits), dim=-1)]


def reference_add(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """x + residual added in fp32 and rounded once to x's dtype (the library's residual add)."""
    return (x.float() + residual.float()).to(x.dtype)


def _run_op(x: torch.Tensor, w: torch.Tensor, eps: float, splits: list[int], strategy: str) -> list[torch.Tensor]:
    splits = _checked_splits(x, w, splits, strategy)
    if x.is_cuda:
        return flashnorm_matmul(x, w, eps, splits, strategy)
    return reference_matmul(x, w, eps, splits)


def _op_shapes(x: torch.Tensor, w: torch.Tensor, eps: float, splits: list[int], strategy: str) -> list[torch.Tensor]:
    splits = _checked_splits(x, w, splits, strategy)
    return [x.new_empty(*x.shape[:-1], size) for size in splits]


matmul_op = torch.library.custom_op("flashnorm::matmul", _run_op, mutates_args=())
matmul_op.__doc__ = """``torch.ops.flashnorm.matmul(x, w, eps, splits, strategy)``: one output per split,
``(x · w)[..., split_i] ⊙ rsqrt(mean(x², -1) + eps)``, on the current stream (module docstring)."""
matmul_op.register_fake(_op_shapes)
# The same call under another name, which Inductor never rewrites: what ``inductor_form`` keeps.
library_op = torch.library.custom_op("flashnorm::library_matmul", _run_op, mutates_args=())
library_op.register_fake(_op_shapes)


# Where the fused kernel also does the residual add, Inductor keeps the library call up to
# _ADD_ONE_GROUP_ROWS rows (one 8-token B operand) everywhere, and up to 16 only while K·N is at
# most _ADD_TWO_GROUP_MAX_WEIGHT: with two B operands the add cost the fused kernel 0.9-1.8 µs on
# 576×3072, 2048×3072 and 2048×16384, which then lost to Inductor's add + norm kernel + cuBLAS at
# 12 and 16 rows; 0.3 µs on 576×960, which still won (H200, bf16, plugins/flashnorm/kernels/NOTES.md,
# "The residual add beyond 8 rows").
_ADD_ONE_GROUP_ROWS = 8
_ADD_TWO_GROUP_MAX_WEIGHT = 1 << 20
# Up to the fused kernel's 16 rows AUTO picks the epilogue-scale GEMM only where that measured
# faster than the fused kernel, and there it also beat torch.compile's norm kernel + cuBLAS (H200,
# bf16, 16 rows: SmolLM2-135M gate|up 4.92 against 5.97 µs, Llama-3.2-1B gate|up 20.3 against 21.4,
# Llama-3.1-8B q|k|v 16.5 against 18.7; docs/BENCHMARKS.md, 2026-12-03 18:21 UTC): Inductor keeps
# that library call too.
_LIBRARY_EPILOGUE_SCALE_MAX_ROWS = 16


def _keeps_library_call(
    x: torch.Tensor, w: torch.Tensor, splits: list[int], strategy: str, residual_add: bool = False
) -> bool:
    """Whether Inductor keeps the op as the library call (see ``inductor_form``); `residual_add`: the
    add_matmul op (see ``add_inductor_form``)."""
    if strategy != "auto" or x.device.type == "cpu" or not all(isinstance(d, int) for d in x.shape):
        return True
    rows = x.numel() // x.shape[-1]
    if rows == 0:
        return True
    picked = resolve_strategy(rows, x.shape[-1], w.shape[1], x.dtype, splits)
    if picked != "fused" and not (picked == "epilogue_scale" and rows <= _LIBRARY_EPILOGUE_SCALE_MAX_ROWS):
        return False
    if not residual_add or rows <= _ADD_ONE_GROUP_ROWS:
        return True
    return x.shape[-1] * w.shape[1] <= _ADD_TWO_GROUP_MAX_WEIGHT


def inductor_form(x: torch.Tensor, w: torch.Tensor, eps: float, splits: list[int], strategy: str) -> list[torch.Tensor]:
    """What Inductor compiles ``torch.ops.flashnorm.matmul`` to: the library call
    (``flashnorm::library_matmul``) where AUTO picks the fused kernel (or, up to its 16 rows, the
    epilogue-scale GEMM), where the strategy is forced, on the CPU, or where the shape is not known
    at compile time; elsewhere ``prenorm_form``.

    Why: beyond the fused kernel's rows the library's strategies (two_stream, prenorm, and the
    epilogue-scale GEMM as measured end to end so far) lose to what Inductor makes of the prenorm
    arithmetic, the norm fused into the kernel that produces x and the GEMM on cuBLAS
    (docs/BENCHMARKS.md, "End-to-end decode step" and the kernel tables)."""
    if _keeps_library_call(x, w, splits, strategy):
        return torch.ops.flashnorm.library_matmul(x, w, eps, splits, strategy)
    return prenorm_form(x, w, eps, splits)


def prenorm_form(x: torch.Tensor, w: torch.Tensor, eps: float, splits: Sequence[int]) -> list[torch.Tensor]:
    """The prenorm strategy's arithmetic in PyTorch ops: x̂ = x ⊙ rsqrt(mean(x²)+eps) in fp32,
    rounded to x's dtype, then x̂·W*; one contiguous output per split."""
    x32 = x.float()
    normalized = (x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)).to(x.dtype)
    y = normalized @ w
    if len(splits) == 1:
        return [y]
    return [part.contiguous() for part in y.split(list(splits), dim=-1)]


def _run_add_op(
    x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float, splits: list[int], strategy: str
) -> list[torch.Tensor]:
    splits = _checked_splits(x, w, splits, strategy)
    _check_like_x(x, residual)
    if x.is_cuda:
        total, outputs = flashnorm_add_matmul(x, residual, w, eps, splits, strategy)
        return [total, *outputs]
    total = reference_add(x, residual)
    return [total, *reference_matmul(total, w, eps, splits)]


def _add_op_shapes(
    x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float, splits: list[int], strategy: str
) -> list[torch.Tensor]:
    _check_like_x(x, residual)
    return [x.new_empty(x.shape), *_op_shapes(x, w, eps, splits, strategy)]


add_matmul_op = torch.library.custom_op("flashnorm::add_matmul", _run_add_op, mutates_args=())
add_matmul_op.__doc__ = """``torch.ops.flashnorm.add_matmul(x, residual, w, eps, splits, strategy)``:
``[h, y_0, y_1, ...]`` with ``h = x + residual`` and ``y_i = (h · w)[..., split_i] ⊙ rsqrt(mean(h², -1) +
eps)``: the residual add of a decoder layer and the norm→projection after it in one call."""
add_matmul_op.register_fake(_add_op_shapes)
library_add_op = torch.library.custom_op("flashnorm::library_add_matmul", _run_add_op, mutates_args=())
library_add_op.register_fake(_add_op_shapes)


def add_inductor_form(
    x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float, splits: list[int], strategy: str
) -> list[torch.Tensor]:
    """What Inductor compiles ``torch.ops.flashnorm.add_matmul`` to: the library call where
    ``inductor_form`` keeps it (the fused kernel, which then also does the add) but for 9 to 16 rows
    on a larger W* (``_ADD_TWO_GROUP_MAX_WEIGHT``), elsewhere the add and ``prenorm_form`` in
    PyTorch ops, which Inductor fuses into one kernel before the GEMM."""
    if _keeps_library_call(x, w, splits, strategy, residual_add=True):
        return torch.ops.flashnorm.library_add_matmul(x, residual, w, eps, splits, strategy)
    total = x + residual
    return [total, *prenorm_form(total, w, eps, splits)]


def _register_inductor_form() -> None:
    from torch._inductor.decomposition import register_decomposition

    register_decomposition(torch.ops.flashnorm.matmul.default)(inductor_form)
    register_decomposition(torch.ops.flashnorm.add_matmul.default)(add_inductor_form)


_register_inductor_form()


def _cuda_device(device: torch.device | int | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def warm_up(device: torch.device | int | None = None) -> None:
    """Creates this thread's context on `device` now, so that later calls may be captured."""
    _context(_cuda_device(device))


def set_side_delay(cycles: int, device: torch.device | int | None = None) -> None:
    """Test hook: the side stream's work of this thread's context (two-stream's RMS reduction,
    prenorm's narrow GEMMs) and epilogue-scale's reduction (after it let the GEMM start) wait
    `cycles` GPU clock cycles first, so that a missing join would read a stale buffer."""
    _load().flashnorm_testing_set_side_delay(_context(_cuda_device(device)), int(cycles))


def set_fused_tuning(strip_cols: int = 0, cluster_size: int = 0, device: torch.device | int | None = None) -> None:
    """Tuning hook: forces the fused kernel's strip width (32 or 128 columns of W* per
    cluster) and cluster size (1, 2, 4 or 8 blocks per strip) on this thread's context; 0 restores
    the automatic choice."""
    lib = _load()
    context = _context(_cuda_device(device))
    status = lib.flashnorm_testing_set_fused_tuning(context, int(strip_cols), int(cluster_size))
    if status != 0:
        raise FlashNormError(lib.flashnorm_context_last_error(context).decode())


def epilogue_scale_tile_names() -> list[str]:
    """The epilogue-scale GEMM's tile configurations, as the library names them (every build lists
    them; only builds with the CUTLASS kernel run them)."""
    lib = _load()
    names = []
    while (name := lib.flashnorm_testing_epilogue_scale_tiles_name(len(names))) is not None:
        names.append(name.decode())
    return names


def set_epilogue_scale_tiles(name: str | None = None, device: torch.device | int | None = None) -> None:
    """Tuning hook: forces the epilogue-scale GEMM's tile configuration (a name from
    `epilogue_scale_tile_names`) on this thread's context; None restores the automatic choice.
    AUTO's choice of strategy does not change."""
    names = epilogue_scale_tile_names()
    if name is not None and name not in names:
        raise FlashNormError(f"epilogue-scale tiles {name!r} are unknown; known: {names}")
    lib = _load()
    context = _context(_cuda_device(device))
    status = lib.flashnorm_testing_set_epilogue_scale_tiles(context, 0 if name is None else 1 + names.index(name))
    if status != 0:
        raise FlashNormError(lib.flashnorm_context_last_error(context).decode())


def strategy_available(strategy: str, device: torch.device | int | None = None) -> bool:
    """Whether `strategy` can run on `device` with this library build (``"epilogue_scale"`` needs
    the CUTLASS headers at build time and a compute capability 9.0 device; the others always can)."""
    if strategy not in STRATEGIES:
        raise FlashNormError(f"strategy {strategy!r} is unknown; known: {sorted(STRATEGIES)}")
    return bool(_load().flashnorm_strategy_available(_context(_cuda_device(device)), STRATEGIES[strategy]))


def join_dropped() -> bool:
    """True for the race-mutation build (``-DFLASHNORM_TESTING_DROP_JOIN=ON``)."""
    return bool(_load().flashnorm_testing_join_dropped())
