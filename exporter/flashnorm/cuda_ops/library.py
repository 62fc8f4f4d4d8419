"""Typed Python calls into the kernel library: execution contexts, AUTO's choice, the workspace
size, ``flashnorm_matmul`` and ``flashnorm_add_matmul``, and the argument checks made before a call.

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
import threading
from collections.abc import Sequence

import torch

from flashnorm.contract import MAX_OUTPUTS
from flashnorm.cuda_ops.abi import Dtype, Problem, Statistic, Status, Strategy, load, status_text
from flashnorm.errors import FlashNormError

STRATEGIES = {strategy.name.lower(): int(strategy) for strategy in Strategy}
_STRATEGY_NAMES = {value: name for name, value in STRATEGIES.items()}
# The row statistic by name: "rms" (RMSNorm) or "variance" (LayerNorm, with W* centred).
STATISTICS = {statistic.name.lower(): int(statistic) for statistic in Statistic}
_DTYPES = {torch.float32: Dtype.F32, torch.float16: Dtype.F16, torch.bfloat16: Dtype.BF16}

_contexts = threading.local()


def cuda_device(device: torch.device | int | None) -> torch.device:
    """`device` as a CUDA device with its index (None: the current device)."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def context(device: torch.device | int | None) -> ctypes.c_void_p:
    """This thread's context on `device`, created on first use (never inside a capture)."""
    per_thread = getattr(_contexts, "by_device", None)
    if per_thread is None:
        per_thread = _contexts.by_device = {}
    index = cuda_device(device).index
    found = per_thread.get(index)
    if found is not None:
        return found
    if torch.cuda.is_current_stream_capturing():
        raise FlashNormError(
            "no FlashNorm context yet for this thread and device, and one cannot be created "
            "inside a CUDA-graph capture: call flashnorm_matmul (or warm_up) once before capturing"
        )
    lib = load()
    created = ctypes.c_void_p()
    with torch.cuda.device(index):
        status = lib.flashnorm_context_create(ctypes.byref(created))
    if status != Status.OK:
        raise FlashNormError(f"flashnorm_context_create failed: {status_text(lib, status)}")
    per_thread[index] = created
    return created


def warm_up(device: torch.device | int | None = None) -> None:
    """Creates this thread's context on `device` now, so that later calls may be captured."""
    context(cuda_device(device))


def check_statistic(statistic: str) -> None:
    """A known statistic's name, or a one-line error naming the known ones."""
    if statistic not in STATISTICS:
        raise FlashNormError(f"statistic {statistic!r} is unknown; known: {sorted(STATISTICS)}")


def _problem(
    m: int,
    k: int,
    splits: Sequence[int],
    dtype: torch.dtype,
    eps: float,
    strategy: str,
    multiprocessors: int = 0,
    statistic: str = "rms",
) -> Problem:
    if dtype not in _DTYPES:
        raise FlashNormError(f"dtype {dtype} is not supported; supported: float32, float16, bfloat16")
    if strategy not in STRATEGIES:
        raise FlashNormError(f"strategy {strategy!r} is unknown; known: {sorted(STRATEGIES)}")
    check_statistic(statistic)
    if not 1 <= len(splits) <= MAX_OUTPUTS:
        raise FlashNormError(f"{len(splits)} splits requested; 1 to {MAX_OUTPUTS} are supported")
    if multiprocessors < 0:
        raise FlashNormError(f"multiprocessors must be >= 0 (0: the device's own), not {multiprocessors}")
    problem = Problem()
    problem.m = m
    problem.k = k
    problem.n = sum(splits)
    problem.num_outputs = len(splits)
    for index, size in enumerate(splits):
        problem.split_sizes[index] = size
    problem.dtype = _DTYPES[dtype]
    problem.eps = eps
    problem.strategy = STRATEGIES[strategy]
    problem.multiprocessors = multiprocessors
    problem.statistic = STATISTICS[statistic]
    return problem


