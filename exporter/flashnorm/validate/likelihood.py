"""The quantized-model error budget (docs/QUANTIZATION.md): a folded quantized model is judged
by the negative log-likelihood it gives a fixed text, against the unfolded quantized model,
both measured against the float model.

A quantized model's logits differ from the float model's by far more than a half model's, and
elementwise or relative-L2 limits say little about what a user sees. The mean NLL per token of
real text does: the *extra* NLL of a quantized model over the float model is the quantizer's
damage, and the fold may add at most 10 % to it (`MAX_EXTRA_RATIO`), or +0.002 nats where the
unfolded quantized model is no worse than the float model (`MIN_ALLOWANCE`). That ratio comes
with a 95 % interval from a paired bootstrap over segments of the text (`validate.bootstrap`),
and the verdict is within, over or inconclusive. Greedy tokens after a prompt from the first
text are reported against both models; they are not judged.

The texts that ship with the package (`SHIPPED_TEXTS`, `data/`, about 2 000 SmolLM2 tokens each
of public-domain writing of four kinds; `data/README.md` says where each comes from) are the
default, all of them.

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
from typing import Any, Mapping, Sequence

import numpy as np

from flashnorm.errors import EXIT_FAILED_CHECK, EXIT_INCONCLUSIVE, FlashNormError
from flashnorm.validate import bootstrap

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


SHIPPED_TEXTS: dict[str, tuple[str, str]] = {
    "declaration": ("public_domain_text.txt", "political prose: the US Declaration of Independence and the "
                                              "Gettysburg Address"),
    "botchan": ("botchan.txt", "narrative prose: Natsume Soseki's Botchan, Yasotaro Morri's 1918 translation"),
    "midsummer": ("midsummer_nights_dream.txt", "drama in verse: Shakespeare's A Midsummer Night's Dream, Act I"),
    "sqlite": ("sqlite3_h.txt", "C code and technical writing: the SQLite C header, sqlite3.h"),
}
"""The texts that ship with the package (`--shipped-text NAME`; `all` for every one): name →
(file under `data/`, what kind of writing it is)."""
DEFAULT_SHIPPED_TEXT = "declaration"
"""The text `--shipped-text` without a name takes (the half budget's text before there were
several: each feed of the half budget holds both models' logits, 9 GB for this one)."""


def shipped_text(name: str = DEFAULT_SHIPPED_TEXT) -> str:
    """A text that ships with the package, without its header (the `#` lines it starts with)."""
    if name not in SHIPPED_TEXTS:
        raise FlashNormError(f"no shipped text {name!r}; choose from {', '.join(SHIPPED_TEXTS)} or all")
    raw = resources.files("flashnorm.validate").joinpath(f"data/{SHIPPED_TEXTS[name][0]}").read_text(encoding="utf-8")
    lines = raw.splitlines()
    while lines and lines[0].startswith("#"):  # the header; code below it may start lines with '#'
        lines.pop(0)
    return "\n".join(lines).strip() + "\n"


def shipped_text_names(choice: str | None) -> list[str]:
    """The names `--shipped-text CHOICE` takes: one, or every one for 'all' or None."""
    if choice in (None, "all"):
        return list(SHIPPED_TEXTS)
    if choice not in SHIPPED_TEXTS:
        raise FlashNormError(f"--shipped-text {choice}: no such text; choose from {', '.join(SHIPPED_TEXTS)} or all")
    return [choice]


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
    from pathlib import Path

    from flashnorm.untrusted import read_json

    config = Path(model_path).parent / "genai_config.json"
    if not config.exists():
        return None
    try:  # a FIFO, device or oversized file there is refused in one line, never waited on
        return int(read_json(config, "genai config")["model"]["decoder"]["head_size"])
    except (ValueError, KeyError, TypeError):
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


Texts = Mapping[str, Sequence[int]]
"""Token ids per text name: every text is measured alone, its NLLs kept apart."""


@dataclasses.dataclass
class ModelLikelihood:
    model: str
    nll: float
    """Mean NLL per predicted token over every text, nats."""
    text_nll: dict[str, float]
    """Mean NLL per predicted token of each text."""
    greedy: list[int]
    """Greedy tokens after the first text's first `prompt_tokens`."""
    quantized_ops: dict[str, int]
    optimization_level: str
    token_nll: dict[str, np.ndarray] = dataclasses.field(repr=False, default_factory=dict)
    """Each text's per-token NLLs (what the bootstrap resamples); not in reports."""


def _as_texts(ids: Texts | Sequence[int]) -> dict[str, list[int]]:
    if isinstance(ids, Mapping):
        return {name: [int(i) for i in values] for name, values in ids.items()}
    return {"ids": [int(i) for i in ids]}


def measure(model_path: str | os.PathLike[str], ids: Texts | Sequence[int], *, optimization_level: str = "all",
            providers: Sequence[str] = ("CPUExecutionProvider",), window: int = DEFAULT_WINDOW,
            prompt_tokens: int = PROMPT_TOKENS, greedy: int = GREEDY_TOKENS, session: Any = None) -> ModelLikelihood:
    """Mean NLL of `ids` (one text's token ids, or token ids per text name) and `greedy` tokens
    after the first text's first `prompt_tokens`, on ONNX Runtime (`optimization_level`: 'basic'
    loads ModelOpt's int8 files, which ONNX Runtime 1.32's default level refuses). `session`
    replaces the one made from the path."""
    from flashnorm.validate.runners import make_session

    if session is None:
        try:
            session = make_session(model_path, providers=providers, optimization_level=optimization_level)
        except FlashNormError as exc:
            hint = " (ModelOpt's int8 files load at --optimization-level basic)" if optimization_level != "basic" else ""
            raise FlashNormError(f"{exc}{hint}") from None
    texts = _as_texts(ids)
    head_size = past_head_size(model_path)
    per_token = {name: token_nll(session, values, window=window, head_size=head_size) for name, values in texts.items()}
    first = next(iter(texts.values()))
    generated = greedy_tokens(session, first[:prompt_tokens], greedy, head_size=head_size) if greedy else []
    return ModelLikelihood(os.fspath(model_path), float(np.concatenate(list(per_token.values())).mean()),
                           {name: float(values.mean()) for name, values in per_token.items()}, generated,
                           quantized_ops(model_path), optimization_level, per_token)


def agreement(a: Sequence[int], b: Sequence[int]) -> int:
    """Positions at which two generations agree, counted up to their first difference."""
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count


EXIT_CODES = {bootstrap.WITHIN: 0, bootstrap.OVER: EXIT_FAILED_CHECK, bootstrap.INCONCLUSIVE: EXIT_INCONCLUSIVE}
"""`flashnorm compare --budget`'s exit code per verdict (the CLI's table, flashnorm.errors):
0 within the budget, 1 over it, 4 inconclusive (more text would settle it)."""


@dataclasses.dataclass
class NllBudget:
    float_model: str
    reference: str
    candidate: str
    tokens: int
    """Token ids measured, all texts together (each window's first token is not predicted)."""
    text: str
    texts: dict[str, int]
    """Token ids per text."""
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
    interval: dict[str, Any]
    """The verdict over all texts with its 95 % interval (bootstrap.Interval)."""
    text_intervals: dict[str, dict[str, Any]]
    """The same for each text alone (reported, not judged)."""
    bootstrap: dict[str, Any]
    """How the interval was drawn: segment length (tokens), resamples, seed, confidence."""
    verdict: str
    """within, over or inconclusive (the interval's)."""
    exit_code: int
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
    """Within the budget: the whole interval under the line."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def nll_limit(float_nll: float, reference_nll: float, *, max_extra_ratio: float = MAX_EXTRA_RATIO,
              min_allowance: float = MIN_ALLOWANCE) -> float:
    """The largest extra NLL (over the float model) a candidate may have: `max_extra_ratio`
    times the reference's extra NLL, or `min_allowance` where that extra is ≤ 0."""
    extra = reference_nll - float_nll
    return max_extra_ratio * extra if extra > 0 else min_allowance


def judge(float_result: ModelLikelihood, reference: ModelLikelihood, candidate: ModelLikelihood, *,
          text: str, tokens: Mapping[str, int], prompt: Sequence[int], max_extra_ratio: float = MAX_EXTRA_RATIO,
          min_allowance: float = MIN_ALLOWANCE, block: int = bootstrap.DEFAULT_BLOCK,
          resamples: int = bootstrap.DEFAULT_RESAMPLES, seed: int = bootstrap.DEFAULT_SEED) -> NllBudget:
    """The budget's verdict from three measurements of the same texts (`tokens`: token ids per text)."""
    reference_extra = reference.nll - float_result.nll
    candidate_extra = candidate.nll - float_result.nll
    limit = nll_limit(float_result.nll, reference.nll, max_extra_ratio=max_extra_ratio, min_allowance=min_allowance)
    options = dict(max_extra_ratio=max_extra_ratio, min_allowance=min_allowance, block=block, resamples=resamples,
                   seed=seed)
    arrays = (float_result.token_nll, reference.token_nll, candidate.token_nll)
    overall = bootstrap.interval(*arrays, **options)
    if not np.isfinite(candidate.nll):
        overall = dataclasses.replace(overall, verdict=bootstrap.OVER, tokens_to_settle=None)
    by_text = bootstrap.per_text(*arrays, **options) if len(float_result.token_nll) > 1 else {}
    return NllBudget(
        float_model=float_result.model, reference=reference.model, candidate=candidate.model,
        tokens=sum(tokens.values()), text=text, texts=dict(tokens),
        float_nll=float_result.nll, reference_nll=reference.nll, candidate_nll=candidate.nll,
        reference_extra=reference_extra, candidate_extra=candidate_extra,
        ratio=candidate_extra / reference_extra if reference_extra > 0 else None, limit=limit,
        max_extra_ratio=max_extra_ratio, min_allowance=min_allowance, interval=overall.to_dict(),
        text_intervals={name: result.to_dict() for name, result in by_text.items()},
        bootstrap={"segment_tokens": block, "resamples": resamples, "seed": seed, "confidence": bootstrap.CONFIDENCE},
        verdict=overall.verdict, exit_code=EXIT_CODES[overall.verdict], prompt=[int(t) for t in prompt],
        float_greedy=float_result.greedy, reference_greedy=reference.greedy, candidate_greedy=candidate.greedy,
        candidate_agrees_with_float=agreement(candidate.greedy, float_result.greedy),
        candidate_agrees_with_reference=agreement(candidate.greedy, reference.greedy),
        reference_agrees_with_float=agreement(reference.greedy, float_result.greedy),
        quantized_ops={"reference": reference.quantized_ops, "candidate": candidate.quantized_ops},
        optimization_level=candidate.optimization_level, passed=overall.verdict == bootstrap.WITHIN,
    )


def judge_nll_budget(float_model: str | os.PathLike[str], reference: str | os.PathLike[str],
                     candidate: str | os.PathLike[str], ids: Texts | Sequence[int], *, text: str,
                     optimization_level: str = "all", float_optimization_level: str | None = None,
                     providers: Sequence[str] = ("CPUExecutionProvider",), window: int = DEFAULT_WINDOW,
                     greedy: int = GREEDY_TOKENS, max_extra_ratio: float = MAX_EXTRA_RATIO,
                     min_allowance: float = MIN_ALLOWANCE, block: int = bootstrap.DEFAULT_BLOCK,
                     resamples: int = bootstrap.DEFAULT_RESAMPLES, seed: int = bootstrap.DEFAULT_SEED) -> NllBudget:
    """Measure the float model, the reference (unfolded quantized) and the candidate (folded
    quantized) on `ids` (one text's token ids, or per text name) and judge the candidate. One
    session at a time."""
    texts = _as_texts(ids)
    common = dict(providers=providers, window=window, greedy=greedy)
    float_result = measure(float_model, texts, optimization_level=float_optimization_level or optimization_level,
                           **common)
    reference_result = measure(reference, texts, optimization_level=optimization_level, **common)
    candidate_result = measure(candidate, texts, optimization_level=optimization_level, **common)
    return judge(float_result, reference_result, candidate_result, text=text,
                 tokens={name: len(values) for name, values in texts.items()}, prompt=next(iter(texts.values()))[:PROMPT_TOKENS], max_extra_ratio=max_extra_ratio,
                 min_allowance=min_allowance, block=block, resamples=resamples, seed=seed)


def format_nll_budget(report: dict[str, Any]) -> str:
    """A few lines: the three NLLs, the extras and the limit, the ratio with its interval (over
    all texts, then per text), the greedy agreement, the verdict and its exit code."""
    ratio = f" ({report['ratio']:.3f}x)" if report["ratio"] is not None else ""
    rule = (f"extra ≤ {report['max_extra_ratio']:g} × the reference's" if report["reference_extra"] > 0
            else f"extra ≤ +{report['min_allowance']:g} nats: the reference is no worse than the float model")
    draws = report["bootstrap"]
    lines = [
        f"quantized budget: mean NLL per token on {report['text']} ({report['tokens']} tokens, "
        f"{report['interval']['tokens']} of them predicted), "
        f"against the float model {report['float_model']}:",
        f"  float {report['float_nll']:.4f}, reference {report['reference_nll']:.4f} "
        f"(extra {report['reference_extra']:+.4f}), candidate {report['candidate_nll']:.4f} "
        f"(extra {report['candidate_extra']:+.4f}){ratio}; limit {report['limit']:+.4f}",
        f"  {bootstrap.describe(report['interval'])}",
        f"  (paired bootstrap over segments of {draws['segment_tokens']} tokens, {draws['resamples']} resamples, "
        f"seed {draws['seed']})",
    ]
    if report["text_intervals"]:
        lines.append("  each text alone (reported, not judged):")
    for name, result in report["text_intervals"].items():
        lines.append(f"    {name} ({result['tokens']} tokens): {bootstrap.describe(result)}")
    lines += [
        f"  greedy {len(report['candidate_greedy'])} tokens: candidate agrees with the float model for "
        f"{report['candidate_agrees_with_float']}, with the reference for {report['candidate_agrees_with_reference']} "
        f"(reference with the float model: {report['reference_agrees_with_float']})",
        f"{_verdict_words(report)} ({rule}; exit {report['exit_code']}: 0 within, 1 over, 4 inconclusive)",
    ]
    return "\n".join(lines)


def _verdict_words(report: dict[str, Any]) -> str:
    if report["interval"].get("too_few_segments"):
        return "INCONCLUSIVE: too little text for an interval"
    return {bootstrap.WITHIN: "PASSED: within the budget", bootstrap.OVER: "FAILED: over the budget",
            bootstrap.INCONCLUSIVE: "INCONCLUSIVE: the interval spans the budget's line"}[report["verdict"]]
