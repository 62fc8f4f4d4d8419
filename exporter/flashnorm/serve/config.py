"""Write a Triton `config.pbtxt` and check it against Triton's own ModelConfig schema.

The text is rendered by hand so that it reads like the examples in Triton's documentation,
then parsed with the `ModelConfig` protobuf that ships in `tritonclient[grpc]`; a config that
does not parse, or that parses to something other than what was asked for, is never written.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from flashnorm.errors import FlashNormError
from flashnorm.serve.tensors import TritonSignature, TritonTensor


@dataclasses.dataclass(frozen=True)
class EnsembleStep:
    """One step of an ensemble: the model it runs and its tensor maps (the model's own tensor
    name → the ensemble's tensor name)."""

    model_name: str
    input_map: tuple[tuple[str, str], ...]
    output_map: tuple[tuple[str, str], ...]


@dataclasses.dataclass(frozen=True)
class ModelConfigOptions:
    """Everything in a config.pbtxt besides the tensors. With `ensemble_steps` the platform is
    "ensemble": no batcher and no instances of its own (its steps' models have them)."""

    name: str
    platform: str = ""  # e.g. "tensorrt_plan"
    backend: str = ""  # e.g. "python"
    max_batch_size: int = 8
    max_queue_delay_us: int = 0
    instance_count: int = 1
    instance_kind: str = "KIND_GPU"  # or KIND_CPU
    cuda_graphs: bool = False
    parameters: tuple[tuple[str, str], ...] = ()
    ensemble_steps: tuple[EnsembleStep, ...] = ()


def _quote(text: str) -> str:
    # JSON string escaping is a subset of protobuf text-format escaping.
    return json.dumps(text, ensure_ascii=False)


def _tensor_block(spec: TritonTensor, max_batch_size: int) -> str:
    dims = ", ".join(str(d) for d in spec.triton_dims(max_batch_size))
    return (
        "  {\n"
        f"    name: {_quote(spec.name)}\n"
        f"    data_type: {spec.data_type}\n"
        f"    dims: [ {dims} ]\n"
        "  }"
    )


def _map_block(field: str, pairs: tuple[tuple[str, str], ...]) -> str:
    return "\n".join(f"      {field} {{ key: {_quote(key)} value: {_quote(value)} }}" for key, value in pairs)


def _ensemble_block(steps: tuple[EnsembleStep, ...]) -> str:
    blocks = ",\n".join(
        "    {\n"
        f"      model_name: {_quote(step.model_name)}\n"
        "      model_version: -1\n"
        f"{_map_block('input_map', step.input_map)}\n"
        f"{_map_block('output_map', step.output_map)}\n"
        "    }"
        for step in steps
    )
    return f"ensemble_scheduling {{\n  step [\n{blocks}\n  ]\n}}"


def render_model_config(signature: TritonSignature, options: ModelConfigOptions) -> str:
    """The config.pbtxt text for `signature` served with `options`."""
    if options.max_batch_size < 0:
        raise FlashNormError(f"--max-batch-size must be >= 0, got {options.max_batch_size}")
    if options.instance_count < 1:
        raise FlashNormError(f"--instances must be >= 1, got {options.instance_count}")
    lines = [f"name: {_quote(options.name)}"]
    if options.platform:
        lines.append(f"platform: {_quote(options.platform)}")
    if options.backend:
        lines.append(f"backend: {_quote(options.backend)}")
    lines.append(f"max_batch_size: {options.max_batch_size}")
    for field, specs in (("input", signature.inputs), ("output", signature.outputs)):
        blocks = ",\n".join(_tensor_block(spec, options.max_batch_size) for spec in specs)
        lines.append(f"{field} [\n{blocks}\n]")
    if options.ensemble_steps:
        lines.append(_ensemble_block(options.ensemble_steps))
        return "\n".join(lines) + "\n"
    if options.max_batch_size > 0:
        lines.append(
            f"dynamic_batching {{\n  max_queue_delay_microseconds: {options.max_queue_delay_us}\n}}"
        )
    lines.append(
        f"instance_group [\n  {{\n    count: {options.instance_count}\n    kind: {options.instance_kind}\n  }}\n]"
    )
    if options.cuda_graphs:
        lines.append("optimization {\n  cuda {\n    graphs: true\n  }\n}")
    for key, value in options.parameters:
        lines.append(
            f"parameters {{\n  key: {_quote(key)}\n  value {{\n    string_value: {_quote(value)}\n  }}\n}}"
        )
    return "\n".join(lines) + "\n"


def _model_config_class() -> Any:
    try:
        from tritonclient.grpc import model_config_pb2
    except Exception as exc:  # ImportError, or RuntimeError when the grpc extra is missing
        raise FlashNormError(
            "validating config.pbtxt needs tritonclient[grpc] and protobuf>=6.33.5 "
            f"(pip install 'flashnorm[serve]'): {exc}"
        ) from None
    return model_config_pb2.ModelConfig


def parse_model_config(text: str) -> Any:
    """Parse config.pbtxt text into Triton's ModelConfig message; a schema error is a FlashNormError."""
    from google.protobuf import text_format

    message = _model_config_class()()
    try:
        text_format.Parse(text, message)
    except text_format.ParseError as exc:
        raise FlashNormError(f"generated config.pbtxt does not match Triton's ModelConfig schema: {exc}") from None
    return message


def validated_model_config(signature: TritonSignature, options: ModelConfigOptions) -> str:
    """Render the config, parse it with Triton's schema and check the parse says what was meant."""
    text = render_model_config(signature, options)
    message = parse_model_config(text)
    expected_inputs = [spec.name for spec in signature.inputs]
    expected_outputs = [spec.name for spec in signature.outputs]
    mismatches = []
    if message.name != options.name:
        mismatches.append(f"name {message.name!r}")
    if message.platform != options.platform or message.backend != options.backend:
        mismatches.append(f"platform/backend {message.platform!r}/{message.backend!r}")
    if message.max_batch_size != options.max_batch_size:
        mismatches.append(f"max_batch_size {message.max_batch_size}")
    if [t.name for t in message.input] != expected_inputs:
        mismatches.append(f"inputs {[t.name for t in message.input]}")
    if [t.name for t in message.output] != expected_outputs:
        mismatches.append(f"outputs {[t.name for t in message.output]}")
    steps = [(step.model_name, dict(step.input_map), dict(step.output_map))
             for step in message.ensemble_scheduling.step]
    if steps != [(step.model_name, dict(step.input_map), dict(step.output_map)) for step in options.ensemble_steps]:
        mismatches.append(f"ensemble steps {steps}")
    if mismatches:
        raise FlashNormError(f"config.pbtxt parsed back differently: {', '.join(mismatches)}")
    return text
