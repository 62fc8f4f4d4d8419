"""Shared pieces of the kernel-library GPU tests: the float64 references (RMSNorm and LayerNorm, with
a bias), the error measures, fresh random inputs, and the per-dtype tolerances."""

from __future__ import annotations

import torch

# Row-wise ‖got − ref‖ / ‖ref‖ bounds: fp32 stays fp32 arithmetic (no TF32); 16-bit outputs carry
# one rounding (two for the bf16 two-stream path, whose GEMM product is bf16; prenorm's rounding of
# x̂ is in its reference, see strategy_reference).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def cuda_ops_module():
    """The binding with its library loaded: a missing library fails the test, never skips it."""
    from flashnorm import cuda_ops

    cuda_ops.warm_up()
    return cuda_ops


def random_inputs(
    generator: torch.Generator, m: int, k: int, n: int, dtype: torch.dtype, device: str = "cuda"
) -> tuple[torch.Tensor, torch.Tensor]:
    """x with row norms spread over 10^-4 .. 10 (tiny rows make eps matter) and W* ~ N(0, 1/k)."""
    x = torch.randn(m, k, generator=generator, device=device, dtype=torch.float64)
    exponents = torch.empty(m, 1, device=device, dtype=torch.float64).uniform_(-4.0, 1.0, generator=generator)
    x = (x * torch.pow(10.0, exponents)).to(dtype)
    w = (torch.randn(k, n, generator=generator, device=device, dtype=torch.float64) / k**0.5).to(dtype)
    return x, w


def reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """(x · W*) ⊙ rsqrt(mean(x²) + eps) in float64, from the dtype-rounded inputs."""
    x64 = x.double()
    inv_rms = torch.rsqrt(x64.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (x64 @ w.double()) * inv_rms


def prenorm_reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x̂ · W* in float64 with x̂ = x ⊙ rsqrt(mean(x²) + eps) rounded once to x's dtype: the prenorm
    strategy's documented arithmetic (the one rounding F.rms_norm + GEMM has too)."""
    x64 = x.double()
    inv_rms = torch.rsqrt(x64.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (x64 * inv_rms).to(x.dtype).double() @ w.double()


def strategy_reference(cuda_ops, x: torch.Tensor, w: torch.Tensor, eps: float, splits, strategy: str) -> torch.Tensor:
    """The float64 result `strategy` (AUTO resolved first) must match within TOLERANCE: `reference`,
    or `prenorm_reference` for prenorm. x is [M, K]."""
    if strategy == "auto":
        strategy = cuda_ops.resolve_strategy(x.shape[0], x.shape[1], w.shape[1], x.dtype, splits)
    return prenorm_reference(x, w, eps) if strategy == "prenorm" else reference(x, w, eps)


def magnitude_errors(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-row ‖got − exact‖ / ‖|x̂|·|W*|‖: the error of x̂'s rounding measured against the sum of
    absolute terms it can move (a cancelling dot product has a small result but not a small
    error). NaN or Inf in a row gives inf."""
    x64 = x.double()
    normalized = x64 * torch.rsqrt(x64.pow(2).mean(dim=-1, keepdim=True) + eps)
    exact = normalized @ w.double()
    scale = torch.linalg.vector_norm(normalized.abs() @ w.double().abs(), dim=-1).clamp_min(1e-300)
    error = torch.linalg.vector_norm(got.double() - exact, dim=-1) / scale
    return torch.where(torch.isfinite(got.double()).all(dim=-1), error, torch.full_like(error, float("inf")))


def row_errors(got: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Per-row relative error; NaN or Inf anywhere in a row (an unwritten output) gives inf."""
    got64 = got.double()
    error = torch.linalg.vector_norm(got64 - expected, dim=-1) / torch.linalg.vector_norm(expected, dim=-1).clamp_min(
        1e-300
    )
    return torch.where(torch.isfinite(got64).all(dim=-1), error, torch.full_like(error, float("inf")))


def generator_from(rng) -> torch.Generator:
    """A CUDA generator seeded from the test's fresh `rng` fixture."""
    generator = torch.Generator(device="cuda")
    generator.manual_seed(int(rng.integers(0, 2**63 - 1)))
    return generator


def statistic_scale(x64: torch.Tensor, eps: float, statistic: str = "rms") -> torch.Tensor:
    """The row scale [..., 1] in float64: rsqrt(mean(x²) + eps), or for "variance"
    rsqrt(mean((x − mean x)²) + eps)."""
    centred = x64 - x64.mean(dim=-1, keepdim=True) if statistic == "variance" else x64
    return torch.rsqrt(centred.pow(2).mean(dim=-1, keepdim=True) + eps)


def centred_weight(generator: torch.Generator, k: int, n: int, dtype: torch.dtype, device: str = "cuda") -> torch.Tensor:
    """W* ~ N(0, 1/k) whose columns sum to exactly zero in `dtype` too: its rows come in opposite pairs
    (a row and its negation, in a random order; one zero row for odd k), so x·W* = (x − mean x)·W*
    holds for the rounded weights as the fold's centring promises, and every strategy computes
    LayerNorm itself."""
    half = torch.randn(k // 2, n, generator=generator, device=device, dtype=torch.float64) / k**0.5
    rows = [half, -half] + ([torch.zeros(1, n, device=device, dtype=torch.float64)] if k % 2 else [])
    order = torch.randperm(k, generator=generator, device=device)
    return torch.cat(rows)[order].to(dtype)


def random_bias(generator: torch.Generator, n: int, device: str = "cuda") -> torch.Tensor:
    """A float32 bias ~ N(0, 1) per output column (the fold's c* = b·W + c)."""
    return torch.randn(n, generator=generator, device=device, dtype=torch.float32)


def norm_reference(
    x: torch.Tensor, w: torch.Tensor, eps: float, statistic: str = "rms", bias: torch.Tensor | None = None
) -> torch.Tensor:
    """(x · W*) ⊙ s + bias in float64 from the dtype-rounded inputs (the op's definition)."""
    x64 = x.double()
    y = (x64 @ w.double()) * statistic_scale(x64, eps, statistic)
    return y if bias is None else y + bias.double()


def prenorm_norm_reference(
    x: torch.Tensor, w: torch.Tensor, eps: float, statistic: str = "rms", bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x̂ · W* + bias in float64 with x̂ = x ⊙ s (variance: (x − mean) ⊙ s) rounded once to x's dtype:
    prenorm's documented arithmetic (F.layer_norm + F.linear's)."""
    x64 = x.double()
    centred = x64 - x64.mean(dim=-1, keepdim=True) if statistic == "variance" else x64
    y = (centred * statistic_scale(x64, eps, statistic)).to(x.dtype).double() @ w.double()
    return y if bias is None else y + bias.double()


def magnitude_norm_errors(
    got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, eps: float, statistic: str, bias: torch.Tensor | None
) -> torch.Tensor:
    """Per-row ‖got − exact‖ / (‖|x|·|W*|‖ ⊙ s + ‖bias‖): the error against the sum of absolute terms
    it can move, for rows whose mean dwarfs their spread (where x·W* cancels in any fp32 accumulation
    but the centred input of prenorm does not). NaN or Inf in a row gives inf."""
    x64 = x.double()
    scale = statistic_scale(x64, eps, statistic)
    exact = norm_reference(x, w, eps, statistic, bias)
    magnitude = torch.linalg.vector_norm((x64.abs() @ w.double().abs()) * scale, dim=-1)
    if bias is not None:
        magnitude = magnitude + torch.linalg.vector_norm(bias.double())
    error = torch.linalg.vector_norm(got.double() - exact, dim=-1) / magnitude.clamp_min(1e-300)
    return torch.where(torch.isfinite(got.double()).all(dim=-1), error, torch.full_like(error, float("inf")))
