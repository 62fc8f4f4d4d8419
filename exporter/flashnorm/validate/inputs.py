"""Inputs for a language-model graph: token ids (random, given, or tokenized text) plus the
attention mask, position ids and — for a KV-cache graph — past keys and values they imply."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import onnx

from flashnorm.errors import FlashNormError

_NUMPY_OF_ONNX = {
    onnx.TensorProto.FLOAT: np.float32,
    onnx.TensorProto.FLOAT16: np.float16,
    onnx.TensorProto.DOUBLE: np.float64,
    onnx.TensorProto.INT64: np.int64,
    onnx.TensorProto.INT32: np.int32,
    onnx.TensorProto.BOOL: np.bool_,
}


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: Any
    shape: tuple[int | str | None, ...]
    """Fixed sizes as ints, named dynamic axes as strings, unnamed ones as None."""


@dataclasses.dataclass(frozen=True)
class ModelSignature:
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    metadata: dict[str, str]

    def input(self, name: str) -> TensorSpec | None:
        return next((t for t in self.inputs if t.name == name), None)

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]

    @property
    def past_inputs(self) -> list[TensorSpec]:
        return [t for t in self.inputs if t.name.startswith("past_key_values.")]

    @property
    def vocab_size(self) -> int | None:
        logits = next((t for t in self.outputs if t.name == "logits"), None)
        size = logits.shape[-1] if logits is not None and logits.shape else None
        return size if isinstance(size, int) else None


def _spec(value: onnx.ValueInfoProto) -> TensorSpec:
    tensor = value.type.tensor_type
    dims = tuple(
        d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim
    )
    return TensorSpec(value.name, _NUMPY_OF_ONNX.get(tensor.elem_type), dims)


def read_signature(model_path: str | os.PathLike[str]) -> ModelSignature:
    """Inputs, outputs and metadata of an ONNX file, without reading external weights."""
    path = Path(model_path)
    if not path.is_file():
        raise FlashNormError(f"model file {path} does not exist")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf decode errors have no stable public type
        raise FlashNormError(f"{path} is not an ONNX model: {type(exc).__name__}") from None
    initializers = {t.name for t in model.graph.initializer}
    inputs = tuple(_spec(v) for v in model.graph.input if v.name not in initializers)
    outputs = tuple(_spec(v) for v in model.graph.output)
    return ModelSignature(inputs, outputs, {p.key: p.value for p in model.metadata_props})


def parse_input_ids(text: str) -> np.ndarray:
    """'1,2,3' or '1 2 3' → int64 array of shape [1, n]."""
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise FlashNormError(f"--input-ids must be integers separated by commas or spaces, got {text!r}") from None
    if not ids:
        raise FlashNormError("--input-ids is empty")
    return np.asarray([ids], dtype=np.int64)


def random_token_ids(vocab_size: int, batch: int, sequence: int, rng: np.random.Generator) -> np.ndarray:
    return rng.integers(0, vocab_size, size=(batch, sequence), dtype=np.int64)


def language_model_feeds(
    signature: ModelSignature,
    input_ids: np.ndarray,
    *,
    past_length: int = 0,
    rng: np.random.Generator | None = None,
    past: Mapping[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Feeds for a causal-LM graph: the given ids, a full attention mask, positions after
    the past, and (KV-cache graphs) the past keys/values: `past` when given (see
    `prefill_past`), else random ones of length `past_length`."""
    batch, sequence = input_ids.shape
    if past:
        past_length = next(iter(past.values())).shape[2]
    names = set(signature.input_names)
    vocab = signature.vocab_size
    if vocab is not None and (input_ids.min() < 0 or input_ids.max() >= vocab):
        raise FlashNormError(f"token ids must lie in [0, {vocab}) for this model; got {input_ids.min()}..{input_ids.max()}")
    past_inputs = signature.past_inputs
    if past_length and not past_inputs:
        raise FlashNormError("a past length was given but the model has no KV-cache inputs")
    total = (past_length if past_inputs else 0) + sequence
    feeds: dict[str, np.ndarray] = {"input_ids": input_ids.astype(np.int64)}
    if "attention_mask" in names:
        feeds["attention_mask"] = np.ones((batch, total), dtype=np.int64)
    if "position_ids" in names:
        start = total - sequence
        feeds["position_ids"] = np.broadcast_to(np.arange(start, total, dtype=np.int64), (batch, sequence)).copy()
    generator = rng if rng is not None else np.random.default_rng()
    if past:
        if set(past) != {spec.name for spec in past_inputs}:
            raise FlashNormError("the given past keys/values do not match the model's KV-cache inputs")
        feeds.update(past)
    for spec in past_inputs if not past else ():
        heads, head_dim = spec.shape[1], spec.shape[3]
        if not isinstance(heads, int) or not isinstance(head_dim, int):
            raise FlashNormError(f"KV-cache input {spec.name} has no fixed head count/size: {spec.shape}")
        feeds[spec.name] = generator.standard_normal((batch, heads, past_length, head_dim)).astype(spec.dtype or np.float32)
    unknown = names - set(feeds)
    if unknown:
        raise FlashNormError(f"cannot build inputs {sorted(unknown)}: not a language-model graph")
    return feeds


