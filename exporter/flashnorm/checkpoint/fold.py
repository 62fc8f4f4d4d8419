"""fold_checkpoint: a Hugging Face checkpoint in, the same checkpoint with every foldable
RMSNorm weightless out (its gain moved into the columns of the linear weights that read it).

`nn.Linear` stores W as [out, in] and computes x·Wᵀ, so RMSNorm(x)·diag(g)·Wᵀ = x̂·(W·diag(g))ᵀ:
column k of each consumer's weight is scaled by g[k] (for Gemma's (1+w) modules g = 1+w). The
product is formed in float64 and rounded once to the stored dtype; biases are untouched. The
norm's weight becomes the identity of its convention (ones, or zeros for 1+w), so stock
transformers loads the result and computes the same function.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flashnorm.checkpoint.shards import (
    INDEX_NAME, BlockBuffers, Planned, SafetensorsSource, StateDictSource, TensorSource, write_shard,
)
from flashnorm.checkpoint.sites import NormSite, loaded_structure, probe_structure
from flashnorm.errors import FlashNormError
from flashnorm.export.checks import check_model_directory
from flashnorm.files import staged_directory
from flashnorm.progress import ByteProgress
from flashnorm.quantization_aware import Candidate, Rule, int8_error_estimate, rule
from flashnorm.untrusted import read_json

if TYPE_CHECKING:
    from flashnorm.export.sources import ModelSource

FOLD_KEY = "flashnorm"
"""config.json key a folded checkpoint carries: which norms are weightless, and how."""

DTYPES = ("auto", "float32", "float16", "bfloat16")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".gguf", ".ckpt")


def fold_checkpoint(source: ModelSource | str | os.PathLike[str], output: str | os.PathLike[str], *,
                    untie: bool = False, dtype: str = "auto", model: Any = None,
                    force: bool = False, int8_limit: float | None = None,
                    for_quantization: str | None = None) -> dict[str, Any]:
    """Write the folded checkpoint of `source` (a resolved ModelSource, or a Hugging Face
    directory's path) to the new directory `output`; return the report.

    For a GGUF source, `model` may be the already loaded float32 model (as `load_causal_lm`
    gives it), which saves dequantizing the file again.

    With `for_quantization` (a `flashnorm.quantization_aware.FORMATS` name), only the sites that
    selection picks for that later quantizer fold (the same selection as `flashnorm optimize
    --passes fold --for-quantization`). `int8_limit` (deprecated: `for_quantization='int8'`
    replaces it) leaves a norm unfolded where folding is estimated (`int8_error_estimate`) to
    raise its consumers' int8 per-channel error by more than that factor.

    The output is staged in a temporary directory beside it and renamed into place at the
    end (flashnorm.files.staged_directory; a non-empty `output` is replaced only with
    `force`); on any failure nothing is left behind. Raises FlashNormError with one line for a bad
    source, an unsupported architecture, an already folded checkpoint or an unwritable output.
    """
    started = time.monotonic()
    if isinstance(source, (str, os.PathLike)):
        source = _Directory(Path(source))
    if dtype not in DTYPES:
        raise FlashNormError(f"--dtype {dtype} is not one of {', '.join(DTYPES)}")
    selection_rule = rule(for_quantization, int8_limit)
    if int8_limit is not None:
        warnings.warn("fold_checkpoint's int8_limit is deprecated: for_quantization='int8' replaces it "
                      "(docs/CHECKPOINTS.md)", DeprecationWarning, stacklevel=2)
    destination = Path(output)
    tensors: TensorSource | None = None
    with staged_directory(destination, force) as stage:
        try:
            tensors, structure, gains, growth, shards, estimates = _fold_into(stage, source, untie, dtype, model,
                                                                              selection_rule)
            tensors.check_unchanged()  # a source file replaced or rewritten meanwhile: nothing is put in place
        finally:
            if tensors is not None:
                tensors.close()
    report = _report(source, destination, structure, gains, growth, untie, dtype, shards, started)
    report["int8_limit"] = int8_limit
    if for_quantization:
        report["for_quantization"] = for_quantization
        for site in report["sites"]:
            if site["name"] in estimates:
                site["predicted_error_ratio"] = estimates[site["name"]]
    return report


def _fold_into(stage: Path, source: Any, untie: bool, dtype: str, model: Any, selection_rule: Rule | None) -> tuple:
    """Everything fold_checkpoint writes, into the empty directory `stage`."""
    tensors: TensorSource | None = None
    try:
        if source.gguf_file:
            config, tensors = _gguf(source, stage, model)
        else:
            config, tensors = _directory(source)
        structure = probe_structure(config, untie=untie)
        _check_names(structure.sites, tensors, structure.architecture, getattr(config, "quantization_config", None))
        _refuse_quantized(structure.sites, tensors, source)
        gains = _gains(structure.sites, tensors)
        estimates = _select(structure.sites, tensors, gains, selection_rule) if selection_rule else {}
        growth: dict[str, dict[str, float]] = {}
        shards, total = _plan(structure.sites, tensors, gains, dtype, growth)
        _write(stage, shards, total, indexed=source.gguf_file is None and (source.directory / INDEX_NAME).is_file())
        folded = [s for s in structure.sites if s.folded]
        if source.gguf_file:
            _write_config(stage / "config.json", stage / "config.json", folded, untie, dtype, dequantized=True)
        else:
            _copy_extras(source.directory, stage)
            _write_config(source.directory / "config.json", stage / "config.json", folded, untie, dtype)
    except BaseException:
        if tensors is not None:
            tensors.close()
        raise
    return tensors, structure, gains, growth, shards, estimates


def fold_loaded_model(model: Any, *, round_to: str | None = None) -> dict[str, Any]:
    """Fold every foldable norm of an already loaded transformers model — a causal LM or an
    encoder, RMSNorm or LayerNorm (`sites.loaded_structure`) — in place (tied heads stay tied,
    so the final norm of a tied model keeps its gain): each consumer's weight becomes
    W·diag(g) computed in float64 and rounded once, to `round_to` (a torch dtype name, e.g.
    'float16') when the model will be cast to it afterwards, else to the weight's own dtype;
    the norm's weight becomes its identity. For RMSNorms the same weights `fold_checkpoint(...,
    dtype=round_to)` writes; LayerNorms: `_fold_layer_norm`. For `flashnorm export --fold`.
    Returns {architecture, folded, left_alone, sites_left_alone}."""
    import torch

    structure = loaded_structure(model)
    modules = dict(model.named_modules())
    folded, alone = [], []
    with torch.no_grad():
        for site in structure.sites:
            if not site.folded:
                alone.append({"name": site.name, "reason": site.reason})
                continue
            if site.kind == "layer":
                if _fold_layer_norm(modules[site.name], [modules[lin] for lin in site.linears], round_to):
                    folded.append(site.name)
                else:
                    alone.append({"name": site.name, "reason": "its gain and bias are already the identity (weightless)"})
                continue
            norm = modules[site.name]
            gain = norm.weight.detach().to(torch.float64)
            if site.convention == "1+w":
                gain = gain + 1.0
            if bool(torch.all(gain == 1.0)):
                alone.append({"name": site.name, "reason": "its gain is already the identity (weightless)"})
                continue
            for linear in site.linears:
                weight = modules[linear].weight
                product = weight.detach().to(torch.float64) * gain
                if round_to is not None:
                    product = product.to(getattr(torch, round_to))
                weight.copy_(product.to(weight.dtype))
            norm.weight.fill_(0.0 if site.convention == "1+w" else 1.0)
            folded.append(site.name)
    return {"architecture": structure.architecture, "folded": len(folded), "left_alone": len(alone),
            "sites_left_alone": alone}


def _fold_layer_norm(norm: Any, linears: list[Any], round_to: str | None) -> bool:
    """Fold a LayerNorm's gain g and bias b into the linear layers that read it, and centre
    them, in float64 with one rounding (to `round_to`, else each tensor's own dtype):

        W* = W·diag(g),  c* = c + W·b,  W_c = W* − mean over the input axis of W*

    (nn.Linear stores W as [out, in]; GPT-2's Conv1D as [in, out]). After centring, every row
    of W_c sums to zero over the input channels, so x·W_cᵀ = (x − μ)·W_cᵀ: the consumer no
    longer needs the mean, and the LayerNorm, left with weight 1 and bias 0, still computes
    the same function. Rounded to float16 or bfloat16, the rows keep summing to zero
    (`flashnorm.rounding.round_centred`, as the ONNX fold rounds them), which a deferred node
    relies on. A linear without a bias gets one (b·W is rarely zero). Returns False (nothing
    changed) when g is all ones and b all zeros."""
    import numpy as np
    import torch

    from flashnorm.rounding import round_centred

    gain = norm.weight.detach().to(torch.float64)
    shift = norm.bias.detach().to(torch.float64) if getattr(norm, "bias", None) is not None else torch.zeros_like(gain)
    if bool(torch.all(gain == 1.0)) and not bool(torch.any(shift)):
        return False

    def rounded(value: Any, like: Any) -> Any:
        if round_to is not None:
            value = value.to(getattr(torch, round_to))
        return value.to(like.dtype)

    for linear in linears:
        conv1d = type(linear).__name__ == "Conv1D"
        weight = linear.weight.detach().to(torch.float64)
        weight = weight.T if conv1d else weight  # [out, in]
        bias = linear.bias.detach().to(torch.float64) if linear.bias is not None else torch.zeros(weight.shape[0], dtype=torch.float64)
        target = round_to or str(linear.weight.dtype).removeprefix("torch.")
        # The target type's values, held exactly in float64 until the weight's own type takes them.
        centred = torch.from_numpy(round_centred((weight * gain).numpy(), 1, target).astype(np.float64))
        new_bias = bias + weight @ shift
        linear.weight.copy_(centred.T if conv1d else centred)
        if linear.bias is None:
            linear.bias = torch.nn.Parameter(rounded(new_bias, linear.weight), requires_grad=False)
        else:
            linear.bias.copy_(rounded(new_bias, linear.bias))
    norm.weight.fill_(1.0)
    if getattr(norm, "bias", None) is not None:
        norm.bias.zero_()
    return True


@dataclasses.dataclass(frozen=True)
class _Directory:
    """A Hugging Face directory given by path (what ModelSource is for one, without needing
    the ONNX export package that ModelSource lives in)."""

    directory: Path
    gguf_file: None = None

    def describe(self) -> str:
        return str(self.directory)


def _directory(source: ModelSource) -> tuple[Any, TensorSource]:
    from transformers import AutoConfig

    check_model_directory(source.directory)  # no FIFO, device or symlink out of the folder is read below
    raw = read_json(source.directory / "config.json", "config")
    if not isinstance(raw, dict):
        raise FlashNormError(f"{source.describe()} is not a Hugging Face model directory: config.json is not an object")
    _refuse_folded(raw, source)
    try:
        config = AutoConfig.from_pretrained(str(source.directory), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        kind = raw.get("architectures") or raw.get("model_type")
        raise FlashNormError(f"unsupported architecture {kind}: {first}") from None
    return config, SafetensorsSource(source.directory)


def _refuse_folded(raw: dict[str, Any], source: ModelSource) -> None:
    if FOLD_KEY in raw:
        count = len(raw[FOLD_KEY].get("weightless_norms", {})) if isinstance(raw[FOLD_KEY], dict) else "?"
        raise FlashNormError(f"{source.describe()} is already folded (config.json '{FOLD_KEY}' lists {count} weightless norms)")


def _gguf(source: ModelSource, stage: Path, model: Any) -> tuple[Any, TensorSource]:
    """A GGUF file (or --model): dequantized by transformers, written as float32 safetensors;
    its config, generation config and tokenizer are saved into the stage first."""
    from flashnorm.export.sources import load_causal_lm, load_tokenizer

    model = load_causal_lm(source) if model is None else model
    model.config.architectures = [type(model).__name__]
    _refuse_folded(model.config.to_dict(), source)
    model.config.save_pretrained(stage)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(stage)
    load_tokenizer(source).save_pretrained(stage)
    return model.config, StateDictSource(model.state_dict())


def _check_names(sites: list[NormSite], tensors: TensorSource, architecture: str, quantization: Any = None) -> None:
    """Every tensor a fold reads exists, and no linear layer reads two norms. `quantization`: the
    config's quantization_config, which explains missing weights (GPTQ, AWQ store qweight)."""
    stored = {info.name for infos in tensors.shards.values() for info in infos}
    for site in sites:
        if not site.folded:
            continue
        needed = [site.weight] + [site.tied.get(lin, f"{lin}.weight") for lin in site.linears]
        missing = [name for name in needed if name not in stored]
        if missing and quantization:
            method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
            raise FlashNormError(f"{architecture}: the checkpoint has no tensor {missing[0]}: it is quantized "
                                 f"(quantization_config quant_method {method!r}); fold-checkpoint folds float "
                                 "checkpoints: fold before quantizing (--for-quantization)")
        if missing:
            raise FlashNormError(f"{architecture}: the checkpoint has no tensor {missing[0]} "
                                 f"(its names differ from transformers' module names)")
    readers: dict[str, str] = {}
    for site in sites:
        for lin in site.linears:
            if lin in readers:
                raise FlashNormError(f"{architecture}: {lin} reads both {readers[lin]} and {site.name}")
            readers[lin] = site.name


def _gains(sites: list[NormSite], tensors: TensorSource) -> dict[str, Any]:
    """Each foldable site's effective gain in float64; a site whose gain already is the
    identity is left alone with that reason."""
    import torch

    gains = {}
    for site in sites:
        if not site.folded:
            continue
        gain = tensors.read(site.weight).to(torch.float64)
        if site.convention == "1+w":
            gain = gain + 1.0
        if bool(torch.all(gain == 1.0)):
            site.reason, site.linears, site.tied = "its gain is already the identity (weightless)", [], {}
            continue
        gains[site.name] = gain
    return gains


def _refuse_quantized(sites: list[NormSite], tensors: TensorSource, source: Any) -> None:
    """One line where a weight a fold would scale is stored quantized (int8, fp8, packed 4-bit...:
    `flashnorm.match.quantized`'s answer): its scale lives in another tensor, and g·W rounded to
    the codes' type would be neither the fold nor the quantization. Asked only of weights not
    stored as a float type of 16 bits or more, so a float checkpoint folds where onnx-graphsurgeon
    (which match/ needs) is not installed (the GPU machine: benchmarks/checkpoint_decode.py)."""
    for site in sites:
        for lin in site.linears:
            name = site.tied.get(lin, f"{lin}.weight")
            dtype = tensors.info(name).dtype
            if dtype.is_floating_point and dtype.itemsize >= 2:
                continue
            from flashnorm.match.quantized import is_quantized_storage

            stored = str(dtype).removeprefix("torch.")
            if is_quantized_storage(stored):
                raise FlashNormError(f"{source.describe()}: {name} is stored as {stored} (a quantized checkpoint); "
                                     "fold-checkpoint folds float checkpoints: fold before quantizing "
                                     "(--for-quantization), or fold the quantized ONNX export (optimize --passes fold)")


def _select(sites: list[NormSite], tensors: TensorSource, gains: dict[str, Any], selection_rule: Rule) -> dict[str, float]:
    """Leave alone the sites `selection_rule` keeps, with its reason; returns every foldable
    site's estimate. nn.Linear stores [out, in]: the gain runs over axis 1."""
    import torch

    def weights(site: NormSite) -> list[tuple[Any, int]]:
        return [(tensors.read(site.tied.get(lin, f"{lin}.weight")).to(torch.float64).numpy(), 1)
                for lin in site.linears]

    candidates = [Candidate(site.name, gains[site.name].numpy(), functools.partial(weights, site))
                  for site in sites if site.name in gains]
    selection = selection_rule.select(candidates)
    for site in sites:
        reason = selection.kept.get(site.name)
        if reason:
            site.reason, site.linears, site.tied = reason, [], {}
            del gains[site.name]
    return selection.estimates


def _scaled_rows(rows: Any, gain: Any, buffers: BlockBuffers) -> tuple[Any, Any, Any]:
    """rows·diag(gain) in float64 (in `buffers`' "wide" slot), and each row's largest |x| before
    and after the scaling."""
    import torch

    wide = buffers.take("wide", torch.float64, tuple(rows.shape)).copy_(rows)
    before = _largest_magnitude(wide)
    wide.mul_(gain)
    return wide, before, _largest_magnitude(wide)


def _growth_summary(before: list[Any], after: list[Any]) -> dict[str, float]:
    """max / median / min over rows of (largest |x| after) / (largest |x| before); empty when
    no row has a finite ratio."""
    import torch

    ratio = torch.cat(after) / torch.cat(before)
    ratio = ratio[torch.isfinite(ratio)]
    if not ratio.numel():
        return {}
    return {"max": float(ratio.max()), "median": float(ratio.median()), "min": float(ratio.min())}


def _out_dtype(stored: Any, dtype: str) -> Any:
    import torch

    if dtype == "auto" or not stored.is_floating_point:
        return stored
    return getattr(torch, dtype)


def _plan(sites: list[NormSite], tensors: TensorSource, gains: dict[str, Any], dtype: str,
          growth: dict[str, dict[str, float]]) -> tuple[dict[str, list[Planned]], int]:
    """Every output shard's tensors, with how each is produced; returns them and the total bytes."""
    scale: dict[str, Any] = {}
    identity: dict[str, float] = {}
    untied: dict[str, tuple[str, Any]] = {}  # stored source name → (new name, gain)
    for site in sites:
        if not site.folded:
            continue
        identity[site.weight] = 0.0 if site.convention == "1+w" else 1.0
        for lin in site.linears:
            if lin in site.tied:
                untied[site.tied[lin]] = (f"{lin}.weight", gains[site.name])
            else:
                scale[f"{lin}.weight"] = gains[site.name]

    buffers = BlockBuffers()  # every block of the fold in the same two buffers (see shards.py)

    def copy(name: str, out: Any):
        def produce(start: int, stop: int):
            rows = tensors.rows(name, start, stop)
            return rows if rows.dtype == out else buffers.take("out", out, tuple(rows.shape)).copy_(rows)

        return produce

    def fill(shape: tuple[int, ...], value: float, out: Any):
        return lambda start, stop: buffers.take("out", out, (stop - start, *shape[1:])).fill_(value)

    def folded(name: str, stored_as: str, gain: Any, out: Any):
        before, after = [], []

        def produce(start: int, stop: int):
            wide, low, high = _scaled_rows(tensors.rows(name, start, stop), gain, buffers)
            before.append(low)
            after.append(high)
            if stop == tensors.info(name).shape[0]:
                growth[stored_as] = _growth_summary(before, after)
            return buffers.take("out", out, tuple(wide.shape)).copy_(wide)

        return produce

    shards: dict[str, list[Planned]] = {}
    total = 0
    for file, infos in tensors.shards.items():
        planned = []
        for info in infos:
            out = _out_dtype(info.dtype, dtype)
            if info.name in scale:
                if len(info.shape) != 2 or info.shape[1] != scale[info.name].numel():
                    raise FlashNormError(f"{info.name} has shape {list(info.shape)}, not [*, {scale[info.name].numel()}]")
                planned.append(Planned(info.name, out, info.shape, folded(info.name, info.name, scale[info.name], out)))
            elif info.name in identity:
                planned.append(Planned(info.name, out, info.shape, fill(info.shape, identity[info.name], out)))
            else:
                planned.append(Planned(info.name, out, info.shape, copy(info.name, out)))
            if info.name in untied:
                new_name, gain = untied[info.name]
                planned.append(Planned(new_name, out, info.shape, folded(info.name, new_name, gain, out)))
        shards[file] = planned
        total += sum(p.nbytes for p in planned)
    return shards, total


def _largest_magnitude(rows: Any):
    """max |x| per row, without the full-size temporary that rows.abs() would allocate."""
    return rows.amax(dim=-1).maximum(rows.amin(dim=-1).neg())


def _write(stage: Path, shards: dict[str, list[Planned]], total: int, *, indexed: bool) -> None:
    progress = ByteProgress("fold-checkpoint", total)
    weight_map = {}
    for file, planned in shards.items():
        write_shard(stage / file, planned, progress.step)
        weight_map.update({p.name: file for p in planned})
    progress.finish()
    if indexed or len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (stage / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def _copy_extras(directory: Path, stage: Path) -> None:
    """Every other top-level file (tokenizer, generation config, ...); other weight formats
    are not copied: they would hold the unfolded weights."""
    for path in sorted(directory.iterdir()):
        if path.is_file() and path.name not in ("config.json", INDEX_NAME) and not path.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(path, stage / path.name)


def _write_config(source: Path, destination: Path, folded: list[NormSite], untie: bool, dtype: str, *,
                  dequantized: bool = False) -> None:
    """config.json of the folded checkpoint: the source's, with the fold recorded. With
    `dequantized` (a GGUF source, written as plain float safetensors) its `quantization_config`
    is dropped: transformers records there the GGUF file it read (`quant_method: gguf`), and a
    loader that finds it treats the folded checkpoint as quantized (`model.is_quantized`,
    `.half()` refused) although no written weight is."""
    from flashnorm import __version__

    config = read_json(source, "config")
    if dequantized:
        config.pop("quantization_config", None)
    config[FOLD_KEY] = {
        "version": __version__,
        "weightless_norms": {s.name: s.convention for s in folded},
        "folded_into": {s.name: s.linears for s in folded},
        "untied": sorted(f"{lin}.weight" for s in folded for lin in s.tied),
    }
    if untie and any(s.tied for s in folded):
        config["tie_word_embeddings"] = False
        if isinstance(config.get("text_config"), dict):
            config["text_config"]["tie_word_embeddings"] = False
    if dtype != "auto":
        config["dtype"] = dtype
        config.pop("torch_dtype", None)
    destination.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _report(source: ModelSource, destination: Path, structure: Any, gains: dict[str, Any],
            growth: dict[str, dict[str, float]], untie: bool, dtype: str, shards: dict[str, list[Planned]],
            started: float) -> dict[str, Any]:
    sites = []
    for s in structure.sites:
        entry: dict[str, Any] = {"name": s.name, "convention": s.convention,
                                 "status": "folded" if s.folded else "left alone", "reason": s.reason,
                                 "consumers": s.consumers}
        if s.folded:
            entry["range_growth"] = {f"{lin}.weight": growth.get(f"{lin}.weight", {}) for lin in s.linears}
            medians = [g["median"] for g in entry["range_growth"].values() if g]
            if medians:
                entry["int8_error_estimate"] = int8_error_estimate(medians, gains[s.name])
        sites.append(entry)
    worst = max(((name, g["max"]) for name, g in growth.items() if g), key=lambda item: item[1], default=(None, 0.0))
    return {
        "source": source.describe(),
        "output": str(destination),
        "architecture": structure.architecture,
        "dtype": dtype,
        "untie": untie,
        "norm_sites": len(sites),
        "folded": sum(s["status"] == "folded" for s in sites),
        "left_alone": sum(s["status"] != "folded" for s in sites),
        "shards": len(shards),
        "tensors": sum(len(p) for p in shards.values()),
        "largest_range_growth": {"weight": worst[0], "factor": worst[1]},
        "seconds": round(time.monotonic() - started, 2),
        "sites": sites,
    }
