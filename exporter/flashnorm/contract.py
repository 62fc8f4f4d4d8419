"""The FlashNormMatMul contract: how a deferred node is spelled in ONNX, as the defer pass
writes it, TensorRT's ONNX parser reads it and the plugin library registers it.

One op type per output count, `FlashNormMatMul<N>` (N = 1 … MAX_OUTPUTS projections), each
with a model-local function of the same name holding the reference decomposition. TensorRT's
parser (onnx-tensorrt `importLocalFunctions`/`parseNode`) keys model-local functions by name
alone, ignoring domain and overload, so a gate|up node (2 outputs) and a q|k|v node (3) must
differ in name for each to find its own body where the plugin is not loaded. The plugin library
registers one creator per name (plugins/flashnorm/trt/flashnorm_matmul_plugin.h, checked against
this module by tests/test_contract.py).

Standard library only: the engine and serving code import it without onnx.
"""

from __future__ import annotations

import re
from typing import Iterable, Optional

DOMAIN = "flashnorm"
DOMAIN_VERSION = 1
OP_TYPE_PREFIX = "FlashNormMatMul"
PLUGIN_VERSION = "1"
PLUGIN_NAMESPACE = "flashnorm"
MAX_OUTPUTS = 8  # FLASHNORM_MAX_OUTPUTS in plugins/flashnorm/include/flashnorm/flashnorm.h
# Node attribute → TensorRT plugin field type (nvinfer1::PluginFieldType): every field the
# creator declares, all written on every node.
PLUGIN_FIELDS: dict[str, str] = {"eps": "kFLOAT32", "splits": "kINT32", "strategy": "kINT32", "statistic": "kINT32"}
# Plugin fields a plan holds beyond the node's: the multiprocessors the plugin records when it is made
# for a build (the build device's) and serializes, so that AUTO picks for that count, and fits the
# workspace TensorRT reserved for it, on any GPU the plan runs on. Never written on a node, and not
# declared by the creator (TensorRT's parser would ask every node for it and warn where it is missing).
PLAN_ONLY_FIELDS: dict[str, str] = {"multiprocessors": "kINT32"}
# Activation and weight types the plugin and the kernels take (x and W* share one).
FLOAT_TYPES = frozenset({"float16", "bfloat16", "float32"})
# The reference functions use CastLike (opset 15) and model-local functions (IR 8).
MIN_OPSET = 15
MIN_IR_VERSION = 8
# The plugin's strategy field: FLASHNORM_STRATEGY_AUTO. Written on every node so that TensorRT's
# parser finds every field the creator declares (it warns about a missing one).
STRATEGY_AUTO = 0
# The statistic the node's row scale divides by: the RMS (RMSNorm) or the standard deviation
# (LayerNorm, whose mean the fold has centred out of the weights). Plugin field `statistic`.
STATISTIC_RMS = 0
STATISTIC_VARIANCE = 1
# The node's third input: a float32 bias per output column, [sum(splits)], added after the row
# scale (zeros where no projection has a bias). Nodes and plans written before it have two inputs.
BIAS_DTYPE = "float32"

# Before this encoding one name, FlashNormMatMul, carried ONNX function overloads per output
# count: TensorRT's parser gave every node the first overload's body.
LEGACY_OP_TYPE = OP_TYPE_PREFIX
REOPTIMIZE = "re-run `flashnorm optimize` on the original model"

_OP_TYPE = re.compile(rf"^{OP_TYPE_PREFIX}([1-9][0-9]*)$")


def op_type(num_outputs: int) -> str:
    """The op type (and function name, and plugin creator name) of a node with that many outputs."""
    if not 1 <= num_outputs <= MAX_OUTPUTS:
        raise ValueError(f"a FlashNormMatMul node has 1 to {MAX_OUTPUTS} outputs, not {num_outputs}")
    return f"{OP_TYPE_PREFIX}{num_outputs}"


def output_count(op: str) -> Optional[int]:
    """N for `FlashNormMatMul<N>` (1 ≤ N ≤ MAX_OUTPUTS), None for any other op type."""
    match = _OP_TYPE.match(op)
    if match is None or not 1 <= int(match.group(1)) <= MAX_OUTPUTS:
        return None
    return int(match.group(1))


def is_deferred_node(op: str, domain: str) -> bool:
    return domain == DOMAIN and output_count(op) is not None


def legacy_encoding(nodes: Iterable[tuple[str, str]], functions: Iterable[tuple[str, str, str]]) -> Optional[str]:
    """Why a model's FlashNormMatMul encoding is the old one, or None. `nodes` are (op type,
    domain) pairs, `functions` (name, domain, overload) triples."""
    old_nodes = sum(1 for op, domain in nodes if domain == DOMAIN and op == LEGACY_OP_TYPE)
    overloaded = any(domain == DOMAIN and overload for _, domain, overload in functions)
    if not old_nodes and not overloaded:
        return None
    return (f"the model was written by an older FlashNorm ({old_nodes} '{LEGACY_OP_TYPE}' nodes whose reference "
            f"functions are ONNX overloads, which TensorRT's ONNX parser cannot tell apart): {REOPTIMIZE}")
