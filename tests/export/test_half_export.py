"""Half-precision exports (`--dtype fp16|bf16`): weights and activations in the type, every
RMSNorm computed in fp32 inside the graph as transformers computes it, logits in the type, and
the graph computing what the torch model computes at that dtype."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest
from onnx import TensorProto

from flashnorm import modelio
from flashnorm.match import find_norm_sites
from flashnorm.match.queries import stored_dtype_name
from flashnorm.match.shapes import annotate_types
from flashnorm.progress import Progress
from models import cache

torch = pytest.importorskip("torch")

ONNX_TYPE = {"fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}
NUMPY = {"fp16": "float16", "bf16": "bfloat16"}


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setattr(Progress, "enabled", False)


def _logits(path, feeds):
    from flashnorm.validate.bfloat16 import emulating_runner_factory

    runner = emulating_runner_factory()(str(path), "model")
    with runner:
        return runner.infer(feeds)["logits"]


CASES = [("fp16", False, False), ("bf16", False, False), ("fp16", False, True), ("bf16", False, True),
         ("fp16", True, False), ("bf16", True, False), ("fp16", True, True), ("bf16", True, True)]


@pytest.mark.parametrize("dtype,dynamo,kv_cache", CASES,
                         ids=[f"{d}-{'dynamo' if y else 'legacy'}{'-kv' if k else ''}" for d, y, k in CASES])
def test_half_export(dtype, dynamo, kv_cache, session_tmp, rng):
    from flashnorm.export import export_causal_lm

    if dynamo:
        pytest.importorskip("onnxscript")
    model = cache.tiny_llama_model()
    path = session_tmp / f"tiny-llama.{dtype}.{'dynamo' if dynamo else 'legacy'}{'.kv' if kv_cache else ''}.onnx"
    report = export_causal_lm(model, path, dtype=dtype, dynamo=dynamo, kv_cache=kv_cache)
    assert next(model.parameters()).dtype == torch.float32, "the caller's model was converted in place"
    assert report["dtype"] == report["logits_dtype"] == NUMPY[dtype]

    proto = onnx.load(str(path))
    floats = [t for t in proto.graph.initializer if t.data_type in (TensorProto.FLOAT, *ONNX_TYPE.values())]
    large = [t for t in floats if np.prod(t.dims) > 64]
    assert large and all(t.data_type == ONNX_TYPE[dtype] for t in large), [(t.name, t.data_type) for t in large]
    kinds = {v.name: v.type.tensor_type.elem_type for v in [*proto.graph.input, *proto.graph.output]}
    assert kinds["logits"] == ONNX_TYPE[dtype]
    for name, kind in kinds.items():
        if name.startswith(("past_key_values", "present")):
            assert kind == ONNX_TYPE[dtype], name
    assert {p.key: p.value for p in proto.metadata_props}["flashnorm.dtype"] == NUMPY[dtype]

    # Every norm: a half tensor in, fp32 inside, a half tensor out (then the half gain).
    graph = modelio.load(path)
    annotate_types(graph)
    sites = find_norm_sites(graph)
    assert len(sites) == 2 * cache.TINY_LLAMA["num_hidden_layers"] + 1
    for site in sites:
        if site.spelling == "RMSNormalization":
            assert int(site.nodes[0].attrs.get("stash_type", 1)) == 1  # computed in fp32
            assert stored_dtype_name(site.input) == NUMPY[dtype]
        else:
            cast = site.input.inputs[0]
            assert cast.op == "Cast" and int(cast.attrs["to"]) == TensorProto.FLOAT, site.name
            assert stored_dtype_name(cast.inputs[0]) == NUMPY[dtype]
            assert site.output_cast == ONNX_TYPE[dtype]
        assert stored_dtype_name(site.output) == NUMPY[dtype]

    # The graph computes what torch computes at that dtype (torch on CPU, ORT: fp16 natively,
    # bf16 emulated), within a few units of the type's rounding, and picks the same tokens.
    batch, sequence = 4, 16
    ids = rng.integers(0, cache.TINY_LLAMA["vocab_size"], (batch, sequence))
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids),
             "position_ids": np.tile(np.arange(sequence), (batch, 1))}
    if kv_cache:
        layers, heads, head_dim = (cache.TINY_LLAMA[k] for k in ("num_hidden_layers", "num_key_value_heads", "head_dim"))
        empty = np.zeros((batch, heads, 0, head_dim), np.float16 if dtype == "fp16" else np.float32)
        feeds.update({f"past_key_values.{i}.{kv}": empty for i in range(layers) for kv in ("key", "value")})
    logits = _logits(path, feeds).astype(np.float64)
    with torch.no_grad():  # a copy: converting the session's shared model would round its weights
        half = copy.deepcopy(model).to(getattr(torch, NUMPY[dtype]))
        expected = half(torch.from_numpy(ids)).logits.double().numpy()
    unit = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8}[dtype]
    assert np.linalg.norm(logits - expected) / np.linalg.norm(expected) < 8 * unit
    # A random model has near-ties: torch and ORT round differently, and bf16 flips more of them.
    assert np.mean(logits.argmax(-1) == expected.argmax(-1)) >= {"fp16": 0.9, "bf16": 0.8}[dtype]


def test_unknown_dtype_is_one_line(tmp_path, capsys):
    from flashnorm import cli

    assert cli.main(["export", "--model", "smollm2-135m", "--dtype", "int8", "-o", str(tmp_path / "m.onnx")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "argument --dtype: 'int8' is not one of fp32, fp16, bf16, float32" in err


def test_export_source_loads_in_the_dtype(tmp_path):
    """`flashnorm export DIR --dtype fp16` from a Hugging Face directory (the CLI path)."""
    from flashnorm import cli

    cache.tiny_llama_model().save_pretrained(tmp_path / "hf")
    output = tmp_path / "tiny.fp16.onnx"
    assert cli.main(["export", str(tmp_path / "hf"), "--dtype", "fp16", "-o", str(output), "-q"]) == 0
    proto = onnx.load(str(output), load_external_data=False)
    assert {v.name: v.type.tensor_type.elem_type for v in proto.graph.output}["logits"] == TensorProto.FLOAT16
