"""The inputs `flashnorm compare` feeds both models: token ids (seeded random, given, or a text
through the model's tokenizer, with an optional prefilled KV cache) for a token model, seeded
random tensors from the declared dtypes and shapes for any other model."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence

import numpy as np

from flashnorm.errors import FlashNormError
from flashnorm.validate.inputs import (
    ModelSignature,
    describe_ids,
    describe_random_feeds,
    dtype_name,
    format_shape,
    language_model_feeds,
    parse_input_ids,
    parse_input_shapes,
    parse_value_ranges,
    prefill_past,
    random_feeds,
    random_token_ids,
    read_signature,
    resolve_input_shapes,
    tokenize,
    tokenizer_for,
)
from flashnorm.validate.runners import make_session

DEFAULT_BATCH, DEFAULT_SEQUENCE = 2, 16


@dataclasses.dataclass(frozen=True)
class FeedOptions:
    """What the user asked to feed (the `flashnorm compare` input options, by their flag names)."""

    text: str | None = None
    input_ids: str | None = None
    shipped_text: str | None = None
    """A shipped text's name, or 'all' (likelihood.SHIPPED_TEXTS)."""
    tokenizer: str | None = None
    batch: int | None = None
    sequence: int | None = None
    iterations: int = 1
    past_length: int = 0
    seed: int | None = None
    generate: int = 0
    input_shapes: Sequence[str] = ()
    val_range: Sequence[str] = ()


def build_feeds(
    reference: str | os.PathLike[str], candidate: str | os.PathLike[str], options: FeedOptions
) -> tuple[list[dict[str, np.ndarray]], dict[str, Any], np.ndarray | None]:
    """The feed dicts both models get, their description for the report, and the token ids of
    the first (None for a model without input_ids). Bad options: FlashNormError naming the flag."""
    signature = read_signature(reference)
    seed = options.seed if options.seed is not None else int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    if "input_ids" not in signature.input_names:
        feeds, description = _random_tensor_feeds(reference, candidate, options, signature, seed, rng)
        return feeds, description, None
    if options.input_shapes or options.val_range:
        raise FlashNormError(
            f"--input-shapes/--val-range are for models without input_ids; {reference} is a token model: "
            "use --batch/--sequence/--input-ids/--text"
        )
    batch = DEFAULT_BATCH if options.batch is None else options.batch
    sequence = DEFAULT_SEQUENCE if options.sequence is None else options.sequence
    description: dict[str, Any] = {"seed": seed}
    if options.text is not None or options.input_ids is not None or options.shipped_text:
        if options.shipped_text:
            from flashnorm.validate.likelihood import shipped_text, shipped_text_names

            tokenizer = tokenizer_for(reference, options.tokenizer)
            # One feed per text: the texts differ in length, and each is measured from its start.
            id_batches = [tokenize(shipped_text(name), tokenizer) for name in shipped_text_names(options.shipped_text)]
            description["text"] = "the shipped public-domain texts " + ", ".join(
                f"{name} ({ids.size} tokens)" for name, ids in zip(shipped_text_names(options.shipped_text), id_batches))
        elif options.text is not None:
            id_batches = [tokenize(options.text, tokenizer_for(reference, options.tokenizer))]
            description["text"] = options.text
        else:
            id_batches = [parse_input_ids(options.input_ids)]
        description["input_ids"] = describe_ids(id_batches[0])
        flag = "--shipped-text" if options.shipped_text else "--text" if options.text is not None else "--input-ids"
        check_context(signature, max(ids.shape[1] for ids in id_batches) + options.past_length + options.generate,
                      flag + ("/--past-length" if options.past_length else "") + ("/--generate" if options.generate else ""))
    else:
        for name, value in (("batch", batch), ("sequence", sequence), ("iterations", options.iterations)):
            if value < 1:
                raise FlashNormError(f"--{name} must be at least 1")
        vocab = signature.vocab_size
        if vocab is None:
            raise FlashNormError("cannot draw random token ids: the logits output has no fixed vocabulary size")
        check_context(signature, sequence + options.past_length + options.generate,
                      "--sequence" + ("/--past-length" if options.past_length else "") + ("/--generate" if options.generate else ""))
        check_memory("--batch/--sequence/--iterations", token_model_bytes(batch, sequence, vocab, options.iterations))
        id_batches = [random_token_ids(vocab, batch, sequence, rng) for _ in range(options.iterations)]
        description["random_token_ids"] = f"{options.iterations} × [{batch}, {sequence}] in [0, {vocab})"
    if options.past_length < 0:
        raise FlashNormError("--past-length must be at least 0")
    if not options.past_length:
        return [language_model_feeds(signature, ids) for ids in id_batches], description, id_batches[0]
    if not signature.past_inputs or signature.vocab_size is None:
        raise FlashNormError("--past-length needs a model with KV-cache inputs (flashnorm export --kv-cache)")
    # The past both models get is the one the reference itself produces for a random prefix:
    # random tensors as keys/values would be far outside anything the model ever sees.
    from flashnorm.validate.bfloat16 import BFLOAT16, emulated_session, precision

    session = emulated_session(str(reference)) if precision(reference)[0] == BFLOAT16 else make_session(reference)
    feeds = []
    for ids in id_batches:
        prefix = random_token_ids(signature.vocab_size, ids.shape[0], options.past_length, rng)
        feeds.append(language_model_feeds(signature, ids, past=prefill_past(session, prefix)))
    description["past"] = f"{options.past_length} tokens, prefilled by the reference from random token ids"
    return feeds, description, id_batches[0]


