"""The quantized-model error budget (docs/QUANTIZATION.md): a folded quantized model is judged
by the negative log-likelihood it gives a fixed text, against the unfolded quantized model,
both measured against the float model.

A quantized model's logits differ from the float model's by far more than a half model's, and
elementwise or relative-L2 limits say little about what a user sees. The mean NLL per token of
real text does: the *extra* NLL of a quantized model over the float model is the quantizer's
damage, and the fold may add at most 10 % to it (`MAX_EXTRA_RATIO`), or +0.002 nats where the
unfolded quantized model is no worse than the float model (`MIN_ALLOWANCE`). Greedy tokens after
a prompt from the text are reported against both models; they are not judged.

The text that ships with the package (`data/public_domain_text.txt`, about 2 000 SmolLM2 tokens
of public-domain English prose) is the default.

Any causal-LM ONNX file that ONNX Runtime runs: `input_ids`, optionally `attention_mask`,
`position_ids` and `past_key_values.<i>.key/value` (fed empty; onnxruntime-genai's builder
writes such models), and a `logits` output (else the first output). Measuring needs only numpy
and onnxruntime; `quantized_ops` (is a model quantized: `flashnorm.match.quantized`'s table)
reads the graph with onnx.
"""

from __future__ import annotations

import dataclasses
import os
from importlib import resources
from typing import Any, Sequence

import numpy as np

from flashnorm.errors import FlashNormError

MAX_EXTRA_RATIO = 1.1
"""Largest allowed (candidate's extra NLL) / (reference's extra NLL), both over the float model."""
MIN_ALLOWANCE = 0.002
"""Where the reference's extra NLL is ≤ 0: the candidate's extra NLL at most this, in nats."""
DEFAULT_WINDOW = 1024
"""Tokens per forward pass: the text is cut into windows of this many tokens, each run alone."""
PROMPT_TOKENS = 16
GREEDY_TOKENS = 32

_ORT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
              "tensor(int64)": np.int64, "tensor(int32)": np.int32}


def shipped_text() -> str:
    """The text that ships with the package, without its header line(s) (`#` lines)."""
    raw = resources.files("flashnorm.validate").joinpath("data/public_domain_text.txt").read_text(encoding="utf-8")
    return "\n".join(line for line in raw.splitlines() if not line.startswith("#")).strip() + "\n"


def quantized_ops(model_path: str | os.PathLike[str]) -> dict[str, int]:
    """{op type: count} of the quantized ops (`flashnorm.match.quantized.QUANTIZED_OPS`) in the
    model's graph and its local functions; empty for a float model. External weights are not read."""
    import onnx

    from flashnorm.match.quantized import quantized_op_counts

    try:
        model = onnx.load(os.fspath(model_path), load_external_data=False)
    except (OSError, ValueError) as exc:
        raise FlashNormError(f"cannot read {model_path}: {exc}") from None
    nodes = list(model.graph.node) + [n for f in model.functions for n in f.node]
    return quantized_op_counts(node.op_type for node in nodes)


