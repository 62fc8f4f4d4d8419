"""Calls captured into one CUDA graph on a non-default stream (every strategy, splits, a
delayed side stream, shapes seen first inside the capture), replayed 1000 times with new
inputs copied into the captured buffers before every replay; every replay must be right."""

from __future__ import annotations

import pytest
import torch

from kernel_reference import TOLERANCE, generator_from, cuda_ops_module, random_inputs, row_errors, strategy_reference

REPLAYS = 1000
# (m, k, splits, dtype, strategy, called before the capture)
CALLS = [
    (64, 576, [576, 192, 192], torch.bfloat16, "two_stream", True),
    (4, 576, [576, 192, 192], torch.bfloat16, "fused", True),
    (1, 130, [24, 72], torch.float16, "auto", True),
    (257, 100, [37], torch.float32, "auto", True),
    (16, 264, [40, 8, 16, 24], torch.bfloat16, "two_stream", False),
    (512, 576, [576, 192, 192], torch.bfloat16, "prenorm", True),
    (300, 130, [24, 72], torch.float16, "prenorm", False),
    (1024, 130, [24, 72], torch.float32, "auto", True),  # AUTO picks prenorm (fp32, M >= 1024)
]
# Where the build and device have it: both tile configurations, its GEMM launched with PDL inside
# the graph.
EPILOGUE_SCALE_CALLS = [
    (64, 576, [576, 192, 192], torch.bfloat16, "epilogue_scale", True),
    (300, 264, [32, 32, 32, 8], torch.float16, "epilogue_scale", False),
]


@pytest.mark.gpu
def test_captured_calls_replay_correctly(rng):
    cuda_ops = cuda_ops_module()
    calls = CALLS + (EPILOGUE_SCALE_CALLS if cuda_ops.strategy_available("epilogue_scale") else [])
    generator = generator_from(rng)
    eps = 1e-5
    static_x, weights, static_out, banks, results = [], [], [], [], []
    for m, k, splits, dtype, strategy, warm in calls:
        x_bank, w = random_inputs(generator, REPLAYS * m, k, sum(splits), dtype)
        banks.append(x_bank.reshape(REPLAYS, m, k))
        weights.append(w)
        static_x.append(torch.empty(m, k, dtype=dtype, device="cuda"))
        static_out.append([torch.empty(m, size, dtype=dtype, device="cuda") for size in splits])
        results.append(torch.full((REPLAYS, m, sum(splits)), float("nan"), dtype=dtype, device="cuda"))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    cuda_ops.set_side_delay(50_000)
    try:
        with torch.cuda.stream(stream):
            for index, (m, k, splits, dtype, strategy, warm) in enumerate(calls):
                static_x[index].copy_(banks[index][0])
                if warm:
                    cuda_ops.flashnorm_matmul(static_x[index], weights[index], eps, splits, strategy, static_out[index])
            stream.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                for index, (m, k, splits, dtype, strategy, warm) in enumerate(calls):
                    cuda_ops.flashnorm_matmul(static_x[index], weights[index], eps, splits, strategy, static_out[index])
            for replay in range(REPLAYS):
                for index in range(len(calls)):
                    static_x[index].copy_(banks[index][replay])
                graph.replay()
                for index in range(len(calls)):
                    results[index][replay].copy_(torch.cat(static_out[index], dim=-1))
        stream.synchronize()
    finally:
        cuda_ops.set_side_delay(0)

    for index, (m, k, splits, dtype, strategy, warm) in enumerate(calls):
        x_all = banks[index].reshape(REPLAYS * m, k)
        expected = strategy_reference(cuda_ops, x_all, weights[index], eps, splits, strategy)
        errors = row_errors(results[index].reshape(REPLAYS * m, -1), expected).reshape(REPLAYS, m)
        bad = (errors > TOLERANCE[dtype]).any(dim=1).nonzero().flatten().tolist()
        assert not bad, (
            f"call {index} (m={m} k={k} {dtype} {strategy}): {len(bad)} of {REPLAYS} replays wrong, "
            f"first {bad[:10]}, worst row error {errors.max().item():.3g}"
        )
