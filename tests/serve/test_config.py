"""config.pbtxt: rendered text parses with Triton's own ModelConfig schema and says what was asked."""

from __future__ import annotations

import pytest

pytest.importorskip("tritonclient.grpc", reason="needs tritonclient[grpc] (flashnorm[serve])")

from tritonclient.grpc import model_config_pb2  # noqa: E402

from flashnorm.errors import FlashNormError  # noqa: E402
from flashnorm.serve.config import (  # noqa: E402
    ModelConfigOptions,
    parse_model_config,
    render_model_config,
    validated_model_config,
)
from flashnorm.serve.tensors import signature_from_io_specs  # noqa: E402


def _llm_signature(vocab: int):
    return signature_from_io_specs([
        "in:input_ids:int64:-1,-1", "in:attention_mask:int64:-1,-1", f"out:logits:fp16:-1,-1,{vocab}",
    ])


def test_tensorrt_config_has_platform_dims_batching_instances_and_graphs(rng):
    vocab, batch, instances = int(rng.integers(1000, 60000)), int(rng.integers(1, 65)), int(rng.integers(1, 5))
    delay = int(rng.integers(0, 1000))
    text = validated_model_config(_llm_signature(vocab), ModelConfigOptions(
        name="smollm2", platform="tensorrt_plan", max_batch_size=batch, max_queue_delay_us=delay,
        instance_count=instances, instance_kind="KIND_GPU", cuda_graphs=True,
    ))
    config = parse_model_config(text)
    assert isinstance(config, model_config_pb2.ModelConfig)
    assert (config.name, config.platform, config.backend, config.max_batch_size) == ("smollm2", "tensorrt_plan", "", batch)
    assert [(t.name, t.data_type, list(t.dims)) for t in config.input] == [
        ("input_ids", model_config_pb2.TYPE_INT64, [-1]), ("attention_mask", model_config_pb2.TYPE_INT64, [-1])]
    assert [(t.name, t.data_type, list(t.dims)) for t in config.output] == [
        ("logits", model_config_pb2.TYPE_FP16, [-1, vocab])]
    assert config.HasField("dynamic_batching")
    assert config.dynamic_batching.max_queue_delay_microseconds == delay
    assert [(g.count, g.kind) for g in config.instance_group] == [(instances, model_config_pb2.ModelInstanceGroup.KIND_GPU)]
    assert config.optimization.cuda.graphs is True


def test_unbatched_config_keeps_full_dims_and_has_no_dynamic_batching():
    config = parse_model_config(render_model_config(_llm_signature(49152), ModelConfigOptions(
        name="m", backend="python", max_batch_size=0, instance_kind="KIND_CPU",
        parameters=(("onnx_file", "model.onnx"),),
    )))
    assert config.backend == "python" and config.max_batch_size == 0
    assert list(config.input[0].dims) == [-1, -1] and list(config.output[0].dims) == [-1, -1, 49152]
    assert not config.HasField("dynamic_batching") and not config.optimization.cuda.graphs
    assert config.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_CPU
    assert config.parameters["onnx_file"].string_value == "model.onnx"


def test_names_with_quotes_survive_the_round_trip():
    signature = signature_from_io_specs(['in:a"b\\c:fp32:-1', "out:y:fp32:-1"])
    config = parse_model_config(validated_model_config(signature, ModelConfigOptions(name="m", backend="python")))
    assert config.input[0].name == 'a"b\\c'


def test_schema_errors_are_flashnorm_errors():
    with pytest.raises(FlashNormError, match="ModelConfig schema"):
        parse_model_config('name: "m"\nmax_batch_size: 1\nno_such_field: 3\n')
    with pytest.raises(FlashNormError, match="ModelConfig schema"):
        parse_model_config('input [ { name: "x" data_type: TYPE_FP33 dims: [ 1 ] } ]\n')


def test_bad_counts_are_rejected_before_rendering():
    with pytest.raises(FlashNormError, match="--instances"):
        render_model_config(_llm_signature(10), ModelConfigOptions(name="m", instance_count=0))
    with pytest.raises(FlashNormError, match="--max-batch-size"):
        render_model_config(_llm_signature(10), ModelConfigOptions(name="m", max_batch_size=-1))
