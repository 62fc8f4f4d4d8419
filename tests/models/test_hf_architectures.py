"""Randomly initialised tiny Hugging Face models of each architecture family FlashNorm must
handle, exported through both torch exporters, optimized (fold, cancel) and compared with the
original in ONNX Runtime. No network: every model is built from a config in memory.

Each case states how many RMSNorm sites the architecture has and how many the passes must
fold or cancel, with the reasoning, for L = 2 layers:

- A site folds when every consumer of its output is a MatMul reading a constant weight
  (Q/K/V, gate/up, fused qkv/gate_up, an untied LM head). A site whose output feeds a
  residual Add (Gemma's post-norms), RoPE (QK-norms) or attention directly does not fold;
  a final norm before a TIED LM head does not fold (the head's weight is the embedding).
- A site cancels only when EVERY consumer path reaches a downstream RMSNorm through bias-free
  positively homogeneous ops: only Gemma 4 (q/k/v norms behind every projection) qualifies.

Norm gains are overwritten with random values, a quarter of them negative, so that folding a
gain into the wrong axis or dropping it shows up in the logits. Weights use a larger init
range than the default so that logits are O(1) and argmax ties cannot occur by accident.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

from flashnorm.passes import optimize_file
from flashnorm.progress import Progress
from flashnorm.validate import compare_models, language_model_feeds, random_token_ids, read_signature

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

L = 2
COMMON = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=L, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=128, initializer_range=0.2,
)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], Any]
    sites: int
    folded: int
    cancelled: int
    gain_convention: str = "w"


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON, tie_word_embeddings=False))


def _mistral():
    return transformers.MistralForCausalLM(transformers.MistralConfig(**COMMON, tie_word_embeddings=False, sliding_window=None))


def _qwen2():
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON, tie_word_embeddings=True))


def _qwen3():
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**COMMON, tie_word_embeddings=False))


def _gemma2():
    return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        **COMMON, tie_word_embeddings=True, query_pre_attn_scalar=16, sliding_window=8,
        final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
    ))


def _gemma3():
    return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        **COMMON, tie_word_embeddings=True, query_pre_attn_scalar=16, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    ))


def _phi3():
    config = {k: v for k, v in COMMON.items() if k != "head_dim"}
    return transformers.Phi3ForCausalLM(transformers.Phi3Config(**config, tie_word_embeddings=False, pad_token_id=0))


def _gemma4():
    return transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(
        **COMMON, tie_word_embeddings=True, global_head_dim=16, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        hidden_size_per_layer_input=0, vocab_size_per_layer_input=COMMON["vocab_size"],
    ))


CASES = [
    # Llama: per layer input_layernorm → q/k/v, post_attention_layernorm → gate/up; a final
    # norm → untied lm_head. 2L+1 = 5 sites, all fold; nothing reaches another norm.
    Case("llama", _llama, sites=2 * L + 1, folded=2 * L + 1, cancelled=0),
    # Mistral: the same block as Llama.
    Case("mistral", _mistral, sites=2 * L + 1, folded=2 * L + 1, cancelled=0),
    # Qwen2: Q/K/V carry a bias. Folding is still exact (diag(g)·W, bias untouched), so the 2L
    # layer norms fold; the head is tied, so the final norm stays: 2L folded. The bias breaks
    # homogeneity, and there is no downstream norm anyway: 0 cancelled.
    Case("qwen2", _qwen2, sites=2 * L + 1, folded=2 * L, cancelled=0),
    # Qwen3: + q_norm and k_norm per layer (4L+1 = 9 sites). q/k norms feed RoPE, not a
    # projection: they do not fold; the 2L block norms and the untied head's norm do (2L+1).
    # The input norm reaches q_norm and k_norm, but V reaches attention with no norm: a
    # QK-only norm is NOT cancellable (V would change scale). 0 cancelled.
    Case("qwen3", _qwen3, sites=4 * L + 1, folded=2 * L + 1, cancelled=0),
    # Gemma 2: (1+w) gains; sandwich norms: input, post_attention (on the attention output,
    # feeding the residual Add), pre_feedforward, post_feedforward per layer + final = 4L+1.
    # Only input (→ q/k/v) and pre_feedforward (→ gate/up) feed projections: 2L fold; the
    # post-norms feed Adds; the final norm feeds the tied head. 0 cancelled.
    Case("gemma2", _gemma2, sites=4 * L + 1, folded=2 * L, cancelled=0, gain_convention="1+w"),
    # Gemma 3: Gemma 2's four norms + q_norm and k_norm = 6L+1 sites; the same 2L fold; QK-only
    # norms are not cancellable.
    Case("gemma3", _gemma3, sites=6 * L + 1, folded=2 * L, cancelled=0, gain_convention="1+w"),
    # Phi-3: fused qkv_proj and gate_up_proj are single MatMuls: input_layernorm → qkv_proj and
    # post_attention_layernorm → gate_up_proj fold, and so does the final norm (untied head):
    # 2L+1 of 2L+1.
    Case("phi3", _phi3, sites=2 * L + 1, folded=2 * L + 1, cancelled=0),
    # Gemma 4: input, post_attention, pre_feedforward, post_feedforward + q_norm, k_norm and a
    # weightless v_norm per layer = 7L+1 sites. Folds: input (→ q/k/v) and pre_feedforward
    # (→ gate/up): 2L; the head is tied. Cancels: the input norm's every path (q/k/v
    # projections, bias-free, reshaped per head) reaches q_norm, k_norm or v_norm: L cancelled
    # (approximate with eps; see test_gemma4_cancel_error_within_eps_bound).
    Case("gemma4", _gemma4, sites=7 * L + 1, folded=2 * L, cancelled=L),
]


def _randomize_gains(model, rng: np.random.Generator) -> None:
    """Every RMSNorm weight → random magnitudes in [0.5, 1.5], a quarter of them negative,
    expressed in the module's own convention ((1+w) modules store gain − 1)."""
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if "RMSNorm" not in type(module).__name__ or weight is None:
            continue
        size = weight.shape[0]
        gain = rng.uniform(0.5, 1.5, size) * np.where(rng.random(size) < 0.25, -1.0, 1.0)
        stored = gain - 1.0 if _one_plus_w(module) else gain
        with torch.no_grad():
            weight.copy_(torch.from_numpy(stored.astype(np.float32)))


