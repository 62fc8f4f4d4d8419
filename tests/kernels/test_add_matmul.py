"""``flashnorm_add_matmul``: the residual add in front of the norm, in the same library call.

Every strategy (the fused kernel forms the sum as it reads x; the others add in a kernel first)
against the same references as the plain call: the sum must equal x + residual rounded once to
the dtype, bit for bit, and the outputs must be the deferred norm of that sum. Outputs and sum are
poisoned with NaN before every call; inputs are fresh each run.
"""

from __future__ import annotations

import pytest
import torch

from flashnorm.errors import FlashNormError
from kernel_reference import (
    TOLERANCE,
    cuda_ops_module,
    generator_from,
    random_inputs,
    row_errors,
    strategy_reference,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ROWS = [1, 2, 3, 7, 16, 64, 257]
STRATEGIES = ["auto", "fused", "two_stream", "prenorm", "epilogue_scale"]
# (K, splits): a narrow-strip W* (SmolLM2's q|k|v), a wide-strip one (Llama-3.2-1B's q|k|v, 2^21+
# elements), a K tail, and odd K / N (the fused kernel's CUDA-core fallback).
SHAPES = [
    (576, [576, 192, 192]),
    (2048, [2048, 512, 512]),
    (264, [40, 8, 16, 24]),
    (33, [7, 13, 5]),
]


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", ROWS)
def test_sum_and_outputs_match_the_add_then_the_plain_call(m, dtype, strategy, rng):
    cuda_ops = cuda_ops_module()
    if strategy == "epilogue_scale" and (dtype == torch.float32 or not cuda_ops.strategy_available(strategy)):
        pytest.skip("epilogue_scale: 16-bit operands, in builds with the CUTLASS kernel on compute capability 9.0")
    generator = generator_from(rng)
    for k, splits in SHAPES:
        if strategy == "epilogue_scale" and (k % 8 or sum(splits) % 8 or any(s % 32 for s in splits[:-1])):
            continue  # its TMA loads need 16-byte rows, its stores splits at multiples of 32 (test_epilogue_scale.py)
        eps = float(rng.choice([1e-6, 1e-5, 1e-2]))
        x, w = random_inputs(generator, m, k, sum(splits), dtype)
        residual, _ = random_inputs(generator, m, k, 1, dtype)
        out = [torch.full((m, k), float("nan"), dtype=dtype, device="cuda")]
        out += [torch.full((m, size), float("nan"), dtype=dtype, device="cuda") for size in splits]
        total, outputs = cuda_ops.flashnorm_add_matmul(x, residual, w, eps, splits, strategy, out=out)
        assert total is not None and total.data_ptr() == out[0].data_ptr()
        assert all(a is b for a, b in zip(outputs, out[1:]))
        wanted_sum = cuda_ops.reference_add(x, residual)
        assert torch.equal(total, wanted_sum), f"m={m} k={k} {dtype} {strategy}: sum differs from x + residual"
        expected = strategy_reference(cuda_ops, wanted_sum, w, eps, splits, strategy)
        for got, wanted in zip(outputs, torch.split(expected, splits, dim=-1)):
            worst = row_errors(got, wanted).max().item()
            assert worst <= TOLERANCE[dtype], (
                f"m={m} k={k} splits={splits} {dtype} {strategy} eps={eps}: worst row error {worst:.3g}"
            )


@pytest.mark.gpu
def test_fused_add_matches_the_plain_fused_call_bit_for_bit(rng):
    """The fused kernel with the add computes exactly what the add followed by the plain fused
    call computes: same sum, same K split, same accumulation order."""
    cuda_ops = cuda_ops_module()
    generator = generator_from(rng)
    for m, k, splits in [(1, 576, [576, 192, 192]), (16, 576, [1536, 1536]), (5, 2048, [2048, 512, 512])]:
        x, w = random_inputs(generator, m, k, sum(splits), torch.bfloat16)
        residual, _ = random_inputs(generator, m, k, 1, torch.bfloat16)
        total, outputs = cuda_ops.flashnorm_add_matmul(x, residual, w, 1e-5, splits, "fused")
        plain = cuda_ops.flashnorm_matmul(cuda_ops.reference_add(x, residual), w, 1e-5, splits, "fused")
        assert torch.equal(total, cuda_ops.reference_add(x, residual))
        for got, wanted in zip(outputs, plain):
            assert torch.equal(got, wanted), f"m={m} k={k}: the fused add changed the outputs"


@pytest.mark.gpu
def test_sum_overlapping_an_input_is_refused():
    cuda_ops = cuda_ops_module()
    x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)
    outputs = [torch.empty(4, 32, device="cuda", dtype=torch.bfloat16)]
    with pytest.raises(FlashNormError, match="sum overlaps x or residual"):
        cuda_ops.flashnorm_add_matmul(x, residual, w, 1e-5, [32], "fused", out=[x, *outputs])


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [8, 256], ids=["fused-library-call", "inductor-form"])
def test_compiled_and_graphed_layer_matches_eager(rows):
    """torch.compile through torch.ops.flashnorm.add_matmul (the library call at 8 rows, the add and
    prenorm arithmetic at 256), captured in a CUDA graph, on fresh inputs each replay."""
    cuda_ops = cuda_ops_module()
    torch._dynamo.reset()
    generator = torch.Generator(device="cuda").manual_seed(11)
    w = (torch.randn(64, 96, generator=generator, device="cuda") / 8).bfloat16()

    def step(h: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        total, q, kv = torch.ops.flashnorm.add_matmul(h, delta, w, 1e-5, [64, 32], "auto")
        return total, torch.cat([q, kv], dim=-1).relu()

    compiled = torch.compile(step, fullgraph=True)
    h = torch.randn(rows, 64, generator=generator, device="cuda").bfloat16()
    delta = torch.randn(rows, 64, generator=generator, device="cuda").bfloat16()
    for _ in range(2):
        got = compiled(h, delta)
    wanted = step(h, delta)
    assert torch.equal(got[0], wanted[0])
    torch.testing.assert_close(got[1], wanted[1], rtol=3e-2, atol=3e-2)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        static_out = compiled(h, delta)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(10):
        h.copy_(torch.randn(h.shape, generator=generator, device="cuda"))
        delta.copy_(torch.randn(h.shape, generator=generator, device="cuda"))
        graph.replay()
        wanted = step(h, delta)
        assert torch.equal(static_out[0], wanted[0])
        torch.testing.assert_close(static_out[1], wanted[1], rtol=3e-2, atol=3e-2)
