"""Encoders (vision, text, speech) → ONNX: the last hidden state and a pooled output per input.

Which Hugging Face folders export as encoders, and with what signature, is one table
(`ENCODERS`, keyed by config.json's `model_type`). Every graph has a dynamic batch; text
encoders also a dynamic sequence. Inputs, by kind:

- vision: `pixel_values` [batch, channels, image_size, image_size] float (the config's size);
- text: `input_ids` and `attention_mask` [batch, sequence] int64;
- speech (the Whisper encoder): `input_features` [batch, mel bins, 2·max_source_positions]
  float (the length Whisper's encoder insists on).

Outputs: `last_hidden_state` [batch, tokens, hidden] and one pooled tensor [batch, width],
named as transformers names it: `pooler_output` (ViT's pooler where the checkpoint has its
weights, else the final-norm CLS token; DINOv2's and BERT's own; the Whisper encoder's is the
mean over frames, which transformers does not define) or the projected embedding of a CLIP
tower (`image_embeds`, `text_embeds`). The pooled output's name is recorded in the ONNX
metadata (`flashnorm.pooled_output`).

Pre-LN encoders (ViT, DINOv2, CLIP, Whisper) have a LayerNorm in front of every projection;
BERT, post-LN, is here as the counter-example: its norms' outputs are also the residual, so
nothing folds (docs/LAYERNORM.md).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping

from flashnorm.errors import FlashNormError

VISION, TEXT, SPEECH = "vision", "text", "speech"
LAST_HIDDEN_STATE = "last_hidden_state"
TOWERS = ("vision", "text")
"""The towers of a two-tower (CLIP) folder that `--tower` picks from."""
# Example sizes for tracing, distinct from every fixed axis.
_EXAMPLE_BATCH, _EXAMPLE_SEQUENCE = 2, 7


@dataclasses.dataclass(frozen=True)
class Encoder:
    """How one model type exports: its input kind, the transformers class that loads the
    folder (by name, so transformers is imported only when an export runs), the pooled
    output's name and how it is computed from the model's output."""

    family: str
    kind: str
    model_class: str
    pooled: str
    pre_ln: bool = True


ENCODERS: dict[str, Encoder] = {
    "vit": Encoder("ViT", VISION, "ViTModel", "pooler_output"),
    "dinov2": Encoder("DINOv2", VISION, "Dinov2Model", "pooler_output"),
    "clip_vision_model": Encoder("CLIP vision", VISION, "CLIPVisionModelWithProjection", "image_embeds"),
    "clip_text_model": Encoder("CLIP text", TEXT, "CLIPTextModelWithProjection", "text_embeds"),
    "whisper": Encoder("Whisper encoder", SPEECH, "WhisperModel", "pooler_output"),
    "bert": Encoder("BERT", TEXT, "BertModel", "pooler_output", pre_ln=False),
}
"""Encoder model types (config.json `model_type`) → how they export. A CLIP folder
(`model_type` "clip") exports one tower, `clip_vision_model` or `clip_text_model`."""


def encoder_for(config: Mapping[str, Any], tower: str | None = None) -> Encoder | None:
    """The entry of `ENCODERS` for a config.json's contents, None for anything else (a causal
    LM, or an unsupported type). A two-tower CLIP folder needs `tower` ('vision' or 'text')."""
    model_type = config.get("model_type")
    if model_type == "clip":
        if tower not in TOWERS:
            raise FlashNormError(f"a CLIP folder holds two towers: pass --tower {' or --tower '.join(TOWERS)}")
        return ENCODERS[f"clip_{tower}_model"]
    if tower is not None:
        raise FlashNormError(f"--tower applies to two-tower (CLIP) folders, not model_type {model_type!r}")
    return ENCODERS.get(model_type)


def supported_families() -> str:
    """The encoders `flashnorm export` takes, for a refusal's one line."""
    return ", ".join(dict.fromkeys(e.family for e in ENCODERS.values()))


