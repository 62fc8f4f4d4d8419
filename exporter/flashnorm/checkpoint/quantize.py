"""Does folding hurt int8 weight-only quantization? Folding scales column k of every consumer
weight by g[k], which can widen a row's range and so its quantization step.

Quantization here is PyTorch's own: per-output-channel symmetric int8
(`PerChannelMinMaxObserver`, `torch.quantize_per_channel`, the weight path of
`quantize_dynamic`'s per-channel config) applied to every linear layer but the LM head, then
dequantized, with activations left in float32: weight-only, the same arithmetic as
torchao's int8 weight-only config up to the scale's denominator.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

SAMPLE_TEXT = (
    "The river rises in the hills north of the town and runs for about forty miles before it "
    "reaches the sea. In the spring, when the snow melts, it floods the low meadows along its "
    "banks, and the farmers move their sheep to higher ground. A stone bridge, built more than "
    "two hundred years ago, still carries the main road across the water. Children fish from it "
    "in the summer, and in the autumn the whole town gathers there for the harvest fair."
)
"""Real English text for the logits comparisons (written for this project)."""

RATIO_LIMIT = 1.1


def quantize_int8_weights(model: Any, skip: tuple[str, ...] = ("lm_head",)) -> list[str]:
    """Replace every nn.Linear weight (but `skip`) by its int8 per-channel round trip, in place;
    returns the quantized module names."""
    import torch

    done = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or name.split(".")[-1] in skip:
            continue
        with torch.no_grad():
            module.weight.copy_(int8_round_trip(module.weight.detach()))
        done.append(name)
    return done


def int8_round_trip(weight: Any):
    """W → dequantize(quantize_per_channel(W)) with per-row symmetric qint8 scales."""
    import torch
    from torch.ao.quantization.observer import PerChannelMinMaxObserver

    observer = PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
    w = weight.float()
    observer(w)
    scales, zero_points = observer.calculate_qparams()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*deprecated")
        quantized = torch.quantize_per_channel(w, scales, zero_points, 0, torch.qint8)
    return quantized.dequantize().to(weight.dtype)


def _relative(a: Any, b: Any) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _linear_inputs(model: Any, input_ids: Any) -> dict[str, Any]:
    """Each linear layer's input on one forward pass, by module name."""
    import torch

    captured: dict[str, Any] = {}
    handles = [module.register_forward_pre_hook(lambda mod, args, name=name: captured.__setitem__(name, args[0].detach()))
               for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    try:
        with torch.no_grad():
            model(input_ids=input_ids)
    finally:
        for handle in handles:
            handle.remove()
    return captured


def int8_check(original: Any, folded: Any, input_ids: Any) -> dict[str, Any]:
    """Logits error of int8(original) and int8(folded) against the float32 original on
    `input_ids`, their ratio against RATIO_LIMIT, and per layer the same ratio for the layer's
    own output (each on its float32 model's input to that layer), worst first."""
    import torch

    original, folded = original.eval(), folded.eval()
    with torch.no_grad():
        reference = original(input_ids=input_ids).logits
    inputs = {"original": _linear_inputs(original, input_ids), "folded": _linear_inputs(folded, input_ids)}
    errors = {}
    for label, model in (("original", original), ("folded", folded)):
        quantized = copy.deepcopy(model)
        names = quantize_int8_weights(quantized)
        with torch.no_grad():
            errors[label] = _relative(quantized(input_ids=input_ids).logits, reference)
        del quantized
    layers = []
    originals = dict(original.named_modules())
    for name, module in folded.named_modules():
        if name not in names:
            continue
        per = {}
        for label, model_module in (("original", originals[name]), ("folded", module)):
            x, w = inputs[label][name], model_module.weight.detach()
            exact = x @ w.T
            per[label] = _relative(x @ int8_round_trip(w).T, exact)
        ratio = per["folded"] / per["original"] if per["original"] else float("inf")
        layers.append({"layer": name, "original_error": per["original"], "folded_error": per["folded"], "ratio": ratio})
    layers.sort(key=lambda row: row["ratio"], reverse=True)
    ratio = errors["folded"] / errors["original"]
    return {
        "scheme": "int8 weight-only, per-output-channel symmetric (torch.quantize_per_channel), all linears but lm_head",
        "tokens": int(input_ids.numel()),
        "original_int8_error": errors["original"],
        "folded_int8_error": errors["folded"],
        "ratio": ratio,
        "limit": RATIO_LIMIT,
        "passed": ratio <= RATIO_LIMIT,
        "layers_over_limit": [row for row in layers if row["ratio"] > RATIO_LIMIT],
        "layers": layers,
    }