def resolve_strategy(
    m: int,
    k: int,
    n: int,
    dtype: torch.dtype = torch.bfloat16,
    splits: Sequence[int] | None = None,
    multiprocessors: int = 0,
    statistic: str = "rms",
) -> str:
    """The strategy ``"auto"`` picks for an [m, k] × [k, n] problem split into ``splits`` (None: one
    output) on a device of ``multiprocessors`` multiprocessors (0: the current device's, or the H200's
    132 AUTO was measured on where no device answers; ``current_multiprocessors``): ``"fused"``,
    ``"two_stream"``, ``"prenorm"`` (which depends on the narrowest split) or, in builds with the
    CUTLASS kernel, ``"epilogue_scale"``. It picks alike for both statistics."""
    splits = [n] if splits is None else [int(size) for size in splits]
    if sum(splits) != n:
        raise FlashNormError(f"splits {splits} must sum to N={n}")
    problem = _problem(m, k, splits, dtype, 1e-6, "auto", multiprocessors, statistic)
    return _STRATEGY_NAMES[load().flashnorm_resolve_strategy(ctypes.byref(problem))]


def workspace_size(
    m: int,
    k: int,
    splits: Sequence[int],
    dtype: torch.dtype = torch.bfloat16,
    strategy: str = "auto",
    multiprocessors: int = 0,
    statistic: str = "rms",
) -> int:
    """Bytes of device workspace a call needs for this problem or any smaller m (0 for the fused
    kernel), under ``"auto"`` on a device of ``multiprocessors`` multiprocessors (0 as in
    ``resolve_strategy``)."""
    problem = _problem(m, k, [int(size) for size in splits], dtype, 1e-6, strategy, multiprocessors, statistic)
    return int(load().flashnorm_workspace_size(ctypes.byref(problem)))


def current_multiprocessors() -> int:
    """The multiprocessors ``multiprocessors=0`` stands for in ``resolve_strategy`` and
    ``workspace_size``: the current CUDA device's, or the H200's 132 AUTO was measured on where no
    device answers."""
    return int(load().flashnorm_current_multiprocessors())


def strategy_available(strategy: str, device: torch.device | int | None = None) -> bool:
    """Whether `strategy` can run on `device` with this library build (``"epilogue_scale"`` needs
    the CUTLASS headers at build time and a compute capability 9.0 device; the others always can)."""
    if strategy not in STRATEGIES:
        raise FlashNormError(f"strategy {strategy!r} is unknown; known: {sorted(STRATEGIES)}")
    return bool(load().flashnorm_strategy_available(context(cuda_device(device)), STRATEGIES[strategy]))


def flashnorm_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    eps: float,
    splits: Sequence[int] | None = None,
    strategy: str = "auto",
    out: list[torch.Tensor] | None = None,
    *,
    statistic: str = "rms",
    bias: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """``(x · w)[:, split_i] * s + bias[split_i]`` for each split, on the current stream, with s the
    row statistic: ``rsqrt(mean(x², -1) + eps)`` (``statistic="rms"``) or, w's columns centred,
    ``rsqrt(mean((x - mean(x))², -1) + eps)`` (``"variance"``: LayerNorm).

    x is [..., K] (flattened to [M, K]; made contiguous if it is not), w is [K, N] row-major
    contiguous with the norm gain already folded in, ``splits`` are column counts summing to N
    (None: one output), ``bias`` is None or a contiguous float32 [N] on x's device. Returns one
    tensor [..., N_i] per split; ``out`` may supply them (contiguous, right shape, dtype and device)
    so that nothing is allocated for outputs. Where column views of one output serve the caller (q,
    k, v as ``(x @ W).split(...)`` gives them), one split is faster beyond the fused kernel's rows:
    one GEMM covers all of N (docs/BENCHMARKS.md, "One output").
    """
    return _library_call(x, None, w, eps, splits, strategy, out, statistic=statistic, bias=bias)[1]


