"""``torch.ops.flashnorm.matmul``: the library call as a PyTorch custom op.

On CPU: the schema, the fake implementation (shapes, the checks it shares with the library call)
and torch.compile tracing a model through the op with no graph break. On the GPU: the compiled
model (Inductor) and a CUDA graph of it compute what the direct library call computes.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from torch._subclasses.fake_tensor import FakeTensorMode

from flashnorm import cuda_ops
from flashnorm.errors import FlashNormError


def _two_sites(x: torch.Tensor, w_qkv: torch.Tensor, w_up: torch.Tensor, eps: float) -> torch.Tensor:
    """Two norm→projection sites with splits and PyTorch work around them, as in a decoder layer."""
    q, k, v = torch.ops.flashnorm.matmul(x, w_qkv, eps, [16, 8, 8], "auto")
    h = x + torch.cat([q, k, v], dim=-1).relu()
    gate, up = torch.ops.flashnorm.matmul(h, w_up, eps, [24, 24], "auto")
    return torch.nn.functional.silu(gate) * up


def _inputs(device: str, dtype: torch.dtype, generator: torch.Generator):
    x = torch.randn(3, 5, 32, generator=generator).to(device, dtype)
    w_qkv = (torch.randn(32, 32, generator=generator) / 32**0.5).to(device, dtype)
    w_up = (torch.randn(32, 48, generator=generator) / 32**0.5).to(device, dtype)
    return x, w_qkv, w_up


def test_fake_implementation_gives_the_output_shapes():
    with FakeTensorMode():
        x = torch.empty(4, 7, 64, dtype=torch.bfloat16)
        w = torch.empty(64, 96, dtype=torch.bfloat16)
        outputs = torch.ops.flashnorm.matmul(x, w, 1e-5, [64, 16, 16], "auto")
    assert [tuple(t.shape) for t in outputs] == [(4, 7, 64), (4, 7, 16), (4, 7, 16)]
    assert all(t.dtype == torch.bfloat16 for t in outputs)


@pytest.mark.parametrize(
    "w_shape, splits, dtype_w, strategy, message",
    [
        ((64, 96), [64, 16], torch.bfloat16, "auto", "sum to N=96"),
        ((63, 96), [96], torch.bfloat16, "auto", "features but w has 63 rows"),
        ((64, 96), [96], torch.float16, "auto", "one dtype"),
        ((64, 96), [96], torch.bfloat16, "fastest", "strategy 'fastest' is unknown"),
        ((64, 96), [12] * 8 + [0], torch.bfloat16, "auto", "1 to 8"),
    ],
)
def test_fake_implementation_refuses_what_the_library_refuses(w_shape, splits, dtype_w, strategy, message):
    with FakeTensorMode():
        x = torch.empty(4, 64, dtype=torch.bfloat16)
        w = torch.empty(*w_shape, dtype=dtype_w)
        with pytest.raises(FlashNormError, match=message):
            torch.ops.flashnorm.matmul(x, w, 1e-5, splits, strategy)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_opcheck_on_cpu(dtype):
    """Schema, fake-vs-real shapes and strides, and the functionalized/AOT paths (torch's own checks)."""
    x, w_qkv, _ = _inputs("cpu", dtype, torch.Generator().manual_seed(1))
    torch.library.opcheck(torch.ops.flashnorm.matmul.default, (x, w_qkv, 1e-5, [16, 8, 8], "auto"))


def test_cpu_arithmetic_is_the_deferred_norm():
    """The CPU implementation is (x·W*) ⊙ rsqrt(mean(x²)+eps), which equals RMSNorm then W*."""
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(6, 40, generator=generator, dtype=torch.float64) * 3
    w = torch.randn(40, 24, generator=generator, dtype=torch.float64)
    got = torch.cat(torch.ops.flashnorm.matmul(x.float(), w.float(), 1e-5, [20, 4], "auto"), dim=-1)
    expected = torch.nn.functional.rms_norm(x, (40,), eps=1e-5) @ w
    assert torch.allclose(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_torch_compile_traces_through_the_op_in_one_graph():
    """fullgraph=True fails on any graph break; one compiled frame, both op calls inside it."""
    torch._dynamo.reset()
    x, w_qkv, w_up = _inputs("cpu", torch.float32, torch.Generator().manual_seed(3))
    counter = CompileCounter()
    compiled = torch.compile(_two_sites, backend=counter, fullgraph=True)
    got = compiled(x, w_qkv, w_up, 1e-5)
    assert counter.frame_count == 1
    assert counter.op_count >= 2
    assert torch.allclose(got, _two_sites(x, w_qkv, w_up, 1e-5), rtol=1e-6, atol=1e-6)


def _picks_fused_up_to_16_rows(m, k, n, dtype=torch.bfloat16, splits=None, statistic="rms"):
    return "fused" if m <= 16 else "two_stream"


def _picks_epilogue_scale_from_9_rows(m, k, n, dtype=torch.bfloat16, splits=None, statistic="rms"):
    return "fused" if m <= 8 else "epilogue_scale"


@pytest.mark.parametrize(
    "picks, rows, decomposed",
    [(_picks_fused_up_to_16_rows, 8, False), (_picks_fused_up_to_16_rows, 16, False), (_picks_fused_up_to_16_rows, 17, True),
     (_picks_fused_up_to_16_rows, 512, True), (_picks_epilogue_scale_from_9_rows, 9, False),
     (_picks_epilogue_scale_from_9_rows, 16, False), (_picks_epilogue_scale_from_9_rows, 17, True)],
)
def test_inductor_form_keeps_the_library_call_only_where_auto_picks_fused(monkeypatch, picks, rows, decomposed):
    """Under Inductor, "auto" stays one library call where AUTO picks the fused kernel or, up to the
    fused kernel's 16 rows, the epilogue-scale GEMM, and is otherwise x̂ = x ⊙ rsqrt(mean(x²)+eps)
    (rounded) then x̂·W*, one contiguous output per split."""
    monkeypatch.setattr(cuda_ops.lowering, "resolve_strategy", picks)
    with FakeTensorMode():
        on_gpu = torch.empty(rows, 64, dtype=torch.bfloat16, device="meta"), torch.empty(64, 96, dtype=torch.bfloat16, device="meta")
        on_cpu = torch.empty(rows, 64, dtype=torch.bfloat16), torch.empty(64, 96, dtype=torch.bfloat16)
        for (x, w), strategy, kept in [(on_gpu, "auto", not decomposed), (on_gpu, "two_stream", True), (on_cpu, "auto", True)]:
            graph = torch.fx.experimental.proxy_tensor.make_fx(
                lambda x, w: cuda_ops.inductor_form(x, w, 1e-5, [64, 16, 16], strategy), tracing_mode="fake"
            )(x, w)
            targets = {str(node.target) for node in graph.graph.nodes if node.op == "call_function"}
            assert ("flashnorm.library_matmul.default" in targets) == kept, (strategy, x.device, targets)
            assert ("aten.mm.default" in targets) == (not kept), (strategy, x.device, targets)


def test_inductor_compiles_a_model_with_the_op_on_cpu():
    """Inductor itself (not a test backend) through the op: on the CPU it keeps the library call,
    whose CPU form is the reference arithmetic."""
    torch._dynamo.reset()
    x, w_qkv, w_up = _inputs("cpu", torch.float32, torch.Generator().manual_seed(7))
    compiled = torch.compile(_two_sites, fullgraph=True)
    torch.testing.assert_close(compiled(x, w_qkv, w_up, 1e-5), _two_sites(x, w_qkv, w_up, 1e-5), rtol=1e-5, atol=1e-5)


def test_prenorm_form_is_the_op_arithmetic_rounded_once():
    """x̂ rounded to bf16 before the GEMM: within one bf16 rounding of the op's arithmetic."""
    generator = torch.Generator().manual_seed(6)
    x = torch.randn(40, 32, generator=generator).bfloat16()
    w = (torch.randn(32, 24, generator=generator) / 32**0.5).bfloat16()
    form = cuda_ops.prenorm_form(x, w, 1e-5, [16, 8])
    for got, wanted in zip(form, cuda_ops.reference_matmul(x, w, 1e-5, [16, 8])):
        assert got.is_contiguous()
        torch.testing.assert_close(got, wanted, rtol=2e-2, atol=2e-2)


def test_add_op_fake_shapes_and_opcheck_on_cpu():
    """torch.ops.flashnorm.add_matmul: [h, *outputs], h shaped like x; torch's own op checks."""
    with FakeTensorMode():
        x = torch.empty(4, 7, 64, dtype=torch.bfloat16)
        w = torch.empty(64, 96, dtype=torch.bfloat16)
        outputs = torch.ops.flashnorm.add_matmul(x, torch.empty_like(x), w, 1e-5, [64, 32], "auto")
    assert [tuple(t.shape) for t in outputs] == [(4, 7, 64), (4, 7, 64), (4, 7, 32)]
    x, w_qkv, _ = _inputs("cpu", torch.bfloat16, torch.Generator().manual_seed(8))
    torch.library.opcheck(torch.ops.flashnorm.add_matmul.default, (x, x.flip(0), w_qkv, 1e-5, [16, 16], "auto"))


def test_add_op_refuses_a_residual_of_another_shape():
    x = torch.randn(4, 32)
    with pytest.raises(FlashNormError, match="residual"):
        torch.ops.flashnorm.add_matmul(x, torch.randn(4, 31), torch.randn(32, 8), 1e-5, [8], "auto")


def test_cpu_add_op_is_the_add_then_the_op():
    generator = torch.Generator().manual_seed(9)
    x = torch.randn(6, 40, generator=generator).bfloat16()
    residual = torch.randn(6, 40, generator=generator).bfloat16()
    w = torch.randn(40, 24, generator=generator).bfloat16()
    total, *outputs = torch.ops.flashnorm.add_matmul(x, residual, w, 1e-5, [20, 4], "auto")
    assert torch.equal(total, x + residual)  # bf16 add: fp32 sum rounded once, as reference_add
    for got, wanted in zip(outputs, torch.ops.flashnorm.matmul(x + residual, w, 1e-5, [20, 4], "auto")):
        assert torch.equal(got, wanted)


@pytest.mark.parametrize(
    "rows, k, n, decomposed",
    [(8, 64, 96, False), (16, 64, 96, False), (17, 64, 96, True), (8, 2048, 3072, False), (9, 2048, 3072, True),
     (16, 576, 960, False), (16, 576, 3072, True)],
)
@pytest.mark.parametrize("picks", [_picks_fused_up_to_16_rows, _picks_epilogue_scale_from_9_rows])
def test_add_inductor_form_keeps_the_library_call_where_the_fused_add_wins(monkeypatch, picks, rows, k, n, decomposed):
    """Where AUTO picks fused (or, from 9 to 16 rows, epilogue-scale): up to 8 rows, and up to 16 on
    a small W* only (the measured rule for the fused kernel's add)."""
    monkeypatch.setattr(cuda_ops.lowering, "resolve_strategy", picks)
    with FakeTensorMode():
        x = torch.empty(rows, k, dtype=torch.bfloat16, device="meta")
        w = torch.empty(k, n, dtype=torch.bfloat16, device="meta")
        graph = torch.fx.experimental.proxy_tensor.make_fx(
            lambda x, r, w: cuda_ops.add_inductor_form(x, r, w, 1e-5, [n - 32, 32], "auto"), tracing_mode="fake"
        )(x, x, w)
    targets = {str(node.target) for node in graph.graph.nodes if node.op == "call_function"}
    assert ("flashnorm.library_add_matmul.default" in targets) == (not decomposed), targets
    assert ("aten.add.Tensor" in targets) == decomposed, targets


def test_inductor_compiles_the_add_op_on_cpu():
    torch._dynamo.reset()
    generator = torch.Generator().manual_seed(10)
    x, residual = torch.randn(2, 3, 32, generator=generator), torch.randn(2, 3, 32, generator=generator)
    w = torch.randn(32, 24, generator=generator) / 32**0.5

    def step(h, delta):
        total, a, b = torch.ops.flashnorm.add_matmul(h, delta, w, 1e-5, [16, 8], "auto")
        return total * 2, torch.nn.functional.silu(a).sum(-1) + b.sum(-1)

    got = torch.compile(step, fullgraph=True)(x, residual)
    for a, b in zip(got, step(x, residual)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_direct_library_call_needs_cuda():
    x, w_qkv, _ = _inputs("cpu", torch.float32, torch.Generator().manual_seed(4))
    with pytest.raises(FlashNormError, match="needs a CUDA device"):
        cuda_ops.flashnorm_matmul(x, w_qkv, 1e-5, [16, 8, 8])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("lead", [(3, 5), (4, 64)], ids=["15-rows-library", "256-rows-inductor-form"])
def test_inductor_and_cuda_graph_match_the_library_call(dtype, lead):
    """Inductor compiles the PyTorch work around the op (fullgraph: no break), keeping the library
    call at 15 rows (AUTO: fused) and compiling inductor_form at 256; the compiled step is then
    captured in a CUDA graph and replayed on new inputs; each result matches the eager step that
    calls the library directly through the op."""
    torch._dynamo.reset()
    cuda_ops.warm_up()
    generator = torch.Generator().manual_seed(5)
    _, w_qkv, w_up = _inputs("cuda", dtype, generator)
    x = torch.randn(*lead, 32, generator=generator).to("cuda", dtype)
    rows = lead[0] * lead[1]
    picked = cuda_ops.resolve_strategy(rows, 32, 32, dtype, [16, 8, 8])
    assert (picked == "fused") == (rows <= 16), picked
    compiled = torch.compile(_two_sites, fullgraph=True)
    tolerance = 3e-2 if dtype == torch.bfloat16 else 1e-2  # the 256-row form rounds x̂ once more
    for _ in range(2):  # compile, then warm the compiled code outside the capture
        torch.testing.assert_close(compiled(x, w_qkv, w_up, 1e-5), _two_sites(x, w_qkv, w_up, 1e-5), rtol=tolerance, atol=tolerance)
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        static_out = compiled(static_x, w_qkv, w_up, 1e-5)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(20):
        fresh = torch.randn(x.shape, generator=generator).to("cuda", dtype)
        static_x.copy_(fresh)
        graph.replay()
        torch.testing.assert_close(static_out, _two_sites(fresh, w_qkv, w_up, 1e-5), rtol=tolerance, atol=tolerance)


def _layer_norm_fold(gain: torch.Tensor, shift: torch.Tensor, w: torch.Tensor, c: torch.Tensor):
    """LayerNorm(x)·g + b → W: W* = diag(g)·W, c* = b·W + c, then W* centred over K (float64)."""
    folded = gain[:, None] * w
    return folded - folded.mean(dim=0, keepdim=True), shift @ w + c


def test_cpu_variance_with_bias_is_layer_norm_then_the_projection():
    """The op's LayerNorm mode on the folded, centred weight and the folded bias is F.layer_norm with
    its gain and bias, then the projection with its bias (issue 48's algebra, float64)."""
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(6, 40, generator=generator, dtype=torch.float64) * 3 + 5
    gain = torch.randn(40, generator=generator, dtype=torch.float64)
    shift = torch.randn(40, generator=generator, dtype=torch.float64)
    w = torch.randn(40, 24, generator=generator, dtype=torch.float64)
    c = torch.randn(24, generator=generator, dtype=torch.float64)
    centred, bias = _layer_norm_fold(gain, shift, w, c)
    got = torch.cat(cuda_ops.reference_matmul(x, centred, 1e-5, [20, 4], "variance", bias), dim=-1)
    expected = torch.nn.functional.layer_norm(x, (40,), gain, shift, eps=1e-5) @ w + c
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)  # the op's arithmetic is fp32
    ops_form = torch.cat(torch.ops.flashnorm.matmul(x.float(), centred.float(), 1e-5, [20, 4], "auto", "variance",
                                                    bias.float()), dim=-1)
    torch.testing.assert_close(ops_form.double(), expected, rtol=1e-4, atol=1e-4)


def test_fake_shapes_and_opcheck_with_statistic_and_bias():
    with FakeTensorMode():
        x = torch.empty(4, 7, 64, dtype=torch.bfloat16)
        w = torch.empty(64, 96, dtype=torch.bfloat16)
        outputs = torch.ops.flashnorm.matmul(x, w, 1e-5, [64, 32], "auto", "variance", torch.empty(96))
        added = torch.ops.flashnorm.add_matmul(x, torch.empty_like(x), w, 1e-5, [96], "auto", "variance", torch.empty(96))
    assert [tuple(t.shape) for t in outputs] == [(4, 7, 64), (4, 7, 32)]
    assert [tuple(t.shape) for t in added] == [(4, 7, 64), (4, 7, 96)]
    x, w_qkv, _ = _inputs("cpu", torch.bfloat16, torch.Generator().manual_seed(12))
    bias = torch.randn(32)
    torch.library.opcheck(torch.ops.flashnorm.matmul.default, (x, w_qkv, 1e-5, [16, 8, 8], "auto", "variance", bias))
    torch.library.opcheck(torch.ops.flashnorm.add_matmul.default,
                          (x, x.flip(0), w_qkv, 1e-5, [16, 16], "auto", "variance", bias))


def test_prenorm_form_with_variance_and_bias_is_layer_norm_rounded_once():
    """Inductor's form of the LayerNorm mode: x̂ = (x − mean)·s rounded once, then addmm with the bias
    rounded to x's dtype (F.layer_norm + F.linear's arithmetic); it matches the op's arithmetic within
    one bf16 rounding, and the bias rides in addmm."""
    generator = torch.Generator().manual_seed(13)
    x = (torch.randn(2, 20, 32, generator=generator) + 4).bfloat16()
    w = (torch.randn(32, 24, generator=generator) / 32**0.5)
    w = (w - w.mean(dim=0, keepdim=True)).bfloat16()
    bias = torch.randn(24, generator=generator)
    form = cuda_ops.prenorm_form(x, w, 1e-5, [16, 8], "variance", bias)
    for got, wanted in zip(form, cuda_ops.reference_matmul(x, w, 1e-5, [16, 8], "variance", bias)):
        assert got.shape == wanted.shape and got.is_contiguous()
        torch.testing.assert_close(got, wanted, rtol=3e-2, atol=3e-2)
    with FakeTensorMode():
        meta = torch.empty(40, 64, dtype=torch.bfloat16, device="meta"), torch.empty(64, 96, dtype=torch.bfloat16, device="meta")
        graph = torch.fx.experimental.proxy_tensor.make_fx(
            lambda x, w, b: cuda_ops.prenorm_form(x, w, 1e-5, [96], "variance", b), tracing_mode="fake"
        )(*meta, torch.empty(96, device="meta"))
    assert "aten.addmm.default" in {str(node.target) for node in graph.graph.nodes if node.op == "call_function"}


def _layer_norm_sites(x, w_qkv, w_up, b_qkv, b_up, eps):
    """Two LayerNorm→projection sites with biases (the folded, centred form), PyTorch work around them."""
    q, k, v = torch.ops.flashnorm.matmul(x, w_qkv, eps, [16, 8, 8], "auto", "variance", b_qkv)
    h = x + torch.cat([q, k, v], dim=-1).relu()
    gate, up = torch.ops.flashnorm.matmul(h, w_up, eps, [24, 24], "auto", "variance", b_up)
    return torch.nn.functional.gelu(gate) * up


@pytest.mark.gpu
@pytest.mark.parametrize("lead", [(3, 5), (4, 64)], ids=["15-rows-library", "256-rows-inductor-form"])
def test_layer_norm_op_under_inductor_and_cuda_graph(lead):
    """The LayerNorm mode with biases through torch.compile (fullgraph) and a CUDA graph of the compiled
    step, against the eager step calling the library through the op."""
    torch._dynamo.reset()
    cuda_ops.warm_up()
    generator = torch.Generator().manual_seed(14)
    dtype = torch.bfloat16
    _, w_qkv, w_up = _inputs("cuda", dtype, generator)
    w_qkv, w_up = ((w - w.float().mean(dim=0, keepdim=True).to(dtype)) for w in (w_qkv, w_up))
    b_qkv = torch.randn(32, generator=generator).cuda()
    b_up = torch.randn(48, generator=generator).cuda()
    x = (torch.randn(*lead, 32, generator=generator) + 3).to("cuda", dtype)
    compiled = torch.compile(_layer_norm_sites, fullgraph=True)
    for _ in range(2):
        torch.testing.assert_close(compiled(x, w_qkv, w_up, b_qkv, b_up, 1e-5),
                                   _layer_norm_sites(x, w_qkv, w_up, b_qkv, b_up, 1e-5), rtol=5e-2, atol=5e-2)
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        static_out = compiled(static_x, w_qkv, w_up, b_qkv, b_up, 1e-5)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(10):
        fresh = (torch.randn(x.shape, generator=generator) + 3).to("cuda", dtype)
        static_x.copy_(fresh)
        graph.replay()
        torch.testing.assert_close(static_out, _layer_norm_sites(fresh, w_qkv, w_up, b_qkv, b_up, 1e-5),
                                   rtol=5e-2, atol=5e-2)
