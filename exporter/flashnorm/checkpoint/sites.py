"""Which norms of a Hugging Face model can be folded, derived from the model itself.

A small instance of the architecture (the checkpoint's own config, at most two decoder
layers, a small vocabulary, random weights) runs one forward pass while a torch function mode
records every operation that reads each norm's output. The rule is the ONNX fold's: a norm is
folded only when every consumer of its output is a linear layer reading it as its input (row
selection on the token axes, `h[:, -k:, :]` before an LM head, is followed through). Each norm
module's gain convention is measured, not looked up: `w` when a zero weight gives a zero
output, `1+w` (Gemma 1-3) when a zero weight gives the plain normalized input.

`probe_structure` (fold_checkpoint) traces RMSNorms of causal LMs. `loaded_structure`
(`flashnorm export --fold`) traces an already loaded model of any kind, causal LM or encoder,
RMSNorms and LayerNorms (kind 'layer': a gain, a bias, and the mean the fold centres out of
the consumers' weights); a norm whose output is also a model output (an encoder's
last_hidden_state) is left alone. GPT-2's Conv1D ([in, out] weights, `addmm` on a flattened
input) counts as a linear layer.
"""

from __future__ import annotations

import copy
import gc
import dataclasses
import re
from typing import Any

from flashnorm.errors import FlashNormError

PROBE_LAYERS = 2
PROBE_VOCAB = 256


@dataclasses.dataclass
class NormSite:
    """One RMSNorm module of the checkpoint and what folding does with it."""

    name: str
    """The module path, e.g. `model.layers.3.input_layernorm`; its gain is `<name>.weight`."""

    convention: str
    """'w', '1+w', or 'none' (no gain, or not a per-channel gain after the normalization)."""

    consumers: list[str]
    """What reads the output: linear module paths, or `op <name>` for anything else."""

    linears: list[str] = dataclasses.field(default_factory=list)
    """The linear modules a fold scales (empty when the site is left alone)."""

    tied: dict[str, str] = dataclasses.field(default_factory=dict)
    """Linear module path → the stored tensor its weight shares (a tied LM head)."""

    reason: str = ""
    """Why the site is left alone; empty when it is folded."""

    kind: str = "rms"
    """'rms' or 'layer' (LayerNorm: its bias is `<name>.bias`, the fold also centres)."""

    @property
    def folded(self) -> bool:
        return not self.reason

    @property
    def weight(self) -> str:
        return f"{self.name}.weight"


@dataclasses.dataclass
class Structure:
    """The norms of a whole checkpoint (every layer), in module order."""

    architecture: str
    sites: list[NormSite]


def probe_structure(config: Any, *, untie: bool) -> Structure:
    """The norm sites of a model with this config, every layer, and whether each folds.

    Raises FlashNormError (one line, naming the architecture) when transformers cannot build
    the model, it has no RMSNorm, or its decoder layers do not share one norm layout.
    """
    architecture = _architecture(config)
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    model = _small_instance(config, architecture)
    sites = _trace(model, architecture)
    if not sites:
        raise FlashNormError(f"unsupported architecture {architecture}: it has no RMSNorm module")
    layer_list = _decoder_layers(model)
    del model
    gc.collect()  # the probe's weights go now, not whenever a cycle collection happens to run
    return Structure(architecture, _all_layers(sites, layer_list, layers, architecture, untie))


def loaded_structure(model: Any) -> Structure:
    """The norm sites (RMSNorm and LayerNorm) of an already loaded model — a causal LM or an
    encoder — traced on the model itself with one small forward pass (`_probe_inputs`); tied
    linear weights keep their norm's gain, as `probe_structure(untie=False)` decides."""
    architecture = _architecture(model.config)
    sites = _trace(model, architecture, layer_norms=True, inputs=_probe_inputs(model), outputs_read=True)
    if not sites:
        raise FlashNormError(f"unsupported architecture {architecture}: it has no RMSNorm or LayerNorm module")
    for site in sites.values():
        if site.tied:
            pairs = ", ".join(f"{k} is tied to {v}" for k, v in site.tied.items())
            site.reason, site.linears = f"{pairs} (the tie is kept)", []
    return Structure(architecture, list(sites.values()))