def _random_tensor_feeds(
    reference: str | os.PathLike[str], candidate_path: str | os.PathLike[str], options: FeedOptions,
    signature: ModelSignature, seed: int, rng: np.random.Generator,
) -> tuple[list[dict[str, np.ndarray]], dict[str, Any]]:
    """Feeds for a model without input_ids: seeded random tensors for every input of the
    reference, which the candidate must take by the same names, dtypes and shapes."""
    token_options = [flag for flag, given in (
        ("--text", options.text is not None), ("--input-ids", options.input_ids is not None),
        ("--shipped-text", options.shipped_text),
        ("--tokenizer", options.tokenizer is not None), ("--batch", options.batch is not None),
        ("--sequence", options.sequence is not None), ("--past-length", options.past_length != 0),
        ("--generate", options.generate != 0),
    ) if given]
    if token_options:
        raise FlashNormError(
            f"{'/'.join(token_options)}: only for token models, and {reference} has no input_ids input "
            f"(inputs: {signature.input_names}); use --input-shapes/--val-range"
        )
    if options.iterations < 1:
        raise FlashNormError("--iterations must be at least 1")
    candidate = read_signature(candidate_path)
    if set(signature.input_names) != set(candidate.input_names):
        raise FlashNormError(
            f"the models take different inputs: reference {sorted(signature.input_names)} "
            f"vs candidate {sorted(candidate.input_names)}"
        )
    shapes = resolve_input_shapes(signature.inputs, parse_input_shapes(options.input_shapes))
    for spec in signature.inputs:
        other = candidate.input(spec.name)
        if dtype_name(spec.dtype) != dtype_name(other.dtype):
            raise FlashNormError(
                f"input {spec.name} is {dtype_name(spec.dtype)} in the reference but {dtype_name(other.dtype)} "
                "in the candidate; both models get the same feeds"
            )
        fed = shapes[spec.name]
        if not other.has_shape or len(other.shape) != len(fed) or any(
            isinstance(declared, int) and declared != size for declared, size in zip(other.shape, fed)
        ):
            declared = format_shape(other.shape) if other.has_shape else "no shape"
            raise FlashNormError(
                f"input {spec.name}: the candidate declares {declared} and cannot take the shape {list(fed)} "
                "fed to the reference; set it with --input-shapes"
            )
    itemsizes = {spec.name: _itemsize(spec.dtype) for spec in signature.inputs}
    feed_bytes = sum(int(np.prod(shape, dtype=np.float64)) * itemsizes[name] for name, shape in shapes.items())
    # Both models' outputs are at least of the inputs' order: twice the feeds per iteration.
    check_memory("--input-shapes/--iterations", 3 * feed_bytes * options.iterations)
    ranges = parse_value_ranges(options.val_range)
    drawn = describe_random_feeds(signature.inputs, shapes, ranges)
    bfloat16 = [spec.name for spec in signature.inputs if dtype_name(spec.dtype) == "bfloat16"]
    if bfloat16:
        raise FlashNormError(
            f"bfloat16 input(s) {bfloat16}: ONNX Runtime's Python API (the reference runner) takes no bfloat16 arrays"
        )
    feeds = [random_feeds(signature.inputs, shapes, rng, ranges) for _ in range(options.iterations)]
    description: dict[str, Any] = {"seed": seed, "iterations": options.iterations}
    description.update({f"input {name}": text for name, text in drawn.items()})
    return feeds, description


CONTEXT_LENGTH_KEY = "flashnorm.context_length"
"""The ONNX metadata key where `flashnorm export` records the model's trained context
(max_position_embeddings): positions beyond it are refused before any model runs."""


def context_length(signature: ModelSignature) -> int | None:
    """The context recorded in the model's metadata, None where it records none (other exporters)."""
    try:
        length = int(signature.metadata.get(CONTEXT_LENGTH_KEY, ""))
    except ValueError:
        return None
    return length if length > 0 else None


def check_context(signature: ModelSignature, tokens: int, flags: str) -> None:
    """Refuse `tokens` positions (prompt, past and generated together) beyond the model's context."""
    limit = context_length(signature)
    if limit is not None and tokens > limit:
        raise FlashNormError(f"{flags}: {tokens} positions exceed the model's context of {limit} tokens "
                             "(max_position_embeddings, recorded by flashnorm export); choose fewer")


def token_model_bytes(batch: int, sequence: int, vocab: int, iterations: int) -> float:
    """A lower bound of what comparing a token model on random ids holds at once: every
    iteration's ids and both models' float32 logits, plus one [batch, sequence, sequence]
    float32 attention-score matrix while a model runs."""
    tokens = float(batch) * sequence
    return iterations * tokens * (8 + 2 * 4 * vocab) + tokens * sequence * 4


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where it cannot be read)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_memory(flags: str, needed: float) -> None:
    """Refuse sizes whose lower-bound memory exceeds what this machine has available, before
    anything is allocated (a MemoryError or the kernel's OOM killer would follow)."""
    available = available_memory()
    if available is not None and needed > available:
        raise FlashNormError(f"{flags}: these sizes need at least {needed / 2**30:.3g} GiB, and this machine has "
                             f"{available / 2**30:.3g} GiB available; choose smaller sizes")


def _itemsize(dtype: Any) -> int:
    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        return 8
