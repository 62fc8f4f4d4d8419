"""Torch → ONNX for causal language models and small modules, with both torch exporters.

The legacy TorchScript exporter (`dynamo=False`, opset 17 by default) spells RMSNorm as
`Pow → ReduceMean → Add → Sqrt → Div → Mul`; the dynamo exporter (opset 23 by default) emits
`RMSNormalization`. Both graphs take `input_ids`, `attention_mask` and `position_ids` with a
dynamic batch and sequence and return `logits`; with a KV cache they also take
`past_key_values.<i>.key/value` and return `present.<i>.key/value`.

`dtype` (fp32, fp16, bf16) is the type of the weights and of every activation, past and
present keys/values and the logits included: the model is exported as transformers runs it
at that dtype, so each RMSNorm is computed in fp32 inside the graph (Cast up, mean of
squares, rsqrt, Cast down, then the gain in the model's type). The logits stay in the
chosen type, as the framework returns them: the LM head's MatMul rounds its output to that
type, so a Cast to fp32 after it would add 2 bytes per vocabulary entry and token (98 KB
per SmolLM2 token) and no information.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import logging
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import numpy as np
import onnx
import onnx.numpy_helper

from flashnorm.errors import FlashNormError
from flashnorm.files import StagedFile, atomic_write
from flashnorm.modelio.saving import EXTERNAL_DATA_THRESHOLD, INLINE_TENSOR_BYTES, commit_model_with_data
from flashnorm.progress import Progress

if TYPE_CHECKING:
    from flashnorm.export.encoders import Encoder

DEFAULT_OPSET = {False: 17, True: 23}
"""Default opset per exporter (key: dynamo)."""

INPUT_NAMES = ("input_ids", "attention_mask", "position_ids")
DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
"""`--dtype` names → torch dtype names."""
LOGITS = "logits"
# Example sizes for tracing: distinct from each other so that no axis is mistaken for another.
_EXAMPLE_BATCH, _EXAMPLE_SEQUENCE, _EXAMPLE_PAST = 2, 5, 3


def say(message: str) -> None:
    """One progress line on stderr (silenced with the CLI's --quiet, like every Progress)."""
    if Progress.enabled:
        print(message, file=sys.stderr, flush=True)


def past_names(layer: int) -> tuple[str, str]:
    return f"past_key_values.{layer}.key", f"past_key_values.{layer}.value"


def present_names(layer: int) -> tuple[str, str]:
    return f"present.{layer}.key", f"present.{layer}.value"


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """Shape of each layer's cached keys and values: [batch, kv_heads, sequence, head_dim]."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config: Any) -> "KVLayout":
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        return cls(text.num_hidden_layers, kv_heads, head_dim)


@dataclasses.dataclass(frozen=True)
class ExportSpec:
    """Names, example values and dynamic axes of one export."""

    input_names: list[str]
    output_names: list[str]
    example_inputs: tuple[Any, ...]
    dynamic_axes: dict[str, dict[int, str]]
    varargs_from: int | None = None
    """Index of the first input the module takes as `*args` (torch.export sees them as one
    tuple), or None."""


def torch_dtype_name(dtype: str) -> str:
    """'fp16' (or 'float16') → 'float16'; anything else FlashNormError with one line."""
    if dtype in DTYPES.values():
        return dtype
    if dtype not in DTYPES:
        raise FlashNormError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    return DTYPES[dtype]


def causal_lm_spec(vocab_size: int, kv: KVLayout | None, dtype: str = "float32", *,
                   positions: bool = True) -> ExportSpec:
    """The signature of an exported causal LM, with example inputs for tracing (past keys
    and values in `dtype`, a torch dtype name). Without `positions` there is no position_ids
    input (BLOOM's ALiBi attention takes none)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    batch, sequence = _EXAMPLE_BATCH, _EXAMPLE_SEQUENCE
    past = _EXAMPLE_PAST if kv else 0
    input_ids = torch.randint(0, vocab_size, (batch, sequence), generator=generator)
    attention_mask = torch.ones(batch, past + sequence, dtype=torch.int64)
    position_ids = torch.arange(past, past + sequence).expand(batch, sequence).contiguous()
    inputs: list[Any] = [input_ids, attention_mask, position_ids][:3 if positions else 2]
    names = list(INPUT_NAMES[:3 if positions else 2])
    outputs = [LOGITS]
    axes: dict[str, dict[int, str]] = {
        "input_ids": {0: "batch", 1: "sequence"},
        "attention_mask": {0: "batch", 1: "total_sequence" if kv else "sequence"},
        "position_ids": {0: "batch", 1: "sequence"},
        LOGITS: {0: "batch", 1: "sequence"},
    }
    if kv:
        shape = (batch, kv.num_kv_heads, past, kv.head_dim)
        for layer in range(kv.num_layers):
            for name in past_names(layer):
                inputs.append(torch.randn(shape, generator=generator).to(getattr(torch, dtype)))
                names.append(name)
                axes[name] = {0: "batch", 2: "past_sequence"}
            for name in present_names(layer):
                outputs.append(name)
                axes[name] = {0: "batch", 2: "total_sequence"}
    if not positions:
        del axes["position_ids"]
    # KVCacheModel.forward(input_ids, attention_mask, *rest): position ids and the past arrive as varargs.
    return ExportSpec(names, outputs, tuple(inputs), axes, varargs_from=2 if kv else None)


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    # The exporters warn about every traced Python branch and about their own deprecation;
    # none of it is actionable for a user of `flashnorm export`.
    registration = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registration.level
    registration.setLevel(logging.ERROR)  # "torchvision is not installed": irrelevant here
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        registration.setLevel(level)


def export_module(
    module: Any,
    output: str | os.PathLike[str],
    spec: ExportSpec,
    *,
    dynamo: bool = False,
    opset: int | None = None,
    constant_folding: bool = True,
) -> onnx.ModelProto:
    """Export `module` called with `spec.example_inputs`; returns the ONNX model in memory
    (with its weights) without writing `output` — `output` only names the temporary files.
    `constant_folding` is the legacy exporter's (the dynamo exporter always optimizes)."""
    import torch

    opset = opset or DEFAULT_OPSET[dynamo]
    with tempfile.TemporaryDirectory(prefix=".flashnorm-export-", dir=Path(output).parent) as scratch:
        path = Path(scratch) / Path(output).name
        with _quiet_exporter(), torch.no_grad(), _exporter_errors(dynamo), _conv1d_as_matmul(module):
            if dynamo:
                program = torch.onnx.export(
                    module, spec.example_inputs, dynamo=True, opset_version=opset,
                    input_names=spec.input_names, output_names=spec.output_names,
                    dynamic_shapes=_dynamic_shapes(spec), verbose=False,
                )
                program.save(str(path))
            else:
                torch.onnx.export(
                    module, spec.example_inputs, str(path), dynamo=False, opset_version=opset,
                    input_names=spec.input_names, output_names=spec.output_names,
                    dynamic_axes=spec.dynamic_axes, do_constant_folding=constant_folding,
                )
        return onnx.load(str(path), load_external_data=True)


@contextlib.contextmanager
def _conv1d_as_matmul(module: Any) -> Iterator[None]:
    """Trace GPT-2-style Conv1D layers (weight [in, out], `addmm` on the input flattened to 2-D)
    as `MatMul(x, W) + b` on the input as it is: the same arithmetic, without the Reshape pair
    that would stand between a norm and its projection in the graph and hide the projection
    from the fold."""
    import torch

    patched = [m for m in module.modules() if type(m).__name__ == "Conv1D" and getattr(m, "weight", None) is not None]

    def forward(self: Any, x: Any) -> Any:
        return torch.matmul(x, self.weight) + self.bias

    for conv in patched:
        conv.forward = forward.__get__(conv)
    try:
        yield
    finally:
        for conv in patched:
            del conv.forward


@contextlib.contextmanager
def _exporter_errors(dynamo: bool) -> Iterator[None]:
    # A model the exporter cannot trace is not a FlashNorm bug: one line that names the
    # exporter and the first line of its message (the full chain stays on the exception).
    try:
        yield
    except (RuntimeError, TypeError, ValueError, NotImplementedError, AttributeError) as exc:
        name = "dynamo" if dynamo else "legacy (TorchScript)"
        first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        other = "without --dynamo" if dynamo else "with --dynamo"
        raise FlashNormError(f"the {name} exporter failed: {first[:300]} (try {other})") from exc


def _dynamic_shapes(spec: ExportSpec) -> tuple[dict[int, Any], ...]:
    # Dim.DYNAMIC lets torch.export find the relations itself (attention_mask length =
    # past + sequence); the axis names are applied to the ONNX graph afterwards.
    import torch

    dynamic = torch.export.Dim.DYNAMIC
    shapes = [{axis: dynamic for axis in spec.dynamic_axes.get(name, {})} for name in spec.input_names]
    if spec.varargs_from is None:
        return tuple(shapes)
    return (*shapes[:spec.varargs_from], tuple(shapes[spec.varargs_from:]))


def name_dynamic_axes(model: onnx.ModelProto, axes: Mapping[str, Mapping[int, str]]) -> None:
    """Give the graph's dynamic input/output axes the names in `axes` (dynamo names them s0, s1…)."""
    for value in [*model.graph.input, *model.graph.output]:
        for axis, name in axes.get(value.name, {}).items():
            dim = value.type.tensor_type.shape.dim[axis]
            if not dim.HasField("dim_value"):
                dim.dim_param = name


def strip_initializer_prefix(model: onnx.ModelProto, prefix: str) -> None:
    """Rename initializers `prefix.X` to `X` so that reports name weights as the checkpoint
    does (`model.layers.0.input_layernorm.weight`); skipped if that would collide."""
    graph = model.graph
    taken = {t.name for t in graph.initializer} | {v.name for v in graph.input}
    taken |= {o for n in graph.node for o in n.output}
    renames = {}
    for tensor in graph.initializer:
        if tensor.name.startswith(prefix):
            new = tensor.name[len(prefix):]
            if new in taken or new in renames.values():
                return
            renames[tensor.name] = new
    _rename_values(model, renames)


def _rename_values(model: onnx.ModelProto, renames: Mapping[str, str]) -> None:
    graph = model.graph
    for tensor in graph.initializer:
        tensor.name = renames.get(tensor.name, tensor.name)
    for value in [*graph.input, *graph.output, *graph.value_info]:
        value.name = renames.get(value.name, value.name)
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in renames:
                node.input[i] = renames[name]


# Ops that carry token ids unchanged on their way to the embedding Gather (GPT-2's and OPT's
# legacy exports flatten input_ids with a Reshape first).
_ID_PASSTHROUGH = frozenset({"Reshape", "Cast", "Unsqueeze", "Squeeze", "Flatten", "Identity"})


def _embedding_table(graph: onnx.GraphProto) -> str | None:
    """The initializer that `input_ids` index (the token embedding), if there is one: the
    data of a Gather whose indices are input_ids, directly or through ops that pass ids on."""
    initializers = {t.name for t in graph.initializer}
    ids, frontier = {"input_ids"}, ["input_ids"]
    while frontier:
        name = frontier.pop()
        for n in graph.node:
            if n.op_type == "Gather" and len(n.input) == 2 and n.input[1] == name and n.input[0] in initializers:
                return n.input[0]
            if n.op_type in _ID_PASSTHROUGH and n.input and n.input[0] == name:
                frontier += [out for out in n.output if out not in ids]
                ids.update(n.output)
    return None


def retie_lm_head(model: onnx.ModelProto) -> str | None:
    """Undo the legacy exporter's copy of a tied LM head.

    The legacy exporter's constant folding turns `Transpose(embedding) → MatMul` into a
    second, transposed initializer (for SmolLM2-135M: 113 MB more, and a model in which the
    head no longer looks tied). The dynamo exporter's optimizer does the same to tables small
    enough to fold (tiny test models; SmolLM2's 113 MB table stays a Transpose there). Where a
    MatMul reads an initializer that is exactly the
    transpose of the embedding table behind the `input_ids` Gather, the copy is replaced by
    `Transpose(embedding)` again. Returns the embedding's name, or None where no such copy
    exists (an untied model)."""
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    embedding = _embedding_table(graph)
    if embedding is None:
        return None
    table = initializers[embedding]
    transposed_dims = tuple(reversed(table.dims))
    candidates = [
        n for n in graph.node
        if n.op_type == "MatMul" and n.input[1] in initializers
        and tuple(initializers[n.input[1]].dims) == transposed_dims
        and initializers[n.input[1]].data_type == table.data_type
    ]
    if not candidates:
        return None
    transposed_table = onnx.numpy_helper.to_array(table).T
    copies = [
        n for n in candidates
        if sum(name == n.input[1] for m in graph.node for name in m.input) == 1
        and np.array_equal(onnx.numpy_helper.to_array(initializers[n.input[1]]), transposed_table)
    ]
    if len(copies) != 1:
        return None
    head_node = copies[0]
    head = initializers[head_node.input[1]]
    transposed = f"{embedding}.transposed"
    index = list(graph.node).index(head_node)
    graph.node.insert(index, onnx.helper.make_node("Transpose", [embedding], [transposed], perm=[1, 0], name="lm_head_transpose"))
    head_node.input[1] = transposed
    graph.initializer.remove(head)
    return embedding


def lm_head_shares_embedding(model: onnx.ModelProto) -> bool:
    """Whether the initializer gathered by `input_ids` also feeds a MatMul or Gemm weight
    (directly or through one Transpose): a tied LM head, as the graph sees it."""
    graph = model.graph
    embedding = _embedding_table(graph)
    if embedding is None:
        return False
    transposes = {n.output[0] for n in graph.node if n.op_type == "Transpose" and n.input[0] == embedding}
    return any(
        n.op_type in ("MatMul", "Gemm") and (n.input[1] == embedding or n.input[1] in transposes) for n in graph.node
    )


def save_model(model: onnx.ModelProto, output: str | os.PathLike[str]) -> None:
    """Write `model` as staged files (`flashnorm.files`); weights go to `<file>.data` when the
    model is too large for one protobuf, with `flashnorm.modelio`'s thresholds (replacing an
    earlier output: as `modelio.saving.commit_model_with_data` says)."""
    destination = Path(output)
    if model.ByteSize() < EXTERNAL_DATA_THRESHOLD:
        with atomic_write(destination) as handle:
            handle.write(model.SerializeToString())
        return
    data_name = destination.name + ".data"
    with tempfile.TemporaryDirectory(prefix=".flashnorm-save-", dir=destination.parent) as scratch:
        onnx.save_model(model, str(Path(scratch) / destination.name), save_as_external_data=True,
                        all_tensors_to_one_file=True, location=data_name, size_threshold=INLINE_TENSOR_BYTES)
        written = onnx.load(str(Path(scratch) / destination.name), load_external_data=False)
        data = StagedFile(destination.parent / data_name, Path(scratch) / data_name)
        commit_model_with_data(written, data, destination)


def _tied_embeddings(model: Any) -> bool:
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    return inputs is not None and outputs is not None and inputs.weight is outputs.weight


def export_causal_lm(
    model: Any,
    output: str | os.PathLike[str],
    *,
    dynamo: bool = False,
    opset: int | None = None,
    kv_cache: bool = False,
    metadata: Mapping[str, str] | None = None,
    dtype: str = "fp32",
) -> dict[str, Any]:
    """Export a loaded Hugging Face causal LM (eval mode) to `output` in `dtype` (fp32, fp16,
    bf16); a model in another dtype is converted on a copy, never in place. Returns the report."""
    import torch

    from flashnorm.export.wrappers import WRAPPED, KVCacheModel, LogitsModel

    dtype_name = torch_dtype_name(dtype)
    # The legacy exporter's scaled_dot_product_attention builds the causal mask in fp32, and
    # adding it promotes the attention, o_proj and the whole residual stream of a half model
    # to fp32: half models are exported with transformers' eager attention, whose mask has
    # the model's dtype (softmax still in fp32, as transformers computes it).
    eager = not dynamo and dtype_name != "float32" and getattr(model.config, "_attn_implementation", "eager") != "eager"
    if model.dtype != getattr(torch, dtype_name) or eager:
        say(f"converting a copy of the model to {dtype_name}" + (" with eager attention" if eager else ""))
        model = copy.deepcopy(model).to(getattr(torch, dtype_name))
        if eager:
            model.set_attn_implementation("eager")

    destination = Path(output)
    directory = destination.parent if str(destination.parent) else Path(".")
    if not directory.is_dir():
        raise FlashNormError(f"cannot write {destination}: directory {directory} does not exist")
    opset = opset or DEFAULT_OPSET[dynamo]
    vocab = model.get_input_embeddings().weight.shape[0]
    kv = KVLayout.from_config(model.config) if kv_cache else None
    positions = "position_ids" in inspect.signature(model.forward).parameters
    spec = causal_lm_spec(vocab, kv, dtype_name, positions=positions)
    module = KVCacheModel(model, kv.num_layers, positions) if kv else LogitsModel(model, positions)
    exporter = "dynamo" if dynamo else "legacy"

    started = time.monotonic()
    say(f"exporting ({exporter} exporter, opset {opset}, {dtype_name}{', KV cache' if kv_cache else ''})")
    # The legacy exporter's constant folding fails on bfloat16 graphs (torch 2.13: "ScalarType
    # ComplexDouble is an unexpected tensor scalar type"); without it the weights stay behind
    # their Transpose nodes, which every pass looks through.
    folding = dynamo or dtype_name != "bfloat16"
    onnx_model = export_module(module, destination, spec, dynamo=dynamo, opset=opset, constant_folding=folding)
    export_seconds = time.monotonic() - started
    strip_initializer_prefix(onnx_model, f"{WRAPPED}.")
    name_dynamic_axes(onnx_model, spec.dynamic_axes)
    tied = _tied_embeddings(model)
    retied = retie_lm_head(onnx_model) if tied else None
    properties = {
        "flashnorm.exporter": exporter,
        "flashnorm.kv_cache": str(bool(kv_cache)).lower(),
        "flashnorm.tied_lm_head": str(tied).lower(),
        "flashnorm.dtype": dtype_name,
        **context_metadata(model.config),
        **(metadata or {}),
    }
    onnx.helper.set_model_props(onnx_model, properties)
    say(f"traced in {export_seconds:.1f} s; writing {destination}")
    save_model(onnx_model, destination)
    return {
        "output": str(destination),
        "exporter": exporter,
        "opset": opset,
        "inputs": spec.input_names,
        "outputs": spec.output_names,
        "kv_cache": bool(kv_cache),
        "dtype": dtype_name,
        "logits_dtype": _output_dtype(onnx_model, LOGITS),
        "tied_lm_head": tied,
        "lm_head_retied": retied is not None,
        "lm_head_tied_in_onnx": lm_head_shares_embedding(onnx_model),
        "parameters": sum(p.numel() for p in model.parameters()),
        "export_seconds": round(export_seconds, 1),
        "seconds": round(time.monotonic() - started, 1),
    }


def export_encoder(model: Any, encoder: "Encoder", output: str | os.PathLike[str], *, dynamo: bool = False,
                   opset: int | None = None, dtype: str = "float32",
                   metadata: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Export a loaded encoder (`flashnorm.export.encoders`) to `output` in `dtype` (a torch
    dtype name; a model in another dtype is converted on a copy); returns the report."""
    import torch

    from flashnorm.export.encoders import encoder_module, encoder_signature
    from flashnorm.export.wrappers import WRAPPED

    destination = Path(output)
    directory = destination.parent if str(destination.parent) else Path(".")
    if not directory.is_dir():
        raise FlashNormError(f"cannot write {destination}: directory {directory} does not exist")
    # The legacy exporter's scaled_dot_product_attention computes in fp32 for half models (as
    # for causal LMs, onnx_export.export_causal_lm): eager attention keeps the model's type.
    eager = not dynamo and dtype != "float32" and getattr(model.config, "_attn_implementation", "eager") != "eager"
    if model.dtype != getattr(torch, dtype) or eager:
        model = copy.deepcopy(model).to(getattr(torch, dtype))
        if eager:
            model.set_attn_implementation("eager")
    opset = opset or DEFAULT_OPSET[dynamo]
    spec = ExportSpec(*encoder_signature(model, encoder, dtype))
    exporter = "dynamo" if dynamo else "legacy"
    started = time.monotonic()
    say(f"exporting the {encoder.family} encoder ({exporter} exporter, opset {opset}, {dtype})")
    onnx_model = export_module(encoder_module(model, encoder), destination, spec, dynamo=dynamo, opset=opset)
    export_seconds = time.monotonic() - started
    strip_initializer_prefix(onnx_model, f"{WRAPPED}.")
    name_dynamic_axes(onnx_model, spec.dynamic_axes)
    properties = {
        "flashnorm.exporter": exporter,
        "flashnorm.dtype": dtype,
        "flashnorm.encoder": encoder.family,
        "flashnorm.pooled_output": encoder.pooled,
        **(metadata or {}),
    }
    onnx.helper.set_model_props(onnx_model, properties)
    say(f"traced in {export_seconds:.1f} s; writing {destination}")
    save_model(onnx_model, destination)
    return {
        "output": str(destination),
        "exporter": exporter,
        "opset": opset,
        "encoder": encoder.family,
        "pre_ln": encoder.pre_ln,
        "inputs": spec.input_names,
        "outputs": spec.output_names,
        "pooled_output": encoder.pooled,
        "kv_cache": False,
        "dtype": dtype,
        "output_dtype": _output_dtype(onnx_model, encoder.pooled),
        "parameters": sum(p.numel() for p in model.parameters()),
        "export_seconds": round(export_seconds, 1),
        "seconds": round(time.monotonic() - started, 1),
    }


def context_metadata(config: Any) -> dict[str, str]:
    """The trained context (max_position_embeddings) as ONNX metadata, which `compare` checks
    its positions against (validate.feeds.CONTEXT_LENGTH_KEY); none where the config has none."""
    length = getattr(config, "max_position_embeddings", None)
    return {"flashnorm.context_length": str(length)} if isinstance(length, int) and length > 0 else {}


def _output_dtype(model: onnx.ModelProto, name: str) -> str | None:
    """The element type a graph output declares ('float16'), or None."""
    for value in model.graph.output:
        if value.name == name and value.type.tensor_type.elem_type:
            return onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type).name
    return None


def export_source(
    source: Any,
    output: str | os.PathLike[str],
    *,
    dynamo: bool = False,
    opset: int | None = None,
    kv_cache: bool = False,
    model: Any = None,
    dtype: str = "fp32",
    tower: str | None = None,
) -> dict[str, Any]:
    """Load a ModelSource (HF directory or GGUF) and export it: a causal LM to logits, an
    encoder (`flashnorm.export.encoders`; `tower` picks a CLIP folder's) to its last hidden
    state and pooled output. The source is recorded in the ONNX metadata so that `flashnorm
    compare --text` can find the tokenizer. `model`, if given, is that source already loaded
    (several exports of one model load it once)."""
    from flashnorm.export.encoders import load_encoder
    from flashnorm.export.sources import classify_source, load_causal_lm

    started = time.monotonic()
    dtype_name = torch_dtype_name(dtype)
    encoder = classify_source(source, tower)
    if encoder is not None and kv_cache:
        raise FlashNormError(f"--kv-cache applies to causal LMs; {source.describe()} is a {encoder.family} encoder")
    if model is None:
        say(f"loading {source.describe()}")
        model = load_causal_lm(source, dtype_name) if encoder is None else load_encoder(source.directory, encoder, dtype_name)
    load_seconds = time.monotonic() - started
    metadata = {"flashnorm.source_dir": str(source.directory)}
    if source.gguf_file:
        metadata["flashnorm.gguf_file"] = source.gguf_file
    if encoder is not None:
        report = export_encoder(model, encoder, output, dynamo=dynamo, opset=opset, dtype=dtype_name, metadata=metadata)
    else:
        report = export_causal_lm(model, output, dynamo=dynamo, opset=opset, kv_cache=kv_cache, metadata=metadata,
                                  dtype=dtype_name)
    report["source"] = source.describe()
    report["load_seconds"] = round(load_seconds, 1)
    report["seconds"] = round(time.monotonic() - started, 1)
    return report
