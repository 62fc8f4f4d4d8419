"""Shared pieces of the kernel-library GPU tests: the float64 reference, the error measure,
fresh random inputs, and the per-dtype tolerances."""

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