def _one_plus_w(module) -> bool:
    # Gemma 1–3 modules multiply by (1 + weight) and initialise weight to zeros.
    return type(module).__name__ in ("GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm")


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setattr(Progress, "enabled", False)


def _export(case: Case, dynamo: bool, directory: Path, rng: np.random.Generator) -> Path:
    """A fresh random model (seeded from the test's printed rng seed), exported."""
    from flashnorm.export import export_causal_lm

    torch.manual_seed(int(rng.integers(2**31)))
    model = case.build().eval()
    _randomize_gains(model, rng)
    path = directory / f"{case.name}.{'dynamo' if dynamo else 'legacy'}.onnx"
    export_causal_lm(model, path, dynamo=dynamo)
    return path


def _counts(report: dict[str, Any]) -> tuple[int, int]:
    summary = report["summary"]
    return summary.get("fold.folded", 0), summary.get("cancel.cancelled", 0)


@pytest.mark.parametrize("dynamo", [False, True], ids=["legacy17", "dynamo23"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_fold_cancel_exact(case: Case, dynamo: bool, tmp_path, rng):
    if dynamo:
        pytest.importorskip("onnxscript")
    original = _export(case, dynamo, tmp_path, rng)
    optimized = original.with_suffix(".flashnorm.onnx")
    report = optimize_file(original, optimized)
    assert report["norm_sites"] == case.sites
    assert _counts(report) == (case.folded, case.cancelled), report["summary"]

    signature = read_signature(original)
    ids = random_token_ids(signature.vocab_size, 2, 11, rng)
    feeds = [language_model_feeds(signature, ids)]
    comparison = compare_models(original, optimized, feeds, max_rel_l2=1e-5)
    logits = comparison.output("logits")
    # No top-1 assertion: random weights leave near-tied logits (seen: a lead of 1.2e-6 at a
    # max |logit| of 6.6 flipped by rounding), and a flip can only happen where the lead is below
    # 2 × max_abs, which the scaled_max_abs bound already holds to 2e-5 of the logits' scale.
    assert logits.rel_l2 < 1e-5 and logits.scaled_max_abs < 1e-5, logits
    assert comparison.passed, logits


def test_gemma4_cancel_error_within_eps_bound(tmp_path, rng):
    """Cancellation is exact only at eps = 0. With a deliberately large eps (1e-2) the error
    becomes measurable, and it must be what Proposition 3 predicts: the kept q/k/v norms'
    outputs change per token and head by ρ = sqrt((M(b)+ε)/(M(b)+ε·(M(a)+ε))), where a is
    the cancelled input norm's input and b = x·W* the downstream norm's input. Token 0 (a
    zero embedding in Gemma) is always among the inputs: a zero row must stay harmless. The logits
    error must be non-zero (cancel really removed a division), of the order of max |ρ−1|,
    and fold alone must stay exact."""
    from flashnorm.export import export_causal_lm

    eps = 1e-2
    torch.manual_seed(int(rng.integers(2**31)))
    model = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(
        **COMMON, tie_word_embeddings=True, global_head_dim=16, sliding_window=8, rms_norm_eps=eps,
        layer_types=["sliding_attention", "full_attention"],
        hidden_size_per_layer_input=0, vocab_size_per_layer_input=COMMON["vocab_size"],
    )).eval()
    _randomize_gains(model, rng)
    original = tmp_path / "gemma4.onnx"
    export_causal_lm(model, original)
    folded, cancelled = tmp_path / "folded.onnx", tmp_path / "cancelled.onnx"
    assert _counts(optimize_file(original, folded, ("fold",))) == (2 * L, 0)
    assert _counts(optimize_file(original, cancelled, ("fold", "cancel"))) == (2 * L, L)

    signature = read_signature(original)
    ids = random_token_ids(signature.vocab_size, 2, 11, rng)
    ids[0, 3] = 0
    feeds = language_model_feeds(signature, ids)

    # ρ per token and head from the torch model's own activations on the same input.
    captured: dict[str, torch.Tensor] = {}
    hooks = []
    for index, layer in enumerate(model.model.layers):
        hooks.append(layer.input_layernorm.register_forward_hook(
            lambda m, args, out, i=index: captured.__setitem__(f"a{i}", args[0])))
        for projection in ("q_proj", "k_proj", "v_proj"):
            hooks.append(getattr(layer.self_attn, projection).register_forward_hook(
                lambda m, args, out, i=index, p=projection: captured.__setitem__(f"{p}{i}", out)))
    with torch.no_grad():
        model(**{k: torch.from_numpy(v) for k, v in feeds.items()})
    for hook in hooks:
        hook.remove()
    deviations = []
    head_dim = COMMON["head_dim"]
    for index in range(L):
        mean_square_a = captured[f"a{index}"].double().pow(2).mean(-1, keepdim=True)
        for projection in ("q_proj", "k_proj", "v_proj"):
            c = captured[f"{projection}{index}"].double()
            c = c.view(*c.shape[:-1], -1, head_dim)
            # c = (x/rms(x))·W* = b / sqrt(M(a)+eps), so M(b) = M(c)·(M(a)+eps).
            mean_square_b = c.pow(2).mean(-1) * (mean_square_a + eps)
            rho = torch.sqrt((mean_square_b + eps) / (mean_square_b + eps * (mean_square_a + eps)))
            # The change of a kept norm's output is (ρ−1)·y' with rms(y') = sqrt(M(b)/(M(b)+ε)):
            # a zero input (Gemma's padding embedding, token 0) gives ρ = 1/√ε but changes
            # nothing, so the deviation is measured on the output's own scale.
            deviations.append(((rho - 1).abs() * torch.sqrt(mean_square_b / (mean_square_b + eps))).max().item())
    predicted = max(deviations)
    assert 1e-5 < predicted < 1e-1

    fold_only = compare_models(original, folded, [feeds], max_rel_l2=1e-5).output("logits")
    assert fold_only.rel_l2 < 1e-5
    with_cancel = compare_models(original, cancelled, [feeds], max_rel_l2=1.0).output("logits")
    assert with_cancel.rel_l2 > 10 * fold_only.rel_l2, "cancel changed nothing measurable: was a division removed?"
    assert with_cancel.rel_l2 < 4 * predicted, (with_cancel.rel_l2, predicted)
    assert with_cancel.scaled_max_abs < 10 * predicted, (with_cancel.scaled_max_abs, predicted)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_deferred_runs_in_onnx_runtime_and_builds_in_tensorrt_rtx(case: Case, tmp_path, rng):
    """fold, cancel and defer: ONNX Runtime runs the deferred file (each FlashNormMatMul<N>
    through its reference function) with the folded file's logits, and TensorRT-RTX's real
    ONNX parser and builder turn it into an engine with a dynamic profile up to 1×512 tokens
    (no plugin: TensorRT-RTX has no plugin layers); both also after `polygraphy surgeon
    sanitize --fold-constants`."""
    if importlib.util.find_spec("tensorrt_rtx") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("tensorrt_rtx is not installed: CI installs it with the [dev] extra")
        pytest.skip("tensorrt_rtx is not installed (pip install -e '.[dev]')")
    from flashnorm.engine import BuildOptions, ShapeRange, build_serialized_engine

    original = _export(case, False, tmp_path, rng)
    folded, deferred = tmp_path / "folded.onnx", tmp_path / "deferred.onnx"
    optimize_file(original, folded, ("fold", "cancel"))
    report = optimize_file(original, deferred, ("fold", "cancel", "defer"))
    assert _counts(report) == (case.folded, case.cancelled)
    # Every folded norm is deferred, except those cancel removed (their division is gone).
    deferred_sites = report["summary"].get("defer.deferred", 0)
    assert deferred_sites == case.folded - case.cancelled, report["summary"]

    # `polygraphy surgeon sanitize --fold-constants`, the usual step before TensorRT, rewrites the
    # file through onnx-graphsurgeon: the result must run and build the same way.
    sanitized = tmp_path / "sanitized.onnx"
    result = subprocess.run(["polygraphy", "surgeon", "sanitize", str(deferred), "--fold-constants",
                             "-o", str(sanitized)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]

    signature = read_signature(original)
    feeds = [language_model_feeds(signature, random_token_ids(signature.vocab_size, 2, 11, rng))]
    tokens = ShapeRange((1, 1), (1, 64), (1, 512))
    for candidate in (deferred, sanitized):
        logits = compare_models(folded, candidate, feeds, max_rel_l2=1e-5).output("logits")
        # Bounded as in test_fold_cancel_exact: no top-1 assertion on near-tied logits.
        assert logits.rel_l2 < 1e-5 and logits.scaled_max_abs < 1e-5, (candidate.name, logits)
        _, build = build_serialized_engine(candidate, BuildOptions(
            backend="tensorrt-rtx", shapes={name: tokens for name in signature.input_names}, optimization_level=0,
            progress=False))
        assert build["flashnorm_nodes"] == deferred_sites and build["flashnorm_plugin_layers"] == 0
        # One mean reduction per remaining norm, one more per deferred node (its reference body also
        # takes the mean, times the RMS statistic's 0: one body for both statistics).
        assert build["network"]["mean_reductions"] == case.sites - case.cancelled + deferred_sites, build["network"]