def flashnorm_add_matmul(
    x: torch.Tensor,
    residual: torch.Tensor,
    w: torch.Tensor,
    eps: float,
    splits: Sequence[int] | None = None,
    strategy: str = "auto",
    out: list[torch.Tensor] | None = None,
    *,
    statistic: str = "rms",
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The residual add in front of the norm, as a decoder layer has it: ``h = x + residual``
    (rounded to x's dtype, as that add computes) and ``flashnorm_matmul(h, w, eps, splits)``, in
    one library call. Returns ``(h, outputs)``, h shaped like x. The fused kernel forms h as it
    reads x and writes it from the same launch; the other strategies run the add first. ``out``
    may supply ``[h, *outputs]`` (contiguous; h must not overlap x or residual). ``statistic`` and
    ``bias`` as in ``flashnorm_matmul``."""
    if out is not None and len(out) < 1:
        raise FlashNormError("out must hold the sum h and one tensor per split")
    return _library_call(
        x, residual, w, eps, splits, strategy, out and out[1:], out and out[0], statistic=statistic, bias=bias
    )


def _library_call(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    w: torch.Tensor,
    eps: float,
    splits: Sequence[int] | None,
    strategy: str,
    out: list[torch.Tensor] | None,
    out_sum: torch.Tensor | None = None,
    *,
    statistic: str = "rms",
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """flashnorm_matmul (residual None) or flashnorm_add_matmul: (the sum or None, the outputs)."""
    splits = checked_splits(x, w, splits, strategy)
    check_statistic(statistic)
    check_bias(x, w, bias)
    if not x.is_cuda:
        raise FlashNormError(f"x and w are on {x.device}; flashnorm_matmul needs a CUDA device")
    k = w.shape[0]
    lead_shape = tuple(x.shape[:-1])
    x2d = x.reshape(-1, k).contiguous()
    m = x2d.shape[0]
    if residual is not None:
        check_like_x(x, residual)
        residual2d = residual.reshape(-1, k).contiguous()
        if out_sum is None:
            total = torch.empty_like(x2d)
        else:
            check_like_x(x, out_sum, "the sum's output tensor")
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
    lib = load()
    handle = context(x.device)
    # multiprocessors 0, the device's own, in the size and the call alike: the size asks the current
    # device, the call its context's, and the call refuses to run where they are not one device.
    problem = _problem(m, k, splits, x.dtype, eps, strategy, statistic=statistic)
    workspace_bytes = lib.flashnorm_workspace_size(ctypes.byref(problem))
    workspace = torch.empty(max(workspace_bytes, 1), dtype=torch.uint8, device=x.device)
    pointers = (ctypes.c_void_p * MAX_OUTPUTS)(*[tensor.data_ptr() for tensor in out])
    stream = torch.cuda.current_stream(x.device).cuda_stream
    bias_pointer = None if bias is None else bias.data_ptr()
    workspace_args = (pointers, workspace.data_ptr(), workspace_bytes, stream)
    if residual is None:
        status = lib.flashnorm_matmul(
            handle, ctypes.byref(problem), x2d.data_ptr(), w.data_ptr(), bias_pointer, *workspace_args
        )
    else:
        status = lib.flashnorm_add_matmul(
            handle,
            ctypes.byref(problem),
            x2d.data_ptr(),
            residual2d.data_ptr(),
            total.data_ptr(),
            w.data_ptr(),
            bias_pointer,
            *workspace_args,
        )
    if status != Status.OK:
        detail = lib.flashnorm_context_last_error(handle).decode()
        raise FlashNormError(f"flashnorm_matmul failed ({status_text(lib, status)}): {detail}")
    return (None if residual is None else total.view(x.shape)), out


def check_like_x(x: torch.Tensor, tensor: torch.Tensor, name: str = "residual") -> None:
    """`tensor` (the residual, or the sum's output) must have x's shape, dtype and device."""
    if tensor.shape != x.shape or tensor.dtype != x.dtype or tensor.device != x.device:
        raise FlashNormError(
            f"{name} {tuple(tensor.shape)} {tensor.dtype} {tensor.device} does not match "
            f"x {tuple(x.shape)} {x.dtype} {x.device}"
        )


def check_bias(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    """`bias`, where given, is a contiguous float32 [N] on x's device (N = w's columns)."""
    if bias is None:
        return
    if bias.dtype != torch.float32 or bias.dim() != 1 or bias.shape[0] != w.shape[-1] or not bias.is_contiguous():
        raise FlashNormError(
            f"bias must be a contiguous float32 [{w.shape[-1]}], got {bias.dtype} {tuple(bias.shape)}"
        )
    if bias.device != x.device:
        raise FlashNormError(f"bias ({bias.device}) must be on x's device ({x.device})")


def checked_splits(x: torch.Tensor, w: torch.Tensor, splits: Sequence[int] | None, strategy: str) -> list[int]:
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
