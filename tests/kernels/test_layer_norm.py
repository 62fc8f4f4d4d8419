"""The LayerNorm statistic and the bias in every strategy of the kernel library, against float64:
``y = (x · W*) ⊙ s + bias`` with ``s = rsqrt(mean((x − mean x)²) + eps)`` and W*'s columns centred
(summing to zero in the I/O dtype too: kernel_reference.centred_weight), and the RMS statistic with
a bias. Every dtype, M from 1 to 4096, K tails, fan-out splits, outputs poisoned with NaN; prenorm is
held to its documented arithmetic (x̂ rounded once). Then the numerics the issue asks about: rows
whose mean is 0, 10, 100 and 1000 times their spread, where mean(x²) − mean² cancels, measured as
the error of the row scale each strategy applied; a CUDA graph of LayerNorm calls replayed on fresh
inputs; and the residual add in front (the fused kernel shifts by the sum's first element)."""

from __future__ import annotations

import pytest
import torch

from kernel_reference import (
    TOLERANCE,
    centred_weight,
    cuda_ops_module,
    generator_from,
    magnitude_norm_errors,
    norm_reference,
    prenorm_norm_reference,
    random_bias,
    random_inputs,
    row_errors,
    statistic_scale,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ROWS = [1, 2, 7, 16, 64, 257, 1024, 4096]
STRATEGIES = ["auto", "two_stream", "fused", "prenorm", "epilogue_scale"]
# (statistic, with a bias): the RMS without one is test_correctness.py's.
MODES = [("variance", True), ("variance", False), ("rms", True)]
# (K, splits): ViT-B/16's q|k|v (one run of three equal splits: prenorm's batched GEMM), a K tail and
# N not a multiple of 8 (the fused kernel's CUDA-core fallback), the K tail of epilogue-scale's
# main-loop sums, and a split edge inside a tile.
SHAPES = [(768, [768, 768, 768]), (130, [24, 72]), (264, [32, 32, 224, 8]), (1000, [352, 648])]
MEAN_TO_SPREAD = [0.0, 10.0, 100.0, 1000.0]


def _skip_unavailable(cuda_ops, strategy: str, dtype: torch.dtype) -> None:
    if strategy == "epilogue_scale" and (dtype == torch.float32 or not cuda_ops.strategy_available(strategy)):
        pytest.skip("epilogue_scale: 16-bit operands, in builds with the CUTLASS kernel on compute capability 9.0")


def _runs_shape(strategy: str, k: int, splits: list[int]) -> bool:
    """Whether `strategy` takes this shape (epilogue_scale: K and N multiples of 8, splits at 32 columns)."""
    return strategy != "epilogue_scale" or not (k % 8 or sum(splits) % 8 or any(s % 32 for s in splits[:-1]))


def _reference(cuda_ops, x, w, eps, splits, strategy, statistic, bias) -> torch.Tensor:
    if strategy == "auto":
        strategy = cuda_ops.resolve_strategy(x.shape[0], x.shape[1], w.shape[1], x.dtype, splits, statistic=statistic)
    reference = prenorm_norm_reference if strategy == "prenorm" else norm_reference
    return reference(x, w, eps, statistic, bias)


def _inputs(generator, m, k, n, dtype, statistic, mean_to_spread=0.0):
    """x with row spreads over 10^-4 .. 10 (tiny rows make eps matter), shifted by ± mean_to_spread
    spreads; W* centred for the variance (any W* for the RMS)."""
    x, w = random_inputs(generator, m, k, n, dtype)
    if mean_to_spread:
        x64 = x.double()
        spread = x64.std(dim=-1, keepdim=True)
        sign = torch.where(torch.arange(m, device=x.device)[:, None] % 2 == 0, 1.0, -1.0).double()
        x = (x64 + sign * mean_to_spread * spread).to(dtype)
    if statistic == "variance":
        w = centred_weight(generator, k, n, dtype)
    return x, w


@pytest.mark.gpu
@pytest.mark.parametrize("statistic, with_bias", MODES, ids=[f"{s}-{'bias' if b else 'nobias'}" for s, b in MODES])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", ROWS)
def test_matches_float64_reference(m, dtype, strategy, statistic, with_bias, rng):
    cuda_ops = cuda_ops_module()
    _skip_unavailable(cuda_ops, strategy, dtype)
    generator = generator_from(rng)
    for k, splits in SHAPES:
        if not _runs_shape(strategy, k, splits):
            continue
        eps = float(rng.choice([1e-6, 1e-5, 1e-2]))
        x, w = _inputs(generator, m, k, sum(splits), dtype, statistic)
        bias = random_bias(generator, sum(splits)) if with_bias else None
        outputs = [torch.full((m, size), float("nan"), dtype=dtype, device="cuda") for size in splits]
        cuda_ops.flashnorm_matmul(x, w, eps, splits, strategy, outputs, statistic=statistic, bias=bias)
        expected = _reference(cuda_ops, x, w, eps, splits, strategy, statistic, bias)
        label = f"m={m} k={k} splits={splits} {dtype} {strategy} {statistic} bias={with_bias} eps={eps}"
        for got, wanted in zip(outputs, torch.split(expected, splits, dim=-1)):
            worst = row_errors(got, wanted).max().item()
            assert worst <= TOLERANCE[dtype], f"{label}: worst row error {worst:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_large_means_do_not_cancel_in_the_statistic(dtype, strategy, rng, capsys):
    """Rows x = ±μ + σ·z with μ/σ = 0, 10, 100, 1000 (W* centred exactly, a bias). The row scale each
    strategy applied is read back from its output by least squares against the float64 product
    (s_r ≈ ⟨y_r − b, z_r⟩ / ⟨z_r, z_r⟩, z = x·W*) and compared with float64 LayerNorm's. The shifted
    sums must keep it at the level of fp32 rounding at every mean, where the one-pass form
    mean(x²) − mean² (computed here in fp32 for comparison) loses about (μ/σ)²·2⁻²⁴: at 1000, several
    percent. The outputs must also match float64 against the magnitude of their terms (x·W*
    itself cancels in any fp32 accumulation at such means; prenorm's centred GEMM does not)."""
    cuda_ops = cuda_ops_module()
    _skip_unavailable(cuda_ops, strategy, dtype)
    generator = generator_from(rng)
    k, splits = 768, [768, 768, 768]
    m = 9 if strategy == "fused" else 300  # the fused kernel's two token groups; the others' tiles
    eps = 1e-6
    scale_bound = 1e-4 if dtype == torch.float32 else 2e-3
    lines = []
    for ratio in MEAN_TO_SPREAD:
        x, w = _inputs(generator, m, k, sum(splits), dtype, "variance", ratio)
        bias = random_bias(generator, sum(splits))
        outputs = cuda_ops.flashnorm_matmul(x, w, eps, splits, strategy, statistic="variance", bias=bias)
        got = torch.cat(outputs, dim=-1).double()
        x64 = x.double()
        product = x64 @ w.double()
        implied = ((got - bias.double()) * product).sum(-1) / (product * product).sum(-1)
        wanted = statistic_scale(x64, eps, "variance").squeeze(-1)
        scale_error = (implied / wanted - 1).abs().max().item()
        x32 = x.float()
        one_pass = torch.rsqrt((x32.pow(2).mean(-1) - x32.mean(-1).pow(2)).clamp_min(0) + eps).double()
        one_pass_error = (one_pass / wanted - 1).abs().max().item()
        magnitude = magnitude_norm_errors(got, x, w, eps, "variance", bias).max().item()
        lines.append(f"{strategy} {dtype} mean/spread {ratio:g}: scale error {scale_error:.2e} "
                     f"(one-pass fp32 form {one_pass_error:.2e}), output error vs magnitude {magnitude:.2e}")
        assert scale_error <= scale_bound, lines[-1]
        assert magnitude <= TOLERANCE[dtype], lines[-1]
    with capsys.disabled():
        print("\n" + "\n".join(lines))


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["auto", "fused", "two_stream", "prenorm", "epilogue_scale"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_residual_add_in_front(dtype, strategy, rng):
    """flashnorm_add_matmul with the variance and a bias: the sum is x + residual bit for bit, the
    outputs LayerNorm of the sum (the fused kernel shifts its sums by the sum's first element, formed as
    it reads x)."""
    cuda_ops = cuda_ops_module()
    _skip_unavailable(cuda_ops, strategy, dtype)
    generator = generator_from(rng)
    for m in (1, 9, 64):
        for k, splits in SHAPES[:3]:
            if not _runs_shape(strategy, k, splits):
                continue
            x, w = _inputs(generator, m, k, sum(splits), dtype, "variance", 10.0)
            residual, _ = random_inputs(generator, m, k, 1, dtype)
            bias = random_bias(generator, sum(splits))
            total, outputs = cuda_ops.flashnorm_add_matmul(
                x, residual, w, 1e-5, splits, strategy, statistic="variance", bias=bias
            )
            wanted_sum = cuda_ops.reference_add(x, residual)
            assert torch.equal(total, wanted_sum), f"m={m} k={k} {dtype} {strategy}: sum differs from x + residual"
            expected = _reference(cuda_ops, wanted_sum, w, 1e-5, splits, strategy, "variance", bias)
            for got, wanted in zip(outputs, torch.split(expected, splits, dim=-1)):
                worst = row_errors(got, wanted).max().item()
                assert worst <= TOLERANCE[dtype], f"m={m} k={k} {dtype} {strategy}: worst row error {worst:.3g}"


REPLAYS = 200
# (m, k, splits, dtype, strategy): LayerNorm calls with a bias, captured after one call each.
CAPTURED = [
    (4, 768, [768, 768, 768], torch.bfloat16, "fused"),
    (64, 768, [768, 768, 768], torch.bfloat16, "two_stream"),
    (512, 768, [768, 768, 768], torch.bfloat16, "prenorm"),
    (300, 130, [24, 72], torch.float32, "auto"),
    (197, 768, [3072], torch.float16, "auto"),
]
CAPTURED_EPILOGUE_SCALE = [(197, 768, [768, 768, 768], torch.bfloat16, "epilogue_scale"),
                           (64, 1032, [1024, 1024], torch.float16, "epilogue_scale")]


@pytest.mark.gpu
def test_captured_layer_norm_calls_replay_correctly(rng):
    """LayerNorm calls with a bias captured into one CUDA graph on a non-default stream, the side
    stream delayed, replayed with fresh inputs copied in before each replay: every replay right."""
    cuda_ops = cuda_ops_module()
    calls = CAPTURED + (CAPTURED_EPILOGUE_SCALE if cuda_ops.strategy_available("epilogue_scale") else [])
    generator = generator_from(rng)
    eps = 1e-6
    banks, weights, biases, static_x, static_out, results = [], [], [], [], [], []
    for m, k, splits, dtype, strategy in calls:
        x_bank, w = _inputs(generator, REPLAYS * m, k, sum(splits), dtype, "variance", 10.0)
        banks.append(x_bank.reshape(REPLAYS, m, k))
        weights.append(w)
        biases.append(random_bias(generator, sum(splits)))
        static_x.append(banks[-1][0].clone())
        static_out.append([torch.empty(m, size, dtype=dtype, device="cuda") for size in splits])
        results.append(torch.full((REPLAYS, m, sum(splits)), float("nan"), dtype=dtype, device="cuda"))

    def run_all():
        for index, (m, k, splits, dtype, strategy) in enumerate(calls):
            cuda_ops.flashnorm_matmul(static_x[index], weights[index], eps, splits, strategy, static_out[index],
                                      statistic="variance", bias=biases[index])

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    cuda_ops.set_side_delay(50_000)
    try:
        with torch.cuda.stream(stream):
            run_all()
            stream.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                run_all()
            for replay in range(REPLAYS):
                for index in range(len(calls)):
                    static_x[index].copy_(banks[index][replay])
                graph.replay()
                for index in range(len(calls)):
                    results[index][replay].copy_(torch.cat(static_out[index], dim=-1))
        stream.synchronize()
    finally:
        cuda_ops.set_side_delay(0)
    for index, (m, k, splits, dtype, strategy) in enumerate(calls):
        x_all = banks[index].reshape(REPLAYS * m, k)
        expected = _reference(cuda_ops, x_all, weights[index], eps, splits, strategy, "variance", biases[index])
        errors = row_errors(results[index].reshape(REPLAYS * m, -1), expected).reshape(REPLAYS, m)
        bad = (errors > TOLERANCE[dtype]).any(dim=1).nonzero().flatten().tolist()
        assert not bad, (f"call {index} (m={m} k={k} {dtype} {strategy}): {len(bad)} of {REPLAYS} replays wrong, "
                         f"worst row error {errors.max().item():.3g}")


def test_bias_and_statistic_are_checked_before_the_library():
    from flashnorm import cuda_ops
    from flashnorm.errors import FlashNormError

    x, w = torch.ones(2, 8), torch.ones(8, 4)
    with pytest.raises(FlashNormError, match="statistic 'layer' is unknown"):
        torch.ops.flashnorm.matmul(x, w, 1e-5, [4], "auto", "layer")
    with pytest.raises(FlashNormError, match="contiguous float32 \\[4\\]"):
        torch.ops.flashnorm.matmul(x, w, 1e-5, [4], "auto", "variance", torch.ones(4, dtype=torch.float16))
    with pytest.raises(FlashNormError, match="contiguous float32 \\[4\\]"):
        torch.ops.flashnorm.matmul(x, w, 1e-5, [4], "auto", "variance", torch.ones(5))
    with pytest.raises(FlashNormError, match="statistic 'layer' is unknown"):
        cuda_ops.resolve_strategy(4, 8, 4, torch.bfloat16, statistic="layer")