def past_head_size(model_path: str | os.PathLike[str]) -> int | None:
    """The head size of the past keys/values of a model onnxruntime-genai's builder wrote, from
    the genai_config.json beside it (its fp32 models declare that axis symbolically), else None."""
    import json
    from pathlib import Path

    config = Path(model_path).parent / "genai_config.json"
    try:
        return int(json.loads(config.read_text())["model"]["decoder"]["head_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _feeds(session: Any, ids: np.ndarray, head_size: int | None = None) -> dict[str, np.ndarray]:
    """Everything a causal LM session needs to run `ids` ([1, n]) from an empty past
    (`head_size`: the past's last axis where the model declares it symbolically)."""
    n = ids.shape[1]
    feeds: dict[str, np.ndarray] = {}
    for spec in session.get_inputs():
        kind = _ORT_TYPES.get(spec.type)
        if spec.name == "input_ids":
            feeds[spec.name] = ids.astype(kind or np.int64)
        elif spec.name == "attention_mask":
            feeds[spec.name] = np.ones((1, n), dtype=kind or np.int64)
        elif spec.name == "position_ids":
            feeds[spec.name] = np.arange(n, dtype=kind or np.int64)[None, :]
        elif spec.name.startswith("past_key_values.") or spec.name.startswith("past_key."):
            shape = list(spec.shape)
            if len(shape) == 4 and not isinstance(shape[3], int) and head_size:
                shape[3] = head_size
            if len(shape) != 4 or not isinstance(shape[1], int) or not isinstance(shape[3], int):
                raise FlashNormError(f"past input {spec.name} has shape {shape}: expected [batch, heads, past, head_dim]")
            feeds[spec.name] = np.zeros((1, shape[1], 0, shape[3]), dtype=kind or np.float32)
        else:
            raise FlashNormError(f"input {spec.name} is not one a causal LM's NLL can be measured with "
                                 "(input_ids, attention_mask, position_ids, past_key_values.*)")
    return feeds


def _logits_index(session: Any) -> int:
    names = [o.name for o in session.get_outputs()]
    return names.index("logits") if "logits" in names else 0


def token_nll(session: Any, ids: Sequence[int], *, window: int = DEFAULT_WINDOW,
              head_size: int | None = None) -> np.ndarray:
    """The NLL (nats, float64) of every token of `ids` after the first of its window, given
    the tokens before it in that window: the text is cut into windows of `window` tokens,
    each run alone from an empty past."""
    tokens = np.asarray(list(ids), dtype=np.int64)
    if tokens.size < 2:
        raise FlashNormError("the NLL needs at least two tokens")
    if window < 2:
        raise FlashNormError(f"window must be at least 2 tokens, got {window}")
    index = _logits_index(session)
    losses = []
    for start in range(0, tokens.size - 1, window):
        chunk = tokens[start:start + window]
        if chunk.size < 2:
            break
        logits = session.run(None, _feeds(session, chunk[None, :], head_size))[index]
        logits = np.asarray(logits[0, :-1], dtype=np.float64)
        top = logits.max(axis=-1, keepdims=True)
        log_z = np.log(np.exp(logits - top).sum(axis=-1)) + top[:, 0]
        losses.append(log_z - logits[np.arange(chunk.size - 1), chunk[1:]])
    return np.concatenate(losses)


def greedy_tokens(session: Any, prompt: Sequence[int], count: int, *, head_size: int | None = None) -> list[int]:
    """`count` tokens generated greedily after `prompt`, re-running the whole sequence each
    step from an empty past (every model the NLL runs, whatever its inputs)."""
    tokens = [int(t) for t in prompt]
    index = _logits_index(session)
    out = []
    for _ in range(count):
        logits = session.run(None, _feeds(session, np.asarray([tokens], dtype=np.int64), head_size))[index]
        token = int(np.argmax(logits[0, -1]))
        out.append(token)
        tokens.append(token)
    return out


@dataclasses.dataclass
class ModelLikelihood:
    model: str
    nll: float
    """Mean NLL per predicted token, nats."""
    greedy: list[int]
    quantized_ops: dict[str, int]
    optimization_level: str


def measure(model_path: str | os.PathLike[str], ids: Sequence[int], *, optimization_level: str = "all",
            providers: Sequence[str] = ("CPUExecutionProvider",), window: int = DEFAULT_WINDOW,
            prompt_tokens: int = PROMPT_TOKENS, greedy: int = GREEDY_TOKENS, session: Any = None) -> ModelLikelihood:
    """Mean NLL of `ids` and `greedy` tokens after its first `prompt_tokens`, on ONNX Runtime
    (`optimization_level`: 'basic' loads ModelOpt's int8 files, which ONNX Runtime 1.32's
    default level refuses). `session` replaces the one made from the path."""
    from flashnorm.validate.runners import make_session

    if session is None:
        try:
            session = make_session(model_path, providers=providers, optimization_level=optimization_level)
        except FlashNormError as exc:
            hint = " (ModelOpt's int8 files load at --optimization-level basic)" if optimization_level != "basic" else ""
            raise FlashNormError(f"{exc}{hint}") from None
    ids = [int(i) for i in ids]
    head_size = past_head_size(model_path)
    nll = float(token_nll(session, ids, window=window, head_size=head_size).mean())
    generated = greedy_tokens(session, ids[:prompt_tokens], greedy, head_size=head_size) if greedy else []
    return ModelLikelihood(os.fspath(model_path), nll, generated, quantized_ops(model_path), optimization_level)


def agreement(a: Sequence[int], b: Sequence[int]) -> int:
    """Positions at which two generations agree, counted up to their first difference."""
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count


@dataclasses.dataclass
class NllBudget:
    float_model: str
    reference: str
    candidate: str
    tokens: int
    text: str
    float_nll: float
    reference_nll: float
    candidate_nll: float
    reference_extra: float
    candidate_extra: float
    ratio: float | None
    """candidate_extra / reference_extra; None where reference_extra ≤ 0."""
    limit: float
    """The largest candidate_extra allowed, nats."""
    max_extra_ratio: float
    min_allowance: float
    prompt: list[int]
    float_greedy: list[int]
    reference_greedy: list[int]
    candidate_greedy: list[int]
    candidate_agrees_with_float: int
    """Greedy tokens equal to the float model's, up to the first difference."""
    candidate_agrees_with_reference: int
    reference_agrees_with_float: int
    quantized_ops: dict[str, dict[str, int]]
    optimization_level: str
    passed: bool

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def nll_limit(float_nll: float, reference_nll: float, *, max_extra_ratio: float = MAX_EXTRA_RATIO,
              min_allowance: float = MIN_ALLOWANCE) -> float:
    """The largest extra NLL (over the float model) a candidate may have: `max_extra_ratio`
    times the reference's extra NLL, or `min_allowance` where that extra is ≤ 0."""
    extra = reference_nll - float_nll
    return max_extra_ratio * extra if extra > 0 else min_allowance


def judge(float_result: ModelLikelihood, reference: ModelLikelihood, candidate: ModelLikelihood, *,
          tokens: int, text: str, prompt: Sequence[int], max_extra_ratio: float = MAX_EXTRA_RATIO,
          min_allowance: float = MIN_ALLOWANCE) -> NllBudget:
    """The budget's verdict from three measurements of the same token ids."""
    reference_extra = reference.nll - float_result.nll
    candidate_extra = candidate.nll - float_result.nll
    limit = nll_limit(float_result.nll, reference.nll, max_extra_ratio=max_extra_ratio, min_allowance=min_allowance)
    return NllBudget(
        float_model=float_result.model, reference=reference.model, candidate=candidate.model, tokens=tokens,
        text=text, float_nll=float_result.nll, reference_nll=reference.nll, candidate_nll=candidate.nll,
        reference_extra=reference_extra, candidate_extra=candidate_extra,
        ratio=candidate_extra / reference_extra if reference_extra > 0 else None, limit=limit,
        max_extra_ratio=max_extra_ratio, min_allowance=min_allowance, prompt=[int(t) for t in prompt],
        float_greedy=float_result.greedy, reference_greedy=reference.greedy, candidate_greedy=candidate.greedy,
        candidate_agrees_with_float=agreement(candidate.greedy, float_result.greedy),
        candidate_agrees_with_reference=agreement(candidate.greedy, reference.greedy),
        reference_agrees_with_float=agreement(reference.greedy, float_result.greedy),
        quantized_ops={"reference": reference.quantized_ops, "candidate": candidate.quantized_ops},
        optimization_level=candidate.optimization_level,
        passed=bool(np.isfinite(candidate.nll)) and candidate_extra <= limit,
    )


def judge_nll_budget(float_model: str | os.PathLike[str], reference: str | os.PathLike[str],
                     candidate: str | os.PathLike[str], ids: Sequence[int], *, text: str,
                     optimization_level: str = "all", float_optimization_level: str | None = None,
                     providers: Sequence[str] = ("CPUExecutionProvider",), window: int = DEFAULT_WINDOW,
                     greedy: int = GREEDY_TOKENS, max_extra_ratio: float = MAX_EXTRA_RATIO,
                     min_allowance: float = MIN_ALLOWANCE) -> NllBudget:
    """Measure the float model, the reference (unfolded quantized) and the candidate (folded
    quantized) on `ids` and judge the candidate. One session at a time."""
    ids = [int(i) for i in ids]
    common = dict(providers=providers, window=window, greedy=greedy)
    float_result = measure(float_model, ids, optimization_level=float_optimization_level or optimization_level,
                           **common)
    reference_result = measure(reference, ids, optimization_level=optimization_level, **common)
    candidate_result = measure(candidate, ids, optimization_level=optimization_level, **common)
    return judge(float_result, reference_result, candidate_result, tokens=len(ids), text=text,
                 prompt=ids[:PROMPT_TOKENS], max_extra_ratio=max_extra_ratio, min_allowance=min_allowance)


def format_nll_budget(report: dict[str, Any]) -> str:
    """A few lines: the three NLLs, the extras and the limit, the greedy agreement, the verdict."""
    ratio = f" ({report['ratio']:.3f}x)" if report["ratio"] is not None else ""
    rule = (f"extra ≤ {report['max_extra_ratio']:g} × the reference's" if report["reference_extra"] > 0
            else f"extra ≤ +{report['min_allowance']:g} nats: the reference is no worse than the float model")
    lines = [
        f"quantized budget: mean NLL per token on {report['text']} ({report['tokens']} tokens), "
        f"against the float model {report['float_model']}:",
        f"  float {report['float_nll']:.4f}, reference {report['reference_nll']:.4f} "
        f"(extra {report['reference_extra']:+.4f}), candidate {report['candidate_nll']:.4f} "
        f"(extra {report['candidate_extra']:+.4f}){ratio}; limit {report['limit']:+.4f}",
        f"  greedy {len(report['candidate_greedy'])} tokens: candidate agrees with the float model for "
        f"{report['candidate_agrees_with_float']}, with the reference for {report['candidate_agrees_with_reference']} "
        f"(reference with the float model: {report['reference_agrees_with_float']})",
        f"{'PASSED' if report['passed'] else 'FAILED'} ({rule})",
    ]
    return "\n".join(lines)
