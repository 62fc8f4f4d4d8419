"""Numeric self-check: a matched site is accepted only if its own nodes, cut out of the graph
and run in ONNX Runtime on random inputs, compute its kind's formula in float64:
x / sqrt(mean(x², -1) + eps) · gain (RMSNorm), or (x − μ) / sqrt(mean((x − μ)², -1) + eps) · gain
+ bias with μ = mean(x, -1) (LayerNorm).

Structure alone can fool a matcher (a wrong exponent, a reduction over the wrong axis, an eps
read from the wrong operand); the numbers cannot. The check runs in float32 whatever the
model's dtype (every float Cast and constant is widened), because it tests the formula, not
the precision. Rows are scaled from 1e-3 to 10 so that eps is visible in the result, and have
a mean so that a missing (or spurious) mean subtraction is too.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import TensorProto, helper, numpy_helper

from flashnorm.match.queries import constant_value, tensor_rank
from flashnorm.match.fused import FUSED_OPS
from flashnorm.match.gain import bias_slot_shape, gain_slot_shape
from flashnorm.match.rejection import Rejected
from flashnorm.match.site import NormSite

_FLOAT_TYPES = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE}
_DEFAULT_HIDDEN = 16
_RTOL = 1e-3
_ATOL = 1e-4


def self_check(site: NormSite, opset: int, rng: Optional[np.random.Generator] = None) -> None:
    """Raise Rejected unless the site's subgraph computes its kind's formula."""
    rng = rng or np.random.default_rng()
    model, feed_names = _extract(site, opset)
    hidden = site.hidden_size or _DEFAULT_HIDDEN
    rank = max(tensor_rank(site.input) or 3, 2)
    shape = (2, 3, 2, 2, 2, 2)[: rank - 1] + (hidden,)
    feeds = {}
    for name in feed_names:
        row_scale = 10.0 ** rng.uniform(-3, 1, size=shape[:-1] + (1,))
        # One row always at the bottom of the range, where eps is a sizeable part of mean(x²):
        # otherwise a wrong eps passes whenever every drawn row is large (1 seed in 2000 did).
        row_scale.flat[0] = 1e-3
        feeds[name] = ((rng.standard_normal(shape) + 0.3) * row_scale).astype(np.float32)
    try:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.intra_op_num_threads = 1
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        (actual,) = session.run([site.output.name], feeds)
    except Exception as exc:  # ORT raises its own exception types; any failure rejects the site
        raise Rejected(f"numeric self-check could not run: {str(exc).splitlines()[0][:160]}") from None
    expected = _reference(site, [feeds[n] for n in feed_names])
    scale = max(float(np.max(np.abs(site.gain))) if site.gain is not None else 1.0, 1e-30)
    if actual.shape != expected.shape or not np.allclose(actual, expected, rtol=_RTOL, atol=_ATOL * scale):
        worst = float(np.max(np.abs(actual - expected))) if actual.shape == expected.shape else float("nan")
        formula = (f"(x−μ)/sqrt(mean((x−μ)²)+{site.eps:g})·gain+bias" if site.kind == "layer"
                   else f"x/sqrt(mean(x²)+{site.eps:g})·gain")
        raise Rejected(
            f"numeric self-check failed: subgraph differs from {formula} "
            f"(max abs diff {worst:.3g}, shapes {actual.shape} vs {expected.shape})"
        )


def _reference(site: NormSite, data: list[np.ndarray]) -> np.ndarray:
    x = sum(d.astype(np.float64) for d in data)
    fused = FUSED_OPS.get(site.spelling)
    if fused is not None and fused.sum_bias is not None and len(site.nodes[0].inputs) > fused.sum_bias:
        bias = constant_value(site.nodes[0].inputs[fused.sum_bias])
        if bias is not None:
            x = x + bias.astype(np.float64)
    if site.kind == "layer":
        x = x - np.mean(x, axis=-1, keepdims=True)
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + site.eps)
    if site.gain is not None:
        y = y * site.gain.reshape(gain_slot_shape(site))
    return y if site.bias is None else y + site.bias.reshape(bias_slot_shape(site))


def _extract(site: NormSite, opset: int) -> tuple[onnx.ModelProto, list[str]]:
    produced = {t.name for node in site.nodes for t in node.outputs}
    feed_names = [t.name for t in site.data_inputs]
    initializers, seen = [], set(feed_names) | produced
    nodes = []
    needs_opset = opset
    for node in site.nodes:
        for tensor in node.inputs:
            if not tensor.name or tensor.name in seen:
                continue
            value = constant_value(tensor)
            if value is None:
                raise Rejected(f"node {node.name or node.op} reads non-constant {tensor.name!r} from outside the site")
            if np.issubdtype(value.dtype, np.floating) or value.dtype.name == "bfloat16":
                value = value.astype(np.float32)
            initializers.append(numpy_helper.from_array(np.asarray(value), tensor.name))
            seen.add(tensor.name)
        attrs = {k: _widen(node, k, v) for k, v in node.attrs.items()}
        domain = node.domain or ""
        if node.op == "SimplifiedLayerNormalization":
            domain = ""  # ONNX Runtime registers it in the default domain only
        if node.op == "RMSNormalization":
            needs_opset = max(needs_opset, 23)
        nodes.append(helper.make_node(node.op, [t.name for t in node.inputs], [t.name for t in node.outputs],
                                      name=node.name or None, domain=domain, **attrs))
    graph = helper.make_graph(
        nodes,
        "flashnorm_self_check",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in feed_names],
        [helper.make_tensor_value_info(site.output.name, TensorProto.FLOAT, None)],
        initializers,
    )
    opsets = [helper.make_opsetid("", needs_opset), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = min(model.ir_version, 10)
    return model, feed_names


def _widen(node: gs.Node, key: str, value):
    if node.op == "Cast" and key == "to" and int(value) in _FLOAT_TYPES:
        return TensorProto.FLOAT
    if node.op in ("RMSNormalization", "SimplifiedLayerNormalization", "LayerNormalization") and key == "stash_type":
        return 1
    return value
