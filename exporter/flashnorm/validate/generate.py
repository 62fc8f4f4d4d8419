"""Greedy generation from an ONNX logits model with ONNX Runtime, and a token-by-token
comparison of two models' generations (the long-generation check: an error that logits
comparisons miss, such as a one-step lag, shows up as diverging tokens).

A graph without a KV cache is re-run on the whole sequence at every step; a graph exported
with `--kv-cache` is prefilled with an empty past and then fed one token at a time.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Sequence

import numpy as np

from flashnorm.errors import FlashNormError
from flashnorm.validate.feeds import check_context, check_memory, token_model_bytes
from flashnorm.validate.inputs import as_int_sequence, read_signature
from flashnorm.validate.runners import make_session, raise_run_failure


_ORT_FLOAT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64}


def _positions(start: int, stop: int) -> np.ndarray:
    return np.arange(start, stop, dtype=np.int64)[None, :]


def greedy_generate(
    session: Any,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    eos_token_id: int | None = None,
) -> list[int]:
    """Generate up to `max_new_tokens` greedily (argmax) after `prompt_ids` (batch 1); stops
    early after `eos_token_id`. Returns the new tokens only."""
    prompt = as_int_sequence(prompt_ids)
    if not prompt:
        raise FlashNormError("greedy generation needs at least one prompt token")
    inputs = {i.name: i for i in session.get_inputs()}
    past = [i for name, i in inputs.items() if name.startswith("past_key_values.")]
    tokens = list(prompt)
    generated: list[int] = []
    if past:
        state = {}
        for spec in past:
            heads, head_dim = spec.shape[1], spec.shape[3]
            state[spec.name] = np.zeros((1, heads, 0, head_dim), dtype=_ORT_FLOAT_TYPES.get(spec.type, np.float32))
        new = list(prompt)
        while len(generated) < max_new_tokens:
            feeds = {"input_ids": np.asarray([new], dtype=np.int64), **state}
            if "attention_mask" in inputs:
                feeds["attention_mask"] = np.ones((1, len(tokens)), dtype=np.int64)
            if "position_ids" in inputs:
                feeds["position_ids"] = _positions(len(tokens) - len(new), len(tokens))
            outputs = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
            token = int(np.argmax(outputs["logits"][0, -1]))
            state = {spec.name: outputs[spec.name.replace("past_key_values.", "present.")] for spec in past}
            generated.append(token)
            tokens.append(token)
            new = [token]
            if token == eos_token_id:
                break
        return generated
    while len(generated) < max_new_tokens:
        feeds = {"input_ids": np.asarray([tokens], dtype=np.int64)}
        if "attention_mask" in inputs:
            feeds["attention_mask"] = np.ones((1, len(tokens)), dtype=np.int64)
        if "position_ids" in inputs:
            feeds["position_ids"] = _positions(0, len(tokens))
        logits = session.run(["logits"], feeds)[0]
        token = int(np.argmax(logits[0, -1]))
        generated.append(token)
        tokens.append(token)
        if token == eos_token_id:
            break
    return generated


@dataclasses.dataclass
class GenerationComparison:
    prompt: list[int]
    reference_tokens: list[int]
    candidate_tokens: list[int]
    identical: bool
    first_divergence: int | None
    """Index (into the new tokens) of the first token that differs, or None."""
    reference_text: str | None = None
    candidate_text: str | None = None

    @property
    def passed(self) -> bool:
        return self.identical

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "passed": self.passed}


def compare_generation(
    reference: str | os.PathLike[str],
    candidate: str | os.PathLike[str],
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    eos_token_id: int | None = None,
    decode: Callable[[list[int]], str] | None = None,
    session_factory: Callable[[str | os.PathLike[str]], Any] = make_session,
) -> GenerationComparison:
    """Generate greedily from both models and compare the tokens one by one. EOS is not
    honoured during the comparison (both models run `max_new_tokens` steps) unless
    `eos_token_id` is given."""
    prompt = as_int_sequence(prompt_ids)
    signature = read_signature(reference)
    check_context(signature, len(prompt) + max_new_tokens, "--generate/--tokens")
    vocab = signature.vocab_size
    if vocab is not None:  # every step reruns the whole sequence: its logits grow with it
        check_memory("--generate/--tokens", token_model_bytes(1, len(prompt) + max_new_tokens, vocab, 1))
    results = []
    for path in (reference, candidate):
        session = session_factory(path)
        try:
            results.append(greedy_generate(session, prompt, max_new_tokens, eos_token_id=eos_token_id))
        except Exception as exc:
            raise_run_failure(exc, f"greedy generation from {path}")
            raise
        del session
    reference_tokens, candidate_tokens = results
    first = next(
        (i for i, (a, b) in enumerate(zip(reference_tokens, candidate_tokens)) if a != b),
        None if len(reference_tokens) == len(candidate_tokens) else min(len(reference_tokens), len(candidate_tokens)),
    )
    return GenerationComparison(
        prompt=prompt,
        reference_tokens=reference_tokens,
        candidate_tokens=candidate_tokens,
        identical=first is None,
        first_divergence=first,
        reference_text=decode(reference_tokens) if decode else None,
        candidate_text=decode(candidate_tokens) if decode else None,
    )