def prefill_past(session: Any, prefix_ids: np.ndarray) -> dict[str, np.ndarray]:
    """The past keys/values a real generation carries after `prefix_ids`: the KV-cache graph
    run (ONNX Runtime session) on the prefix with an empty past; present.* → past_key_values.*.
    Random past tensors are far outside what a model ever sees and inflate roundoff."""
    inputs = {i.name: i for i in session.get_inputs()}
    batch, length = prefix_ids.shape
    feeds: dict[str, np.ndarray] = {"input_ids": prefix_ids.astype(np.int64)}
    if "attention_mask" in inputs:
        feeds["attention_mask"] = np.ones((batch, length), dtype=np.int64)
    if "position_ids" in inputs:
        feeds["position_ids"] = np.broadcast_to(np.arange(length, dtype=np.int64), (batch, length)).copy()
    past_names = [name for name in inputs if name.startswith("past_key_values.")]
    if not past_names:
        raise FlashNormError("the model has no KV-cache inputs to prefill")
    for name in past_names:
        shape = inputs[name].shape
        feeds[name] = np.zeros((batch, shape[1], 0, shape[3]), dtype=np.float32)
    wanted = [name.replace("past_key_values.", "present.") for name in past_names]
    return dict(zip(past_names, session.run(wanted, feeds)))


def tokenize(text: str, tokenizer: Any) -> np.ndarray:
    ids = tokenizer(text, return_tensors="np")["input_ids"].astype(np.int64)
    if ids.size == 0:
        raise FlashNormError(f"the tokenizer produced no tokens for {text!r}")
    return ids


def tokenizer_for(model_path: str | os.PathLike[str], tokenizer: str | None = None) -> Any:
    """The tokenizer named by `tokenizer` (HF directory, .gguf file or --model name), else the
    one recorded in the model's metadata by `flashnorm export`."""
    from flashnorm.export.sources import KNOWN_MODELS, ModelSource, load_tokenizer, resolve_source

    if tokenizer is not None:
        if tokenizer.lower() in KNOWN_MODELS:
            source = resolve_source(model=tokenizer)
        else:
            source = resolve_source(tokenizer)
        return load_tokenizer(source)
    metadata = read_signature(model_path).metadata
    directory = metadata.get("flashnorm.source_dir")
    if not directory or not Path(directory).is_dir():
        raise FlashNormError(
            f"{model_path} does not record its source model; pass --tokenizer (HF directory, .gguf or model name)"
        )
    return load_tokenizer(ModelSource(Path(directory), metadata.get("flashnorm.gguf_file")))


def describe_ids(ids: np.ndarray, limit: int = 16) -> str:
    flat = ids.reshape(-1).tolist()
    shown = ", ".join(str(i) for i in flat[:limit])
    return f"[{shown}{', …' if len(flat) > limit else ''}] shape {list(ids.shape)}"


def as_int_sequence(ids: Sequence[int] | np.ndarray) -> list[int]:
    return [int(i) for i in np.asarray(ids).reshape(-1)]