def _probe_inputs(model: Any) -> dict[str, Any]:
    """The smallest inputs the model's forward takes, by the names it accepts: a few token ids,
    one image of the configured size, one Whisper input of its fixed length."""
    import inspect

    import torch

    config = model.config
    accepted = inspect.signature(model.forward).parameters
    generator = torch.Generator().manual_seed(0)
    dtype = next(model.parameters()).dtype
    inputs: dict[str, Any] = {}
    if "pixel_values" in accepted:
        size, channels = int(config.image_size), int(getattr(config, "num_channels", 3))
        inputs["pixel_values"] = torch.randn(1, channels, size, size, generator=generator).to(dtype)
    elif "input_features" in accepted:
        frames = 2 * int(config.max_source_positions)
        inputs["input_features"] = torch.randn(1, int(config.num_mel_bins), frames, generator=generator).to(dtype)
    else:
        vocabulary = max(1, int(getattr(config, "vocab_size", 4)))
        inputs["input_ids"] = torch.arange(4, dtype=torch.long).unsqueeze(0) % vocabulary
    if "decoder_input_ids" in accepted:
        inputs["decoder_input_ids"] = torch.zeros(1, 2, dtype=torch.long)
    if "use_cache" in accepted:
        inputs["use_cache"] = False
    return inputs


def _architecture(config: Any) -> str:
    names = getattr(config, "architectures", None) or []
    return names[0] if names else f"model_type {getattr(config, 'model_type', '?')!r}"


def _small_instance(config: Any, architecture: str):
    """The architecture with at most PROBE_LAYERS layers and a small vocabulary, random
    weights, eval mode. Widths stay as they are: they decide nothing here but could be tied
    to other fields (head counts, RoPE tables) in ways a generic shrink would break."""
    import torch
    from transformers import AutoModelForCausalLM

    small = copy.deepcopy(config)
    layers = int(getattr(small, "num_hidden_layers", 0) or 0)
    if layers < 1:
        raise FlashNormError(f"unsupported architecture {architecture}: config has no num_hidden_layers")
    small.num_hidden_layers = min(layers, PROBE_LAYERS)
    if isinstance(getattr(small, "layer_types", None), list):
        small.layer_types = small.layer_types[: small.num_hidden_layers]
    if getattr(small, "vocab_size", 0) and small.vocab_size > PROBE_VOCAB:
        small.vocab_size = PROBE_VOCAB
        for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
            if getattr(small, key, None) is not None:
                setattr(small, key, None)
    dtype = torch.float32 if _parameter_estimate(small) < 300e6 else torch.bfloat16
    try:
        with torch.random.fork_rng(devices=[]):  # the caller's random state is left as it was
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(small, dtype=dtype)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise FlashNormError(f"unsupported architecture {architecture}: transformers cannot build it ({first})") from None
    return model.eval()


def _parameter_estimate(config: Any) -> float:
    hidden = getattr(config, "hidden_size", 0) or 0
    inner = getattr(config, "intermediate_size", 0) or 4 * hidden
    return config.num_hidden_layers * (4 * hidden * hidden + 3 * hidden * inner)


def _is_norm(module: Any) -> bool:
    return "rmsnorm" in type(module).__name__.lower()


def _is_layer_norm(module: Any) -> bool:
    import torch

    return isinstance(module, torch.nn.LayerNorm) or type(module).__name__.lower().endswith("layernorm") and not _is_norm(module)


def _layer_norm_convention(module: Any) -> str:
    """'w' when the module computes F.layer_norm over its last axis with its weight and bias
    (measured on a float32 copy), 'none' otherwise (no per-channel affine, or another function)."""
    import torch

    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.nn.Parameter) or weight.ndim != 1 or weight.numel() < 2:
        return "none"
    probe = copy.deepcopy(module).float()
    size = weight.numel()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, size, generator=generator) * 2 + 0.5
    gain, shift = torch.rand(size, generator=generator) + 0.5, torch.randn(size, generator=generator)
    eps = float(getattr(module, "eps", getattr(module, "variance_epsilon", 1e-5)))
    with torch.no_grad():
        probe.weight.copy_(gain)
        if getattr(probe, "bias", None) is not None:
            probe.bias.copy_(shift)
        else:
            shift = None
        got = probe(x)
    want = torch.nn.functional.layer_norm(x, (size,), gain, shift, eps)
    return "w" if got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-5) else "none"


def _convention(module: Any) -> str:
    """'w' or '1+w' as measured on a float32 copy of the module, 'none' otherwise."""
    import torch

    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.nn.Parameter) or weight.ndim != 1 or weight.numel() < 2:
        return "none"
    probe = copy.deepcopy(module).float()
    size = weight.numel()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, size, generator=generator, dtype=torch.float32)
    gain = torch.rand(size, generator=generator) + 0.5
    with torch.no_grad():
        probe.weight.zero_()
        at_zero = probe(x)
        probe.weight.copy_(gain)
        at_gain = probe(x)
    if at_zero.shape != x.shape:
        return "none"
    if torch.count_nonzero(at_zero) == 0:
        with torch.no_grad():
            probe.weight.fill_(1.0)
            plain = probe(x)
        return "w" if torch.allclose(at_gain, plain * gain, rtol=1e-5, atol=1e-6) else "none"
    return "1+w" if torch.allclose(at_gain, at_zero * (1 + gain), rtol=1e-5, atol=1e-6) else "none"


