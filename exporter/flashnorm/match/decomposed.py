"""RMSNorm and LayerNorm written out op by op, in every spelling exporters emit:

    LayerNorm . μ = ReduceMean(a, axes=[-1]), x = Sub(a, μ), up to two Casts (torch.onnx below
                opset 17 casts x of a half model to double here); RMSNorm: x = a
    x² ........ Pow(x, 2) | Mul(x, x)
    mean ...... ReduceMean(·, axes=[-1], keepdims=1), axes as attribute or input (opset ≥ 18)
    + eps ..... Add(·, eps) either operand order (absent: eps = 0)
    1/rms ..... Sqrt → Div(x, ·)  |  Sqrt → Reciprocal → Mul  |  Sqrt → Div(1, ·) → Mul
                |  Pow(·, -0.5) → Mul
    then up to two Casts, an optional gain Mul (w, a Cast of w, or Add(w, 1)), up to two Casts,
    and for a LayerNorm an optional bias Add (either operand order), up to two Casts.

The anchor is the ReduceMean of a square; everything else is followed from there. A mean
subtracted in front of the square makes the site a LayerNorm (kind 'layer').
"""

from __future__ import annotations

from typing import Optional

import onnx_graphsurgeon as gs

from flashnorm.match.queries import constant_value, is_scalar_equal, last_dim, producer, tensor_rank
from flashnorm.match.gain import read_gain
from flashnorm.match.rejection import Rejected
from flashnorm.match.site import NormSite

SPELLING = "decomposed"
_MAX_CASTS = 2


def square_source(node: gs.Node) -> Optional[gs.Tensor]:
    """x if `node` computes x² (Pow(x, 2) or Mul(x, x)), else None."""
    if node.op == "Pow" and len(node.inputs) == 2 and is_scalar_equal(constant_value(node.inputs[1]), 2.0):
        return node.inputs[0]
    if node.op == "Mul" and len(node.inputs) == 2 and node.inputs[0] is node.inputs[1]:
        return node.inputs[0]
    return None


def is_candidate(node: gs.Node) -> bool:
    """A ReduceMean of a square: where a decomposed RMSNorm (or a LayerNorm variance) starts."""
    if node.op != "ReduceMean" or not node.inputs:
        return False
    square = producer(node.inputs[0])
    return square is not None and square_source(square) is not None


def match(reduce_mean: gs.Node, graph_outputs: frozenset[str] = frozenset()) -> NormSite:
    """The NormSite anchored at `reduce_mean` (see `is_candidate`); raises Rejected.
    `graph_outputs` names the graph's outputs: a tensor the user reads is where a site ends."""
    def only_consumer(tensor: gs.Tensor, op: str) -> Optional[gs.Node]:
        return None if tensor.name in graph_outputs else _only_consumer(tensor, op)

    square = producer(reduce_mean.inputs[0])
    x = square_source(square)
    source, centring = _mean_centring(x)
    axis = _reduced_axis(reduce_mean, x)
    nodes = [*centring, square, reduce_mean]

    mean_square = reduce_mean.outputs[0]
    eps, after_eps = 0.0, mean_square
    eps_add = only_consumer(mean_square, "Add")
    if eps_add is not None:
        other = _other_input(eps_add, mean_square)
        value = constant_value(other)
        if value is None or value.size != 1:
            raise Rejected("the Add after ReduceMean does not add a constant eps")
        eps, after_eps = float(value.reshape(())), eps_add.outputs[0]
        nodes.append(eps_add)

    def casts(tensor: gs.Tensor, cast_to: Optional[int]) -> tuple[gs.Tensor, Optional[int]]:
        # A short chain of Casts (an fp32 → fp32 Cast from the legacy exporter, then the Cast
        # down to a half type) belongs to the site.
        for _ in range(_MAX_CASTS):
            cast = only_consumer(tensor, "Cast")
            if cast is None:
                break
            nodes.append(cast)
            tensor, cast_to = cast.outputs[0], int(cast.attrs["to"])
        return tensor, cast_to

    normalized = _divide_by_rms(after_eps, x, nodes)
    output, output_cast = casts(normalized, None)

    gain = gain_node = gain_index = None
    mul = only_consumer(output, "Mul")
    if mul is not None:
        index = 1 if mul.inputs[0] is output else 0
        gain = read_gain(mul.inputs[index])
        if gain is not None:
            nodes.append(mul)
            gain_node, gain_index, output = mul, index, mul.outputs[0]
            output, output_cast = casts(output, output_cast)

    bias = bias_node = bias_index = None
    add = only_consumer(output, "Add") if centring else None
    if add is not None:
        index = 1 if add.inputs[0] is output else 0
        bias = read_gain(add.inputs[index])  # a bias reads like a gain: a constant per-channel vector
        if bias is not None:
            nodes.append(add)
            bias_node, bias_index, output = add, index, add.outputs[0]
            output, output_cast = casts(output, output_cast)

    return NormSite(
        name=output.name,
        spelling=SPELLING,
        input=source,
        output=output,
        nodes=nodes,
        eps=eps,
        axis=axis,
        gain=None if gain is None else gain.value,
        gain_convention="none" if gain is None else gain.convention,
        gain_tensor=None if gain is None else gain.tensor,
        hidden_size=last_dim(source) or (None if gain is None else int(gain.value.size)),
        gain_node=gain_node,
        gain_index=gain_index,
        gain_dtype=None if gain is None else gain.dtype,
        data_inputs=[source],
        output_cast=output_cast,
        kind="layer" if centring else "rms",
        bias=None if bias is None else bias.value,
        bias_tensor=None if bias is None else bias.tensor,
        bias_node=bias_node,
        bias_index=bias_index,
        bias_dtype=None if bias is None else bias.dtype,
    )


