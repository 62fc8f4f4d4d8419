"""Greedy generation from ONNX logits models (full re-run, and KV cache) against transformers'
own greedy generate, and the token-by-token comparison of two models."""

from __future__ import annotations

import pytest

from flashnorm.progress import Progress
from flashnorm.validate import compare_generation, greedy_generate, make_session
from models import cache

torch = pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setattr(Progress, "enabled", False)


def _torch_greedy(prompt: list[int], steps: int) -> list[int]:
    model = cache.tiny_llama_model()
    with torch.no_grad():
        output = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
            max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0, eos_token_id=None,
        )
    return output[0, len(prompt):].tolist()


@pytest.mark.parametrize("kv_cache", [False, True], ids=["rerun", "kv"])
def test_greedy_matches_transformers(session_tmp, rng, kv_cache):
    prompt = rng.integers(0, 128, 6).tolist()
    path = cache.tiny_llama_export(session_tmp, kv_cache=kv_cache)
    tokens = greedy_generate(make_session(path), prompt, 12)
    assert tokens == _torch_greedy(prompt, 12)


def test_eos_stops_generation(session_tmp, rng):
    prompt = rng.integers(0, 128, 4).tolist()
    session = make_session(cache.tiny_llama_export(session_tmp))
    free = greedy_generate(session, prompt, 8)
    stopped = greedy_generate(session, prompt, 8, eos_token_id=free[2])
    assert stopped == free[: free.index(free[2]) + 1]


def test_identical_models_generate_identically(tiny_llama_onnx, session_tmp, rng):
    prompt = rng.integers(0, 128, 5).tolist()
    result = compare_generation(tiny_llama_onnx, cache.tiny_llama_export(session_tmp, kv_cache=True), prompt, 10)
    assert result.identical and result.first_divergence is None and len(result.candidate_tokens) == 10


def test_divergence_is_located(tiny_llama_onnx, rng):
    """A candidate that differs from some step on must be reported at exactly that step."""
    prompt = rng.integers(0, 128, 5).tolist()
    reference = greedy_generate(make_session(tiny_llama_onnx), prompt, 8)
    divergence = 3

    class SwapOneStep:
        """Wraps a session: at step `divergence` its argmax token gets the lowest logit."""

        def __init__(self, session):
            self.session, self.calls = session, 0

        def get_inputs(self):
            return self.session.get_inputs()

        def get_outputs(self):
            return self.session.get_outputs()

        def run(self, names, feeds):
            outputs = self.session.run(names, feeds)
            if self.calls == divergence:
                logits = outputs[0]
                logits[0, -1, reference[divergence]] = logits[0, -1].min() - 1.0
            self.calls += 1
            return outputs

    sessions = iter([make_session(tiny_llama_onnx), SwapOneStep(make_session(tiny_llama_onnx))])
    result = compare_generation(tiny_llama_onnx, tiny_llama_onnx, prompt, 8, session_factory=lambda path: next(sessions))
    assert result.reference_tokens == reference
    assert not result.identical and result.first_divergence == divergence
    assert result.candidate_tokens[:divergence] == reference[:divergence]
    assert not result.passed and result.to_dict()["passed"] is False