def _keeps_last_axis(index: Any) -> bool:
    """Whether `t[index]` selects rows (tokens) and keeps the channel axis whole."""
    if not isinstance(index, tuple) or not index:
        return False
    last = index[-1]
    return isinstance(last, slice) and last == slice(None) and Ellipsis not in index[:-1]


def _is_conv1d(module: Any) -> bool:
    """GPT-2's Conv1D: a linear layer storing its weight [in, out] and computing addmm."""
    return type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None and module.weight.ndim == 2


def _trace(model: Any, architecture: str, *, layer_norms: bool = False, inputs: dict[str, Any] | None = None,
           outputs_read: bool = False) -> dict[str, NormSite]:
    """One forward pass of `model` (on `inputs`, default a few token ids); every RMSNorm
    module's (with `layer_norms`, every LayerNorm's too) consumers and convention. With
    `outputs_read`, a norm output that is also a model output counts as read by 'op output'."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_leaves

    linears = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) or _is_conv1d(m)}
    linear_of = {id(m.weight): name for name, m in linears.items()}
    linear_in = {name: m.weight.shape[0] if _is_conv1d(m) else m.in_features for name, m in linears.items()}
    watched: dict[int, str] = {}
    transposed_of: dict[int, str] = {}
    keep: list[Any] = []  # holds watched tensors so that their ids are not reused
    uses: dict[str, list[str]] = {}

    class Consumers(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            result = func(*args, **kwargs)
            if not any(isinstance(leaf, torch.Tensor) for leaf in tree_leaves(result)):
                return result  # shape, dtype and other metadata reads are not consumers
            if (args and isinstance(args[0], torch.Tensor) and id(args[0]) in linear_of
                    and isinstance(result, torch.Tensor) and result.ndim == 2 and result.shape == args[0].shape[::-1]):
                transposed_of[id(result)] = linear_of[id(args[0])]  # weight.T, for `x @ weight.T` (Falcon)
                keep.append(result)
            for leaf in tree_leaves((args, kwargs)):
                site = watched.get(id(leaf)) if isinstance(leaf, torch.Tensor) else None
                if site is None:
                    continue
                name = getattr(func, "__name__", str(func))
                if func is torch.nn.functional.linear and args and args[0] is leaf and id(args[1]) in linear_of:
                    uses[site].append(linear_of[id(args[1])])
                elif func is torch.addmm and len(args) > 2 and args[1] is leaf and id(args[2]) in linear_of:
                    uses[site].append(linear_of[id(args[2])])  # Conv1D
                elif name in ("matmul", "__matmul__") and len(args) > 1 and args[0] is leaf and id(args[1]) in transposed_of:
                    uses[site].append(transposed_of[id(args[1])])
                elif name == "__getitem__" and args and args[0] is leaf and _keeps_last_axis(args[1]):
                    watched[id(result)] = site
                    keep.append(result)
                elif (name in ("view", "reshape") and args and args[0] is leaf and isinstance(result, torch.Tensor)
                      and result.ndim >= 1 and result.shape[-1] == leaf.shape[-1]):
                    watched[id(result)] = site  # rows flattened, channels kept (Conv1D's input)
                    keep.append(result)
                else:
                    uses[site].append(f"op {name}")
            return result

    sites: dict[str, NormSite] = {}
    handles = []
    for name, module in model.named_modules():
        if _is_norm(module):
            sites[name] = NormSite(name, _convention(module), [])
        elif layer_norms and _is_layer_norm(module):
            sites[name] = NormSite(name, _layer_norm_convention(module), [], kind="layer")
        else:
            continue
        uses[name] = []

        def record(mod, inputs, output, name=name):
            if isinstance(output, torch.Tensor):
                watched[id(output)] = name
                keep.append(output)

        handles.append(module.register_forward_hook(record))
    if inputs is None:
        ids = torch.arange(4, dtype=torch.long).unsqueeze(0) % max(1, int(getattr(model.config, "vocab_size", 4)))
        inputs = {"input_ids": ids, "use_cache": False}
    try:
        with torch.no_grad(), Consumers():
            output = model(**inputs)
        if outputs_read:
            values = output.values() if hasattr(output, "values") else output
            for leaf in tree_leaves(list(values) if not isinstance(values, torch.Tensor) else values):
                site = watched.get(id(leaf)) if isinstance(leaf, torch.Tensor) else None
                if site is not None:
                    uses[site].append("op output")
    except Exception as exc:  # noqa: BLE001 - any failure means we cannot see the structure
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise FlashNormError(f"unsupported architecture {architecture}: a probe forward pass failed ({first})") from None
    finally:
        for handle in handles:
            handle.remove()
    shared = _shared_weights(model)
    for name, site in sites.items():
        site.consumers = list(dict.fromkeys(uses[name]))
        weight = getattr(model.get_submodule(name), "weight", None)
        size = weight.numel() if weight is not None else 0
        site.reason = _reason(site, size, linear_in, shared)
        if not site.reason:
            site.linears = list(site.consumers)
            site.tied = {lin: shared[lin] for lin in site.linears if lin in shared}
    return sites


def _shared_weights(model: Any) -> dict[str, str]:
    """Linear module path → the first name of its weight when that weight is shared (tied)."""
    import torch

    names: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    shared = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and len(names.get(id(module.weight), [])) > 1:
            first = names[id(module.weight)][0]
            if first != f"{name}.weight":
                shared[name] = first
    return shared


def _reason(site: NormSite, size: int, linear_in: dict[str, int], shared: dict[str, str]) -> str:
    """Why `site` cannot be folded, or '' when it can (before --untie and gain values)."""
    if site.convention == "none":
        return "no per-channel gain after the normalization (no weight, or neither w nor 1+w)"
    if not site.consumers:
        return "its output is not read"
    if "op output" in site.consumers:
        return "its output is also a model output (e.g. last_hidden_state)"
    others = [c for c in site.consumers if c.startswith("op ")]
    if others:
        return f"its output reaches {', '.join(sorted(set(c[3:] for c in others)))} (not a linear layer)"
    wrong = [c for c in site.consumers if linear_in.get(c) != size]
    if wrong:
        return f"{', '.join(wrong)} does not read {size} channels"
    return ""


def _decoder_layers(model: Any) -> str | None:
    """The path of the decoder-layer list (`model.layers`): the ModuleList holding the most
    norm modules."""
    import torch

    best, count = None, 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList):
            norms = sum(1 for m in module.modules() if _is_norm(m))
            if norms > count:
                best, count = name, norms
    return best


def _relative(sites: dict[str, NormSite], prefix: str, index: int) -> list[tuple]:
    """Layer `index`'s sites with the layer prefix removed, comparable across layers."""
    head = f"{prefix}.{index}."
    strip = lambda text: text.replace(head, "", 1) if text.startswith(head) else text  # noqa: E731
    return [(strip(s.name), s.convention, tuple(strip(c) for c in s.consumers), s.reason)
            for s in sites.values() if s.name.startswith(head)]