def _mean_centring(x: gs.Tensor) -> tuple[gs.Tensor, list[gs.Node]]:
    """(a, [ReduceMean, Sub, Casts...]) when x = Cast*(a − mean(a, -1)), the centring of a
    LayerNorm; (x, []) otherwise."""
    casts: list[gs.Node] = []
    node = producer(x)
    while node is not None and node.op == "Cast" and len(casts) < _MAX_CASTS:
        casts.insert(0, node)
        node = producer(node.inputs[0])
    if node is None or node.op != "Sub" or len(node.inputs) != 2:
        return x, []
    a, mean = node.inputs[0], producer(node.inputs[1])
    if mean is None or mean.op != "ReduceMean" or not mean.inputs or mean.inputs[0] is not a:
        return x, []
    _reduced_axis(mean, a)  # the mean over the last axis only, as the variance's
    return a, [mean, node, *casts]


def _reduced_axis(reduce_mean: gs.Node, x: gs.Tensor) -> int:
    if int(reduce_mean.attrs.get("keepdims", 1)) != 1:
        raise Rejected("ReduceMean has keepdims=0")
    if "axes" in reduce_mean.attrs:
        axes = list(reduce_mean.attrs["axes"])
    elif len(reduce_mean.inputs) > 1 and reduce_mean.inputs[1].name:
        value = constant_value(reduce_mean.inputs[1])
        if value is None:
            raise Rejected("ReduceMean axes are not constant")
        axes = [int(a) for a in value.reshape(-1)]
    else:
        raise Rejected("ReduceMean reduces over every axis")
    if len(axes) != 1:
        raise Rejected(f"ReduceMean reduces over axes {axes}, not one axis")
    axis, rank = axes[0], tensor_rank(x)
    if axis >= 0:
        if rank is None:
            raise Rejected(f"ReduceMean axis {axis} with unknown input rank: cannot prove it is the last axis")
        axis -= rank
    if axis != -1:
        raise Rejected(f"ReduceMean over axis {axis}, not the last axis")
    return axis


def _divide_by_rms(mean_square_eps: gs.Tensor, x: gs.Tensor, nodes: list[gs.Node]) -> gs.Tensor:
    """Follow sqrt/reciprocal/divide from mean(x²)+eps to x/rms(x); append the nodes."""
    sqrt = _only_consumer(mean_square_eps, "Sqrt")
    if sqrt is not None:
        nodes.append(sqrt)
        rms = sqrt.outputs[0]
        for consumer in rms.outputs:
            if consumer.op == "Div" and consumer.inputs[1] is rms:
                if consumer.inputs[0] is x:
                    nodes.append(consumer)
                    return consumer.outputs[0]
                if is_scalar_equal(constant_value(consumer.inputs[0]), 1.0):
                    nodes.append(consumer)
                    return _multiply_by(consumer.outputs[0], x, nodes)
            if consumer.op == "Reciprocal":
                nodes.append(consumer)
                return _multiply_by(consumer.outputs[0], x, nodes)
        raise Rejected("Sqrt of the mean square is not followed by Div(x, ·), Reciprocal or Div(1, ·)")
    for consumer in mean_square_eps.outputs:
        if consumer.op == "Pow" and consumer.inputs[0] is mean_square_eps and is_scalar_equal(
            constant_value(consumer.inputs[1]), -0.5
        ):
            nodes.append(consumer)
            return _multiply_by(consumer.outputs[0], x, nodes)
    raise Rejected("mean square (+eps) is not followed by Sqrt or Pow(·, -0.5)")


def _multiply_by(inverse_rms: gs.Tensor, x: gs.Tensor, nodes: list[gs.Node]) -> gs.Tensor:
    for consumer in inverse_rms.outputs:
        if consumer.op == "Mul" and x in consumer.inputs and inverse_rms in consumer.inputs:
            nodes.append(consumer)
            return consumer.outputs[0]
    raise Rejected("1/rms(x) is not multiplied with the same x whose square was averaged")


def _only_consumer(tensor: gs.Tensor, op: str) -> Optional[gs.Node]:
    """The consumer of `tensor` when there is exactly one and it is `op`."""
    consumers = list(tensor.outputs)
    if len(consumers) == 1 and consumers[0].op == op:
        return consumers[0]
    return None


def _other_input(node: gs.Node, tensor: gs.Tensor) -> gs.Tensor:
    return node.inputs[1] if node.inputs[0] is tensor else node.inputs[0]
