"""The joins under load. two_stream: the side-stream RMS is held back (test hook) long enough that
a post-scale not ordered after it reads the previous call's inv_rms. epilogue_scale, at 8 rows
one kernel (the row sums in the GEMM's main loop): the sums of a stage must wait for its full
barrier, or they read the A tile the previous call left in shared memory, and the producer's first
load must wait for the kernel before it (griddepcontrol.wait: the GEMM starts early through
programmatic dependent launch), or it reads x before the residual add wrote it; on K = 1032 at 64
rows (64-row tiles) and 320 rows (128-row tiles) its reduction kernel, once it has let the GEMM
start, is held back as two_stream's RMS is, so an epilogue that does not wait for it
(griddepcontrol.wait) reads stale scales. prenorm: the
narrow splits' GEMMs on the side stream are held back as two_stream's RMS is, so a caller's next
operation not ordered after them reads the previous call's outputs. Every call's inputs have
different row norms, so such a stale read is wrong by orders of magnitude. 1000 calls run back to
back on a non-default stream and every one must be right; each strategy runs both entry points, the
plain call and the one with the residual add in front (whose side work reads the sum the add kernel
wrote on the main stream just before), and the LayerNorm statistic with a bias where its join is its
own code (two_stream's and epilogue_scale's reductions, epilogue_scale's main-loop sums, prenorm).

Mutation proof: the same test against a build made with -DFLASHNORM_TESTING_DROP_JOIN=ON
(FLASHNORM_LIBRARY pointing at it) must FAIL; plugins/flashnorm/tests/run_gpu.sh runs both.
"""

from __future__ import annotations

import pytest
import torch

from kernel_reference import (
    TOLERANCE,
    centred_weight,
    cuda_ops_module,
    generator_from,
    norm_reference,
    random_bias,
    random_inputs,
    row_errors,
)

CALLS = 1000
SIDE_DELAY_CYCLES = 200_000  # ≈100 µs at H200 clocks: far longer than the GEMM it overlaps


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("strategy", "dtype", "m", "k", "statistic"),
    [
        ("two_stream", torch.bfloat16, 8, 512, "rms"),
        ("two_stream", torch.float32, 8, 512, "rms"),
        ("prenorm", torch.bfloat16, 8, 512, "rms"),
        ("prenorm", torch.float32, 8, 512, "rms"),
        ("epilogue_scale", torch.bfloat16, 8, 512, "rms"),
        ("epilogue_scale", torch.bfloat16, 64, 1032, "rms"),
        ("epilogue_scale", torch.bfloat16, 320, 1032, "rms"),
        ("two_stream", torch.bfloat16, 8, 512, "variance"),
        ("prenorm", torch.bfloat16, 8, 512, "variance"),
        ("epilogue_scale", torch.bfloat16, 8, 512, "variance"),
        ("epilogue_scale", torch.bfloat16, 64, 1032, "variance"),
    ],
    ids=str,
)
@pytest.mark.parametrize("residual_add", [False, True], ids=["matmul", "add_matmul"])
def test_back_to_back_calls_with_delayed_side_stream_stay_correct(dtype, strategy, m, k, statistic, residual_add, rng):
    cuda_ops = cuda_ops_module()
    if not cuda_ops.strategy_available(strategy):
        pytest.skip(f"{strategy} is not in this library build or not on this device")
    generator = generator_from(rng)
    splits = [256, 64, 64]
    n = sum(splits)
    xs, w = random_inputs(generator, CALLS * m, k, n, dtype)
    xs = xs.reshape(CALLS, m, k)
    # LayerNorm: W* centred and a bias (none for the RMS, as before).
    bias = random_bias(generator, n) if statistic == "variance" else None
    if statistic == "variance":
        w = centred_weight(generator, k, n, dtype)
    residuals = random_inputs(generator, CALLS * m, k, 1, dtype)[0].reshape(CALLS, m, k) if residual_add else None
    outputs = torch.full((CALLS, m, n), float("nan"), dtype=dtype, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    # Every call's results stay allocated until the end: under the mutant, prenorm's side stream
    # writes them late, and a freed result's memory could by then hold another call's cuBLASLt
    # workspace (whose split-K counters, so overwritten, can stall the GPU instead of failing).
    results = []
    cuda_ops.set_side_delay(SIDE_DELAY_CYCLES)
    try:
        with torch.cuda.stream(stream):
            for call in range(CALLS):
                pieces = list(torch.split(outputs[call], splits, dim=-1))
                if residual_add:
                    total, result = cuda_ops.flashnorm_add_matmul(
                        xs[call], residuals[call], w, 1e-5, splits=splits, strategy=strategy, statistic=statistic,
                        bias=bias,
                    )
                    results.append([total, *result])
                else:
                    result = cuda_ops.flashnorm_matmul(
                        xs[call], w, 1e-5, splits=splits, strategy=strategy, statistic=statistic, bias=bias
                    )
                    results.append(result)
                for piece, part in zip(pieces, result):
                    piece.copy_(part)
        torch.cuda.synchronize()
    finally:
        cuda_ops.set_side_delay(0)
    inputs = xs.reshape(CALLS * m, k)
    if residual_add:
        inputs = cuda_ops.reference_add(inputs, residuals.reshape(CALLS * m, k))
        sums = torch.stack([result[0] for result in results]).reshape(CALLS * m, k)
        assert torch.equal(sums, inputs), "a call's sum differs from x + residual"
    errors = row_errors(outputs.reshape(CALLS * m, n), norm_reference(inputs, w, 1e-5, statistic, bias))
    bad_calls = (errors.reshape(CALLS, m) > TOLERANCE[dtype]).any(dim=1).nonzero().flatten().tolist()
    assert not bad_calls, (
        f"{len(bad_calls)} of {CALLS} calls wrong (first {bad_calls[:10]}, worst row error "
        f"{errors.max().item():.3g}); join dropped in this build: {cuda_ops.join_dropped()}"
    )