def _all_layers(sites: dict[str, NormSite], prefix: str | None, layers: int, architecture: str,
                untie: bool) -> list[NormSite]:
    """The probe's sites with its first layer's sites repeated for every layer of the real
    model (after checking that the probed layers agree), then --untie applied."""
    result: list[NormSite] = list(sites.values())
    if prefix is not None:
        pattern = re.compile(rf"^{re.escape(prefix)}\.(\d+)\.")
        probed = sorted({int(m.group(1)) for name in sites if (m := pattern.match(name))})
        layouts = [_relative(sites, prefix, i) for i in probed]
        if any(layout != layouts[0] for layout in layouts[1:]):
            raise FlashNormError(f"unsupported architecture {architecture}: its decoder layers do not share one norm layout")
        head = f"{prefix}.{probed[0]}." if probed else ""
        template = [s for s in sites.values() if head and s.name.startswith(head)]
        expanded = []
        for i in range(layers):
            here = f"{prefix}.{i}."
            move = lambda text, here=here: here + text[len(head):] if text.startswith(head) else text  # noqa: E731
            for s in template:
                expanded.append(dataclasses.replace(
                    s, name=move(s.name), consumers=[move(c) for c in s.consumers],
                    linears=[move(c) for c in s.linears], tied={move(k): v for k, v in s.tied.items()}))
        result = []
        for s in sites.values():
            if not pattern.match(s.name):
                result.append(s)
            elif s.name.startswith(head) and s is template[0]:
                result += expanded
    for site in result:
        if site.tied and not untie:
            pairs = ", ".join(f"{k} is tied to {v}" for k, v in site.tied.items())
            site.reason = f"{pairs} (--untie writes an own weight and folds it)"
            site.linears = []
    return result