def load_encoder(directory: Path, encoder: Encoder, dtype: str = "float32"):
    """The folder's encoder in eval mode on CPU; ViT and BERT without their pooler when the
    checkpoint has no pooler weights (a classification checkpoint), so that no random weights
    are used."""
    import torch
    import transformers
    from transformers.utils import logging as transformers_logging

    cls = getattr(transformers, encoder.model_class)
    kwargs: dict[str, Any] = {"dtype": getattr(torch, dtype), "local_files_only": True}
    verbosity = transformers_logging.get_verbosity()
    try:
        if encoder.model_class.startswith("CLIP"):
            kwargs["config"] = _clip_tower_config(directory, encoder)
            # A two-tower folder holds the other tower's weights too: transformers' report of
            # them as unexpected keys says nothing the user needs.
            transformers_logging.set_verbosity_error()
        model, info = cls.from_pretrained(str(directory), output_loading_info=True, **kwargs)
        if encoder.model_class in ("ViTModel", "BertModel") and any(k.startswith("pooler.") for k in info["missing_keys"]):
            model = cls.from_pretrained(str(directory), add_pooling_layer=False, **kwargs)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise FlashNormError(f"cannot load {directory} as a {encoder.family} model: {first}") from None
    finally:
        transformers_logging.set_verbosity(verbosity)
    return model.eval()


def _clip_tower_config(directory: Path, encoder: Encoder):
    """A CLIP tower's config. From a two-tower folder: the tower's own config with the folder's
    `projection_dim` (kept at the top level, so the tower alone would get a default-sized
    projection and refuse the checkpoint's weights)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    if config.model_type != "clip":
        return config
    tower = config.vision_config if encoder.kind == VISION else config.text_config
    tower.projection_dim = config.projection_dim
    return tower


def encoder_module(model: Any, encoder: Encoder):
    """The torch module that maps the graph's inputs to (last_hidden_state, pooled)."""
    import torch

    from flashnorm.export.wrappers import WRAPPED

    class EncoderOutputs(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            setattr(self, WRAPPED, model.get_encoder() if encoder.model_class == "WhisperModel" else model)

        def forward(self, first: torch.Tensor, attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
            # `first`: pixel_values, input_ids or input_features, by kind (named positional
            # parameters: torch.export matches dynamic shapes to the signature).
            wrapped = getattr(self, WRAPPED)
            if encoder.kind == VISION:
                output = wrapped(pixel_values=first)
            elif encoder.kind == TEXT:
                output = wrapped(input_ids=first, attention_mask=attention_mask)
            else:
                output = wrapped(input_features=first)
            hidden = output.last_hidden_state
            if encoder.kind == SPEECH:
                return hidden, hidden.mean(dim=1)
            pooled = getattr(output, encoder.pooled, None)
            return hidden, hidden[:, 0] if pooled is None else pooled

    return EncoderOutputs().eval()


def encoder_signature(model: Any, encoder: Encoder, dtype: str = "float32") -> tuple[list[str], list[str], tuple, dict]:
    """Input names, output names, example inputs and dynamic axes of an encoder export (floats
    in `dtype`), for `flashnorm.export.onnx_export.ExportSpec`."""
    import torch

    generator = torch.Generator().manual_seed(0)
    config = model.config
    batch = _EXAMPLE_BATCH
    outputs = [LAST_HIDDEN_STATE, encoder.pooled]
    axes: dict[str, dict[int, str]] = {LAST_HIDDEN_STATE: {0: "batch"}, encoder.pooled: {0: "batch"}}
    if encoder.kind == VISION:
        size, channels = int(config.image_size), int(getattr(config, "num_channels", 3))
        pixels = torch.randn(batch, channels, size, size, generator=generator).to(getattr(torch, dtype))
        return ["pixel_values"], outputs, (pixels,), {"pixel_values": {0: "batch"}, **axes}
    if encoder.kind == TEXT:
        vocabulary = int(config.vocab_size)
        ids = torch.randint(0, vocabulary, (batch, _EXAMPLE_SEQUENCE), generator=generator)
        mask = torch.ones(batch, _EXAMPLE_SEQUENCE, dtype=torch.int64)
        mask[1, -2:] = 0  # a padded row, so that the mask is traced as data
        axes[LAST_HIDDEN_STATE][1] = "sequence"
        text_axes = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"}}
        return ["input_ids", "attention_mask"], outputs, (ids, mask), {**text_axes, **axes}
    frames = 2 * int(config.max_source_positions)
    features = torch.randn(batch, int(config.num_mel_bins), frames, generator=generator).to(getattr(torch, dtype))
    return ["input_features"], outputs, (features,), {"input_features": {0: "batch"}, **axes}
