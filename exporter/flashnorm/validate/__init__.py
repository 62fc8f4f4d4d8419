"""Validation: compare a FlashNorm model with its original (Polygraphy, ONNX Runtime as the
reference; other runners plug in as factories) and compare greedy generations token by token."""

from flashnorm.validate.comparison import (
    DEFAULT_ATOL,
    DEFAULT_MAX_REL_L2,
    DEFAULT_RTOL,
    ComparisonReport,
    OutputError,
    compare_models,
    error_statistics,
    exact_name,
    format_report,
)
from flashnorm.validate.generate import GenerationComparison, compare_generation, greedy_generate
from flashnorm.validate.inputs import (
    ModelSignature,
    language_model_feeds,
    parse_input_ids,
    prefill_past,
    random_token_ids,
    read_signature,
    tokenize,
    tokenizer_for,
)
from flashnorm.validate.runners import RunnerFactory, make_session, onnxrt_runner_factory

__all__ = [
    "DEFAULT_ATOL", "DEFAULT_MAX_REL_L2", "DEFAULT_RTOL", "ComparisonReport", "GenerationComparison",
    "ModelSignature", "OutputError", "RunnerFactory", "compare_generation", "compare_models",
    "error_statistics", "exact_name", "format_report", "greedy_generate", "language_model_feeds",
    "make_session", "onnxrt_runner_factory", "parse_input_ids", "prefill_past", "random_token_ids", "read_signature",
    "tokenize", "tokenizer_for",
]
