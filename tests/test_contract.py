"""flashnorm.contract and the C/C++ side state the FlashNormMatMul contract once each: these
tests read the headers and sources and check that both say the same thing."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest

from flashnorm import contract
from flashnorm.passes import run_passes
from synthetic import build_norm_model

PLUGINS = Path(__file__).resolve().parents[1] / "plugins" / "flashnorm"


def _read(relative: str) -> str:
    return (PLUGINS / relative).read_text()


def _string_constant(source: str, name: str) -> str:
    match = re.search(rf'constexpr char const\* {name} = "([^"]*)";', source)
    assert match, f"{name} not found"
    return match.group(1)


def test_plugin_identity_matches():
    header = _read("trt/flashnorm_matmul_plugin.h")
    assert _string_constant(header, "kPluginNamePrefix") == contract.OP_TYPE_PREFIX
    assert _string_constant(header, "kPluginVersion") == contract.PLUGIN_VERSION
    assert _string_constant(header, "kPluginNamespace") == contract.PLUGIN_NAMESPACE


def test_one_plugin_name_per_output_count():
    names = re.search(r"kNames\[FLASHNORM_MAX_OUTPUTS\] = \{([^}]*)\}", _read("trt/flashnorm_matmul_plugin.cpp"))
    assert names, "the plugin's name table was not found"
    assert re.findall(r'"([^"]+)"', names.group(1)) == [contract.op_type(n) for n in range(1, contract.MAX_OUTPUTS + 1)]


def test_limits_and_strategy_match_the_c_abi():
    abi = _read("include/flashnorm/flashnorm.h")
    assert int(re.search(r"#define FLASHNORM_MAX_OUTPUTS (\d+)", abi).group(1)) == contract.MAX_OUTPUTS
    assert int(re.search(r"FLASHNORM_STRATEGY_AUTO = (\d+)", abi).group(1)) == contract.STRATEGY_AUTO


@pytest.mark.parametrize("op, count", [("FlashNormMatMul1", 1), ("FlashNormMatMul8", 8), ("FlashNormMatMul9", None),
                                       ("FlashNormMatMul", None), ("FlashNormMatMul02", None), ("MatMul", None)])
def test_output_count(op, count):
    assert contract.output_count(op) == count


def test_legacy_encoding_is_named():
    assert contract.legacy_encoding([("FlashNormMatMul3", "flashnorm")], [("FlashNormMatMul3", "flashnorm", "")]) is None
    reason = contract.legacy_encoding([("FlashNormMatMul", "flashnorm")] * 2, [("FlashNormMatMul", "flashnorm", "outputs3")])
    assert "2 'FlashNormMatMul' nodes" in reason and "flashnorm optimize" in reason


def test_plugin_fields_match_the_creator():
    declared = dict(re.findall(r'emplace_back\(\s*"(\w+)"\s*,\s*[^,]+,\s*nvinfer1::PluginFieldType::(k\w+)',
                               _read("trt/flashnorm_matmul_creator.cpp")))
    assert declared == contract.PLUGIN_FIELDS


def test_deferred_nodes_and_reference_functions_follow_the_contract():
    graph, _ = run_passes(gs.import_onnx(build_norm_model("legacy_torch", np.random.default_rng(0))), ["fold", "defer"])
    model = gs.export_onnx(graph)
    nodes = [n for n in model.graph.node if contract.is_deferred_node(n.op_type, n.domain)]
    assert nodes
    for node in nodes:
        attributes = {a.name: a for a in node.attribute}
        assert attributes["plugin_version"].s.decode() == contract.PLUGIN_VERSION
        assert attributes["plugin_namespace"].s.decode() == contract.PLUGIN_NAMESPACE
        assert set(attributes) - {"plugin_version", "plugin_namespace"} == set(contract.PLUGIN_FIELDS)
        assert attributes["eps"].type == onnx.AttributeProto.FLOAT
        assert attributes["splits"].type == onnx.AttributeProto.INTS
        assert attributes["strategy"].i == contract.STRATEGY_AUTO
        assert node.op_type == contract.op_type(len(node.output))
    functions = {f.name: f for f in model.functions if f.domain == contract.DOMAIN}
    assert set(functions) == {n.op_type for n in nodes}
    assert model.ir_version >= contract.MIN_IR_VERSION
    assert {o.domain: o.version for o in model.opset_import}[contract.DOMAIN] == contract.DOMAIN_VERSION
