"""Every strategy of the kernel library against a float64 reference: all dtypes, M from 1 to
4096, K and N not multiples of 8 or 16, fan-out splits, rows with tiny norms (eps matters),
outputs poisoned with NaN before every call."""

from __future__ import annotations

import pytest
import torch

from kernel_reference import TOLERANCE, generator_from, kernels_module, random_inputs, reference, row_errors

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ROWS = [1, 2, 3, 7, 16, 64, 257, 1024, 4096]
STRATEGIES = ["auto", "two_stream", "fused"]
# (K, splits): tensor-core-eligible and not, K tails (not multiples of 16), N not a multiple of 8.
SHAPES = [
    (576, [576, 192, 192]),
    (96, [64]),
    (130, [24, 72]),
    (100, [37]),
    (33, [7, 13, 5]),
    (264, [40, 8, 16, 24]),
    (1000, [333, 667]),
]


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", ROWS)
def test_matches_float64_reference(m, dtype, strategy, rng):
    kernels = kernels_module()
    generator = generator_from(rng)
    for k, splits in SHAPES:
        eps = float(rng.choice([1e-6, 1e-5, 1e-2]))
        x, w = random_inputs(generator, m, k, sum(splits), dtype)
        outputs = [torch.full((m, size), float("nan"), dtype=dtype, device="cuda") for size in splits]
        returned = kernels.flashnorm_matmul(x, w, eps, splits=splits, strategy=strategy, out=outputs)
        expected = reference(x, w, eps)
        assert all(a is b for a, b in zip(returned, outputs))
        for got, wanted in zip(outputs, torch.split(expected, splits, dim=-1)):
            worst = row_errors(got, wanted).max().item()
            assert worst <= TOLERANCE[dtype], (
                f"m={m} k={k} splits={splits} {dtype} {strategy} eps={eps}: worst row error {worst:.3g}"
            )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [1, 7, 16, 33])
def test_fused_long_k_and_wide_n(m, dtype, rng):
    """Long K (the fused kernel's copy pipeline wraps many times) and wide N (one block per
    column strip), with a K tail that is not a multiple of 16."""
    kernels = kernels_module()
    generator = generator_from(rng)
    for k, splits in [(4096, [8192]), (2050, [4104, 4096])]:
        x, w = random_inputs(generator, m, k, sum(splits), dtype)
        outputs = [torch.full((m, size), float("nan"), dtype=dtype, device="cuda") for size in splits]
        kernels.flashnorm_matmul(x, w, 1e-5, splits=splits, strategy="fused", out=outputs)
        expected = reference(x, w, 1e-5)
        for got, wanted in zip(outputs, torch.split(expected, splits, dim=-1)):
            worst = row_errors(got, wanted).max().item()
            assert worst <= TOLERANCE[dtype], f"m={m} k={k} splits={splits} {dtype}: worst row error {worst:.3g}"


@pytest.mark.gpu
def test_leading_dimensions_and_allocated_outputs(rng):
    kernels = kernels_module()
    generator = generator_from(rng)
    x, w = random_inputs(generator, 2 * 3, 256, 96, torch.bfloat16)
    x = x.reshape(2, 3, 256)
    q, kv = kernels.flashnorm_matmul(x, w, 1e-5, splits=[64, 32])
    assert q.shape == (2, 3, 64) and kv.shape == (2, 3, 32)
    expected = reference(x.reshape(6, 256), w, 1e-5)
    assert row_errors(torch.cat([q, kv], dim=-1).reshape(6, 96), expected).max().item() <= TOLERANCE[torch.bfloat16]


def test_rejects_bad_arguments_before_the_library():
    from flashnorm import kernels
    from flashnorm.errors import FlashNormError

    x = torch.ones(2, 8)
    w = torch.ones(8, 4)
    with pytest.raises(FlashNormError, match="CUDA device"):
        kernels.flashnorm_matmul(x, w, 1e-5)
    with pytest.raises(FlashNormError, match="one dtype"):
        kernels.flashnorm_matmul(x, w.half(), 1e-5)


def test_missing_library_names_where_it_looked(monkeypatch, tmp_path):
    from flashnorm import kernels
    from flashnorm.errors import FlashNormError

    missing = tmp_path / "libflashnorm.so"
    monkeypatch.setenv("FLASHNORM_LIBRARY", str(missing))
    monkeypatch.setattr(kernels, "_library", None)
    with pytest.raises(FlashNormError, match=str(missing)):
        kernels.join_dropped()
