"""The deferred nodes of half-precision models carry the types the plugin declares it takes.

FlashNormMatMulPlugin::supportsFormatCombination (plugins/flashnorm/trt/) accepts a linear
x of a type `toKernelType` maps (kFLOAT, kHALF, kBF16) and requires W and every output to
have x's type, and a third input (the bias) to be kFLOAT whatever x is. The C++ is read here, not
run (no TensorRT on CI): its switch is parsed, then every deferred node of fp16 and bf16 graphs must
satisfy the same rule."""

from __future__ import annotations

import re
from pathlib import Path

import onnx_graphsurgeon as gs
import pytest

from flashnorm import contract
from flashnorm.match.queries import stored_dtype_name
from flashnorm.passes import run_passes
from synthetic import CONSUMERS, build_half_norm_model

PLUGIN = Path(__file__).resolve().parents[2] / "plugins" / "flashnorm" / "trt" / "flashnorm_matmul_plugin.cpp"
TRT_TO_NUMPY = {"kFLOAT": "float32", "kHALF": "float16", "kBF16": "bfloat16"}


def declared_types() -> set[str]:
    """The types toKernelType accepts, read from the plugin's source."""
    source = PLUGIN.read_text()
    body = re.search(r"bool toKernelType\([^)]*\)\s*\{(.*?)\n\}", source, re.S)
    assert body, "toKernelType not found in the plugin source"
    cases = re.findall(r"case nvinfer1::DataType::(k\w+):[^\n]*return true;", body.group(1))
    assert cases, "toKernelType accepts no type?"
    # supportsFormatCombination: x decides the type, W and every output must match it.
    assert re.search(r"pos == 0 \? isSupportedType\(desc\.type\) : desc\.type == inOut\[0\]\.desc\.type", source)
    return {TRT_TO_NUMPY[c] for c in cases}


def declared_bias_type() -> str:
    """The bias input's type, read from supportsFormatCombination's branch for it."""
    source = PLUGIN.read_text()
    found = re.search(r"if \(pos == kBiasInput && nbInputs > kBiasInput\)\s*\{\s*return desc\.type == "
                      r"nvinfer1::DataType::(k\w+);", source)
    assert found, "supportsFormatCombination's bias branch not found in the plugin source"
    return TRT_TO_NUMPY[found.group(1)]


def test_plugin_declares_the_contract_types():
    assert declared_types() == set(contract.FLOAT_TYPES)
    assert declared_bias_type() == contract.BIAS_DTYPE


@pytest.mark.parametrize("consumer", CONSUMERS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_deferred_half_nodes_carry_a_declared_type(dtype, consumer, rng):
    model = build_half_norm_model("pow_div", int(rng.integers(2**31)), dtype, consumer=consumer)
    graph, _ = run_passes(gs.import_onnx(model), ["fold", "defer"])
    nodes = [n for n in graph.nodes if contract.is_deferred_node(n.op, n.domain)]
    assert nodes
    allowed = declared_types()
    for node in nodes:
        x, weight, bias = node.inputs
        assert stored_dtype_name(x) == dtype and stored_dtype_name(x) in allowed
        assert stored_dtype_name(weight) == dtype and stored_dtype_name(bias) == contract.BIAS_DTYPE
        assert all(stored_dtype_name(o) == dtype for o in node.outputs), [stored_dtype_name(o) for o in node.outputs]
