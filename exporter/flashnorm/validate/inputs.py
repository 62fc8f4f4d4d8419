"""Inputs for a comparison. A language-model graph (one with `input_ids`) gets token ids
(random, given, or tokenized text) plus the attention mask, position ids and — for a KV-cache
graph — past keys and values they imply. Any other graph gets seeded random tensors for every
input, drawn from its declared dtype and shape (`random_feeds`)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import onnx

from flashnorm.errors import FlashNormError
from flashnorm.modelio import read_interface

DEFAULT_LEADING_DIM = 1
"""Size of an unresolved dynamic first axis of an input of rank ≥ 2 (batch-like)."""
DEFAULT_DYNAMIC_DIM = 16
"""Size of every other unresolved dynamic axis."""
DEFAULT_INT_RANGE = (0, 16)
"""Random integer inputs lie in [low, high)."""


def _numpy_dtype(elem_type: int) -> Any:
    """The NumPy dtype of an ONNX element type (bfloat16 through ml_dtypes), None if it has none."""
    if elem_type == onnx.TensorProto.UNDEFINED:
        return None
    try:
        return onnx.helper.tensor_dtype_to_np_dtype(elem_type)
    except (KeyError, ValueError):
        return None


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: Any
    shape: tuple[int | str | None, ...]
    """Fixed sizes as ints, named dynamic axes as strings, unnamed ones as None."""
    has_shape: bool = True
    """False when the graph declares no shape at all (not even the rank)."""


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
    return TensorSpec(value.name, _numpy_dtype(tensor.elem_type), dims, tensor.HasField("shape"))


def read_signature(model_path: str | os.PathLike[str]) -> ModelSignature:
    """Inputs, outputs and metadata of an ONNX file, without reading external weights."""
    interface = read_interface(model_path)
    return ModelSignature(
        tuple(_spec(v) for v in interface.inputs), tuple(_spec(v) for v in interface.outputs), interface.metadata
    )


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
        dtype = np.float16 if inputs[name].type == "tensor(float16)" else np.float32  # fp16 KV caches
        feeds[name] = np.zeros((batch, shape[1], 0, shape[3]), dtype=dtype)
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
    from flashnorm.export.sources import KNOWN_MODELS, load_tokenizer, resolve_source

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
    # Names read from inside the model: checked as a source given on the command line is, the
    # GGUF file a plain name in that directory (docs/SECURITY.md).
    gguf = metadata.get("flashnorm.gguf_file")
    if gguf and (gguf in (".", "..") or Path(gguf).name != gguf or "\x00" in gguf):
        raise FlashNormError(f"{model_path} records the GGUF file {gguf!r}, not a file name; pass --tokenizer")
    return load_tokenizer(resolve_source(Path(directory) / gguf if gguf else directory))


def describe_ids(ids: np.ndarray, limit: int = 16) -> str:
    flat = ids.reshape(-1).tolist()
    shown = ", ".join(str(i) for i in flat[:limit])
    return f"[{shown}{', …' if len(flat) > limit else ''}] shape {list(ids.shape)}"


def as_int_sequence(ids: Sequence[int] | np.ndarray) -> list[int]:
    return [int(i) for i in np.asarray(ids).reshape(-1)]


# ── any other graph: seeded random tensors from the declared dtypes and shapes ─────────────

def format_shape(shape: Sequence[int | str | None]) -> str:
    """A declared shape for messages: [batch, ?, 576] (? is an unnamed dynamic axis)."""
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def dtype_name(dtype: Any) -> str:
    return np.dtype(dtype).name if dtype is not None else "undefined"


def parse_input_shapes(specs: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """['x:2x16x32', 'scalar:'] → {'x': (2, 16, 32), 'scalar': ()} (trtexec's 'x' spelling)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for spec in specs:
        name, sep, text = spec.rpartition(":")
        if not sep or not name:
            raise FlashNormError(f"bad --input-shapes {spec!r}: expected NAME:D1xD2x... (e.g. x:1x16x576)")
        try:
            shape = tuple(int(d) for d in text.lower().split("x")) if text.strip() else ()
        except ValueError:
            raise FlashNormError(
                f"bad --input-shapes {spec!r}: write dimensions as integers joined by 'x', e.g. 1x16x576"
            ) from None
        if any(d < 0 for d in shape):
            raise FlashNormError(f"bad --input-shapes {spec!r}: dimensions must not be negative")
        if name in shapes:
            raise FlashNormError(f"--input-shapes gives input {name!r} twice")
        shapes[name] = shape
    return shapes


def parse_value_ranges(specs: Sequence[str]) -> dict[str | None, tuple[float, float]]:
    """['ids:0,100', '[-1,1]'] → {'ids': (0, 100), None: (-1, 1)}: None is the range for every
    input not named. Brackets, as Polygraphy writes them, are optional."""
    ranges: dict[str | None, tuple[float, float]] = {}
    for spec in specs:
        name, _, text = spec.rpartition(":")
        parts = text.strip().strip("[]()").split(",")
        try:
            low, high = (float(p) for p in parts)
        except ValueError:
            raise FlashNormError(f"bad --val-range {spec!r}: expected NAME:LO,HI (e.g. input_ids:0,100)") from None
        if not (np.isfinite(low) and np.isfinite(high) and low < high):
            raise FlashNormError(f"bad --val-range {spec!r}: need finite LO < HI")
        key = name or None
        if key in ranges:
            raise FlashNormError(f"--val-range gives {'input ' + repr(name) if name else 'the default range'} twice")
        ranges[key] = (low, high)
    return ranges


def resolve_input_shapes(
    inputs: Sequence[TensorSpec], given: Mapping[str, tuple[int, ...]] | None = None
) -> dict[str, tuple[int, ...]]:
    """A concrete shape for every input. A shape in `given` (--input-shapes) must agree with
    the declared rank and fixed sizes, and fixes its named dynamic axes for every other input
    that shares the name (x and skip both [batch, seq, 576]). An axis still unresolved takes
    DEFAULT_LEADING_DIM as the first axis of an input of rank ≥ 2, else DEFAULT_DYNAMIC_DIM.
    An input that declares no shape at all is refused: Polygraphy's runners take its missing
    shape for a scalar and refuse any other."""
    given = dict(given or {})
    names = [spec.name for spec in inputs]
    unknown = [name for name in given if name not in names]
    if unknown:
        raise FlashNormError(f"--input-shapes names {unknown}, not inputs of the model; inputs: {names}")
    shapeless = [spec.name for spec in inputs if not spec.has_shape]
    if shapeless:
        raise FlashNormError(
            f"input(s) {shapeless} declare no shape, not even a rank, so they cannot be fed; "
            "declare one in the model (e.g. with ONNX shape inference)"
        )
    bound: dict[str, tuple[int, str]] = {}  # axis name → (size, the input whose given shape fixed it)
    for spec in inputs:
        shape = given.get(spec.name)
        if shape is None:
            continue
        if len(shape) != len(spec.shape):
            raise FlashNormError(
                f"--input-shapes {spec.name}: {list(shape)} has rank {len(shape)}, "
                f"but {spec.name} is declared {format_shape(spec.shape)}"
            )
        for declared, size in zip(spec.shape, shape):
            if isinstance(declared, int) and declared != size:
                raise FlashNormError(
                    f"--input-shapes {spec.name}: {list(shape)} does not fit the declared {format_shape(spec.shape)}"
                )
            if isinstance(declared, str):
                if declared in bound and bound[declared][0] != size:
                    size_before, other = bound[declared]
                    raise FlashNormError(
                        f"--input-shapes: axis {declared!r} is {size_before} in {other} but {size} in {spec.name}"
                    )
                bound[declared] = (size, spec.name)
    sizes = {axis: size for axis, (size, _) in bound.items()}
    shapes: dict[str, tuple[int, ...]] = {}
    for spec in inputs:
        if spec.name in given:
            shapes[spec.name] = given[spec.name]
            continue
        dims = []
        for axis, declared in enumerate(spec.shape):
            if isinstance(declared, int):
                dims.append(declared)
                continue
            if declared not in sizes:
                size = DEFAULT_LEADING_DIM if axis == 0 and len(spec.shape) >= 2 else DEFAULT_DYNAMIC_DIM
                if declared is None:
                    dims.append(size)
                    continue
                sizes[declared] = size
            dims.append(sizes[declared])
        shapes[spec.name] = tuple(dims)
    return shapes


def _kind(spec: TensorSpec) -> str:
    """'float', 'int' or 'bool'; anything else (strings, complex, undefined) cannot be drawn."""
    if spec.dtype is not None:
        dtype = np.dtype(spec.dtype)
        if dtype == np.bool_:
            return "bool"
        if np.issubdtype(dtype, np.integer):
            return "int"
        if dtype.kind == "f" or dtype.name == "bfloat16":
            return "float"
    raise FlashNormError(
        f"input {spec.name} has element type {dtype_name(spec.dtype)}; random inputs cover float, integer and bool"
    )


def _range_for(
    spec: TensorSpec, kind: str, ranges: Mapping[str | None, tuple[float, float]]
) -> tuple[float, float] | None:
    """The --val-range that applies to `spec`, checked against its dtype; None: the default."""
    chosen = ranges.get(spec.name)
    if chosen is None:
        chosen = ranges.get(None)
        if chosen is None or kind == "bool":  # a blanket range skips bool inputs
            return None
    if kind == "bool":
        raise FlashNormError(f"--val-range {spec.name}: a bool input takes no range (it is drawn True/False)")
    low, high = chosen
    if kind == "int":
        info = np.iinfo(np.dtype(spec.dtype))
        if not (float(low).is_integer() and float(high).is_integer()):
            raise FlashNormError(f"--val-range for integer input {spec.name} must be integers, got [{low:g}, {high:g})")
        if low < info.min or high - 1 > info.max:
            raise FlashNormError(
                f"--val-range [{low:g}, {high:g}) does not fit input {spec.name} ({np.dtype(spec.dtype).name})"
            )
    return low, high


def random_feeds(
    inputs: Sequence[TensorSpec],
    shapes: Mapping[str, tuple[int, ...]],
    rng: np.random.Generator,
    value_ranges: Mapping[str | None, tuple[float, float]] | None = None,
) -> dict[str, np.ndarray]:
    """One random feed dict: floats standard normal (computed in float64, then cast, so fp16 and
    bf16 inputs get the nearest representable values), or uniform in a --val-range; integers
    uniform in [low, high) (default DEFAULT_INT_RANGE); bools True/False with equal odds."""
    ranges = dict(value_ranges or {})
    names = [spec.name for spec in inputs]
    unknown = [name for name in ranges if name is not None and name not in names]
    if unknown:
        raise FlashNormError(f"--val-range names {unknown}, not inputs of the model; inputs: {names}")
    feeds: dict[str, np.ndarray] = {}
    for spec in inputs:
        kind = _kind(spec)
        chosen = _range_for(spec, kind, ranges)
        shape = shapes[spec.name]
        if kind == "bool":
            value = rng.integers(0, 2, size=shape).astype(np.bool_)
        elif kind == "int":
            low, high = chosen or DEFAULT_INT_RANGE
            value = rng.integers(int(low), int(high), size=shape, dtype=np.dtype(spec.dtype))
        elif chosen is not None:
            value = rng.uniform(chosen[0], chosen[1], size=shape).astype(spec.dtype)
        else:
            value = rng.standard_normal(size=shape).astype(spec.dtype)
        feeds[spec.name] = value
    return feeds


def describe_random_feeds(
    inputs: Sequence[TensorSpec],
    shapes: Mapping[str, tuple[int, ...]],
    value_ranges: Mapping[str | None, tuple[float, float]] | None = None,
) -> dict[str, str]:
    """Per input, what `random_feeds` draws: 'float16 [1, 16, 32] normal(0, 1)'."""
    ranges = dict(value_ranges or {})
    described = {}
    for spec in inputs:
        kind = _kind(spec)
        chosen = _range_for(spec, kind, ranges)
        if kind == "bool":
            values = "True/False"
        elif kind == "int":
            low, high = chosen or DEFAULT_INT_RANGE
            values = f"integers in [{int(low)}, {int(high)})"
        elif chosen is not None:
            values = f"uniform in [{chosen[0]:g}, {chosen[1]:g})"
        else:
            values = "normal(0, 1)"
        described[spec.name] = f"{np.dtype(spec.dtype).name} {list(shapes[spec.name])} {values}"
    return described
