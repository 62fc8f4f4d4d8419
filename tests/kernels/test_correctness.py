"""Every strategy of the kernel library against a float64 reference: all dtypes, M from 1 to
4096, K and N not multiples of 8 or 16, fan-out splits, rows with tiny norms (eps matters),
outputs poisoned with NaN before every call. Prenorm is held to its documented arithmetic (x̂
rounded once to the I/O dtype) and, like every strategy, to the exact math relative to the
magnitude of the terms (kernel_reference.magnitude_errors)."""

from __future__ import annotations

import pytest
import torch

from kernel_reference import (
    TOLERANCE,
    generator_from,
    cuda_ops_module,
    magnitude_errors,
    prenorm_reference,
    random_inputs,
    reference,
    row_errors,
    strategy_reference,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ROWS = [1, 2, 3, 7, 16, 64, 257, 1024, 4096]
STRATEGIES = ["auto", "two_stream", "fused", "prenorm"]
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
    cuda_ops = cuda_ops_module()
    generator = generator_from(rng)
    for k, splits in SHAPES:
        eps = float(rng.choice([1e-6, 1e-5, 1e-2]))
        x, w = random_inputs(generator, m, k, sum(splits), dtype)
        outputs = [torch.full((m, size), float("nan"), dtype=dtype, device="cuda") for size in splits]
        returned = cuda_ops.flashnorm_matmul(x, w, eps, splits=splits, strategy=strategy, out=outputs)
        expected = strategy_reference(cuda_ops, x, w, eps, splits, strategy)
        assert all(a is b for a, b in zip(returned, outputs))
        for got, wanted in zip(outputs, torch.split(expected, splits, dim=-1)):
            worst = row_errors(got, wanted).max().item()
            assert worst <= TOLERANCE[dtype], (
                f"m={m} k={k} splits={splits} {dtype} {strategy} eps={eps}: worst row error {worst:.3g}"
            )
        worst = magnitude_errors(torch.cat(outputs, dim=-1), x, w, eps).max().item()
        assert worst <= TOLERANCE[dtype], (
            f"m={m} k={k} splits={splits} {dtype} {strategy} eps={eps}: worst error vs exact math {worst:.3g}"
        )


def assert_fused_matches_reference(cuda_ops, generator, m, k, splits, dtype, label: str = "") -> None:
    """One fused call on fresh random inputs into NaN-poisoned outputs, against float64."""
    x, w = random_inputs(generator, m, k, sum(splits), dtype)
    outputs = [torch.full((m, size), float("nan"), dtype=dtype, device="cuda") for size in splits]
    cuda_ops.flashnorm_matmul(x, w, 1e-5, splits=splits, strategy="fused", out=outputs)
    for got, wanted in zip(outputs, torch.split(reference(x, w, 1e-5), splits, dim=-1)):
        worst = row_errors(got, wanted).max().item()
        assert worst <= TOLERANCE[dtype], f"{label} m={m} k={k} splits={splits} {dtype}: worst row error {worst:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [1, 7, 16, 33])
def test_fused_long_k_and_wide_n(m, dtype, rng):
    """Long K (the fused kernel's copy pipeline wraps many times) and wide N (4, 2 and 1 blocks per
    column strip on an H200), with a K tail that is not a multiple of 16."""
    cuda_ops = cuda_ops_module()
    generator = generator_from(rng)
    for k, splits in [(4096, [8192]), (2050, [4104, 4096]), (1040, [40000])]:
        assert_fused_matches_reference(cuda_ops, generator, m, k, splits, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("cluster_size", [1, 2, 4, 8])
@pytest.mark.parametrize("strip_cols", [32, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_fused_every_strip_and_cluster(dtype, strip_cols, cluster_size, rng):
    """Every tensor-core layout the automatic choice may pick, forced: N not a multiple of the
    strip, K tails, one and two token groups, and a K long enough that each warp's copy ring wraps."""
    cuda_ops = cuda_ops_module()
    generator = generator_from(rng)
    cuda_ops.set_fused_tuning(strip_cols, cluster_size)
    try:
        for m in (1, 5, 9, 16):
            for k, splits in [(264, [40, 8, 16, 24]), (130, [24, 72]), (2050, [4104, 8])]:
                assert_fused_matches_reference(
                    cuda_ops, generator, m, k, splits, dtype, f"strip={strip_cols} cluster={cluster_size}"
                )
    finally:
        cuda_ops.set_fused_tuning(0, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_misaligned_outputs(dtype, strategy, rng):
    """Outputs that start 1, 3 and 5 elements into one buffer (contiguous, not 16-byte aligned):
    the library GEMMs that write them directly (prenorm) must pick kernels those addresses allow."""
    cuda_ops = cuda_ops_module()
    generator = generator_from(rng)
    m, k, splits = 300, 256, [64, 40, 24]
    x, w = random_inputs(generator, m, k, sum(splits), dtype)
    storage = torch.full((m * sum(splits) + 16,), float("nan"), dtype=dtype, device="cuda")
    outputs, start = [], 1
    for size in splits:
        outputs.append(storage[start : start + m * size].view(m, size))
        start += m * size + 2
    cuda_ops.flashnorm_matmul(x, w, 1e-5, splits=splits, strategy=strategy, out=outputs)
    expected = strategy_reference(cuda_ops, x, w, 1e-5, splits, strategy)
    for got, wanted in zip(outputs, torch.split(expected, splits, dim=-1)):
        worst = row_errors(got, wanted).max().item()
        assert worst <= TOLERANCE[dtype], f"{dtype} {strategy}: worst row error {worst:.3g}"


# Output placements in one poisoned buffer: (first output's element, elements left between one
# output's end and the next one's start), outputs in split order; None: in reverse order.
PLACEMENTS = {
    "ascending": (0, [64, 64]),
    "ascending-unaligned": (1, [5, 5]),
    "touching": (0, [0, 0]),
    "uneven-gaps": (0, [8, 24]),
    "descending": None,
}


@pytest.mark.gpu
@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("splits", [[96, 96], [64, 32, 32], [48, 48, 48]], ids=str)
def test_prenorm_equal_splits_in_any_memory_order(splits, dtype, placement, rng):
    """Prenorm runs consecutive equal-width splits as one pointer-array batched GEMM, whatever
    the placement of their outputs: each output must be right and nothing between or around them
    written."""
    cuda_ops = cuda_ops_module()
    generator = generator_from(rng)
    m, k = 37, 200
    x, w = random_inputs(generator, m, k, sum(splits), dtype)
    sizes = [m * width for width in splits]
    storage = torch.full((sum(sizes) + 64 * len(splits) + 64,), float("nan"), dtype=dtype, device="cuda")
    starts = []
    if PLACEMENTS[placement] is None:
        start = storage.numel() - 8
        for size in sizes:
            start -= size + 8
            starts.append(start)
    else:
        start, gaps = PLACEMENTS[placement]
        for size, gap in zip(sizes, gaps + [0]):
            starts.append(start)
            start += size + gap
    outputs = [storage[begin : begin + size].view(m, width) for begin, size, width in zip(starts, sizes, splits)]
    cuda_ops.flashnorm_matmul(x, w, 1e-5, splits=splits, strategy="prenorm", out=outputs)
    for got, wanted in zip(outputs, torch.split(prenorm_reference(x, w, 1e-5), splits, dim=-1)):
        worst = row_errors(got, wanted).max().item()
        assert worst <= TOLERANCE[dtype], f"{placement} {splits} {dtype}: worst row error {worst:.3g}"
    written = torch.zeros(storage.numel(), dtype=torch.bool, device="cuda")
    for begin, size in zip(starts, sizes):
        written[begin : begin + size] = True
    assert storage[~written].isnan().all(), f"{placement} {splits} {dtype}: wrote outside the outputs"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 300])
def test_prenorm_rows_longer_than_registers(m, dtype, rng):
    """K beyond what the normalize kernel keeps in registers (more than 1024 16-byte vectors per
    row): the second pass re-reads x; one K a vector multiple, one with a tail."""
    cuda_ops = cuda_ops_module()
    generator = generator_from(rng)
    per_vector = 128 // torch.finfo(dtype).bits  # elements in 16 bytes
    for k in (1025 * per_vector, 1025 * per_vector + 3):
        x, w = random_inputs(generator, m, k, 48, dtype)
        outputs = [torch.full((m, size), float("nan"), dtype=dtype, device="cuda") for size in (40, 8)]
        cuda_ops.flashnorm_matmul(x, w, 1e-5, splits=[40, 8], strategy="prenorm", out=outputs)
        for got, wanted in zip(outputs, torch.split(prenorm_reference(x, w, 1e-5), [40, 8], dim=-1)):
            worst = row_errors(got, wanted).max().item()
            assert worst <= TOLERANCE[dtype], f"m={m} k={k} {dtype}: worst row error {worst:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 300])
def test_prenorm_rows_at_the_one_warp_limit(m, dtype, rng):
    """The normalize kernel runs a row in one warp up to 128 16-byte vectors (K = 1024 in 16-bit,
    512 in fp32) and in its block-wide kernel beyond: the last K of one, the first of the other, and
    a short row (fewer vectors than lanes); two equal splits, so the kernel also writes the GEMM's
    pointer table."""
    cuda_ops = cuda_ops_module()
    generator = generator_from(rng)
    per_vector = 128 // torch.finfo(dtype).bits  # elements in 16 bytes
    for k in (128 * per_vector, 129 * per_vector, 3 * per_vector):
        x, w = random_inputs(generator, m, k, 96, dtype)
        outputs = [torch.full((m, 48), float("nan"), dtype=dtype, device="cuda") for _ in range(2)]
        cuda_ops.flashnorm_matmul(x, w, 1e-5, splits=[48, 48], strategy="prenorm", out=outputs)
        for got, wanted in zip(outputs, torch.split(prenorm_reference(x, w, 1e-5), [48, 48], dim=-1)):
            worst = row_errors(got, wanted).max().item()
            assert worst <= TOLERANCE[dtype], f"m={m} k={k} {dtype}: worst row error {worst:.3g}"


@pytest.mark.gpu
def test_leading_dimensions_and_allocated_outputs(rng):
    cuda_ops = cuda_ops_module()
    generator = generator_from(rng)
    x, w = random_inputs(generator, 2 * 3, 256, 96, torch.bfloat16)
    x = x.reshape(2, 3, 256)
    q, kv = cuda_ops.flashnorm_matmul(x, w, 1e-5, splits=[64, 32])
    assert q.shape == (2, 3, 64) and kv.shape == (2, 3, 32)
    expected = reference(x.reshape(6, 256), w, 1e-5)
    assert row_errors(torch.cat([q, kv], dim=-1).reshape(6, 96), expected).max().item() <= TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
def test_fused_tuning_rejects_unknown_layouts():
    from flashnorm.errors import FlashNormError

    cuda_ops = cuda_ops_module()
    with pytest.raises(FlashNormError, match="strip_cols must be"):
        cuda_ops.set_fused_tuning(64, 1)
    with pytest.raises(FlashNormError, match="cluster_size"):
        cuda_ops.set_fused_tuning(16, 3)


def test_rejects_bad_arguments_before_the_library():
    from flashnorm import cuda_ops
    from flashnorm.errors import FlashNormError

    x = torch.ones(2, 8)
    w = torch.ones(8, 4)
    with pytest.raises(FlashNormError, match="CUDA device"):
        cuda_ops.flashnorm_matmul(x, w, 1e-5)
    with pytest.raises(FlashNormError, match="one dtype"):
        cuda_ops.flashnorm_matmul(x, w.half(), 1e-5)


def test_missing_library_names_where_it_looked(monkeypatch, tmp_path):
    from flashnorm import cuda_ops
    from flashnorm.errors import FlashNormError

    missing = tmp_path / "libflashnorm.so"
    monkeypatch.setenv("FLASHNORM_LIBRARY", str(missing))
    monkeypatch.setattr(cuda_ops.abi, "_library", None)
    with pytest.raises(FlashNormError, match=str(missing)):
        cuda_ops.join_dropped()
