"""What Inductor (torch.compile) compiles the custom ops to: ``"auto"`` keeps the library call
where AUTO picks the fused kernel (or, up to its 16 rows, the epilogue-scale GEMM) and becomes
PyTorch ops elsewhere, for both statistics alike (AUTO picks alike for both; the LayerNorm picks
under Inductor are measured by benchmarks/encoder_step.py). Registered as Inductor decompositions
when this module is imported."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flashnorm.cuda_ops import ops  # noqa: F401  (registers torch.ops.flashnorm.library_matmul, the call kept)
from flashnorm.cuda_ops.library import resolve_strategy

# Where the fused kernel also does the residual add, Inductor keeps the library call up to
# _ADD_ONE_GROUP_ROWS rows (one 8-token B operand) everywhere, and up to 16 only while K·N is at
# most _ADD_TWO_GROUP_MAX_WEIGHT: with two B operands the add cost the fused kernel 0.9-1.8 µs on
# 576×3072, 2048×3072 and 2048×16384, which then lost to Inductor's add + norm kernel + cuBLAS at
# 12 and 16 rows; 0.3 µs on 576×960, which still won (H200, bf16, plugins/flashnorm/kernels/DESIGN.md,
# "The residual add beyond 8 rows").
_ADD_ONE_GROUP_ROWS = 8
_ADD_TWO_GROUP_MAX_WEIGHT = 1 << 20
# Up to the fused kernel's 16 rows AUTO picks the epilogue-scale GEMM only where that measured
# faster than the fused kernel, and there it also beat torch.compile's norm kernel + cuBLAS (H200,
# bf16, 16 rows: SmolLM2-135M gate|up 4.92 against 5.97 µs, Llama-3.2-1B gate|up 20.3 against 21.4,
# Llama-3.1-8B q|k|v 16.5 against 18.7; docs/history/2026-12-03-benchmarks.md, 2026-12-03 18:21 UTC): Inductor keeps
# that library call too.
_LIBRARY_EPILOGUE_SCALE_MAX_ROWS = 16


def _keeps_library_call(
    x: torch.Tensor, w: torch.Tensor, splits: list[int], strategy: str, residual_add: bool = False,
    statistic: str = "rms",
) -> bool:
    """Whether Inductor keeps the op as the library call (see ``inductor_form``); `residual_add`: the
    add_matmul op (see ``add_inductor_form``)."""
    if strategy != "auto" or x.device.type == "cpu" or not all(isinstance(d, int) for d in x.shape):
        return True
    rows = x.numel() // x.shape[-1]
    if rows == 0:
        return True
    picked = resolve_strategy(rows, x.shape[-1], w.shape[1], x.dtype, splits, statistic=statistic)
    if picked != "fused" and not (picked == "epilogue_scale" and rows <= _LIBRARY_EPILOGUE_SCALE_MAX_ROWS):
        return False
    if not residual_add or rows <= _ADD_ONE_GROUP_ROWS:
        return True
    return x.shape[-1] * w.shape[1] <= _ADD_TWO_GROUP_MAX_WEIGHT


def inductor_form(
    x: torch.Tensor,
    w: torch.Tensor,
    eps: float,
    splits: list[int],
    strategy: str,
    statistic: str = "rms",
    bias: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """What Inductor compiles ``torch.ops.flashnorm.matmul`` to: the library call
    (``flashnorm::library_matmul``) where AUTO picks the fused kernel (or, up to its 16 rows, the
    epilogue-scale GEMM), where the strategy is forced, on the CPU, or where the shape is not known
    at compile time; elsewhere ``prenorm_form``.

    Why: beyond the fused kernel's rows the library's strategies (two_stream, prenorm, and the
    epilogue-scale GEMM as measured end to end so far) lose to what Inductor makes of the prenorm
    arithmetic, the norm fused into the kernel that produces x and the GEMM on cuBLAS
    (docs/BENCHMARKS.md, "End-to-end decode step" and the kernel tables)."""
    if _keeps_library_call(x, w, splits, strategy, statistic=statistic):
        return torch.ops.flashnorm.library_matmul(x, w, eps, splits, strategy, statistic, bias)
    return prenorm_form(x, w, eps, splits, statistic, bias)


def prenorm_form(
    x: torch.Tensor,
    w: torch.Tensor,
    eps: float,
    splits: Sequence[int],
    statistic: str = "rms",
    bias: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """The prenorm strategy's arithmetic in PyTorch ops: x̂ = x ⊙ rsqrt(mean(x²)+eps) (for
    ``"variance"``, (x − mean) ⊙ rsqrt(mean((x − mean)²)+eps)) in fp32, rounded to x's dtype, then
    x̂·W* with the bias rounded to x's dtype added in the GEMM's epilogue (``addmm``, as F.linear
    adds it); one contiguous output per split."""
    x32 = x.float()
    if statistic == "variance":
        x32 = x32 - x32.mean(dim=-1, keepdim=True)
    normalized = (x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)).to(x.dtype)
    if bias is None:
        y = normalized @ w
    else:
        rows = normalized.reshape(-1, normalized.shape[-1])
        y = torch.addmm(bias.to(x.dtype), rows, w).view(*normalized.shape[:-1], w.shape[-1])
    if len(splits) == 1:
        return [y]
    return [part.contiguous() for part in y.split(list(splits), dim=-1)]


def add_inductor_form(
    x: torch.Tensor,
    residual: torch.Tensor,
    w: torch.Tensor,
    eps: float,
    splits: list[int],
    strategy: str,
    statistic: str = "rms",
    bias: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """What Inductor compiles ``torch.ops.flashnorm.add_matmul`` to: the library call where
    ``inductor_form`` keeps it (the fused kernel, which then also does the add) but for 9 to 16 rows
    on a larger W* (``_ADD_TWO_GROUP_MAX_WEIGHT``), elsewhere the add and ``prenorm_form`` in
    PyTorch ops, which Inductor fuses into one kernel before the GEMM."""
    if _keeps_library_call(x, w, splits, strategy, residual_add=True, statistic=statistic):
        return torch.ops.flashnorm.library_add_matmul(x, residual, w, eps, splits, strategy, statistic, bias)
    total = x + residual
    return [total, *prenorm_form(total, w, eps, splits, statistic, bias)]


def _register_inductor_form() -> None:
    from torch._inductor.decomposition import register_decomposition

    register_decomposition(torch.ops.flashnorm.matmul.default)(inductor_form)
    register_decomposition(torch.ops.flashnorm.add_matmul.default)(add_inductor_form)


_register_inductor_form()
