"""Torch modules that give a Hugging Face causal LM the flat tensor signature an ONNX graph
needs: named tensors in, named tensors out, no Python objects (caches, ModelOutput)."""

from __future__ import annotations

import torch

# The attribute that holds the wrapped model; exported initializer names start with
# f"{WRAPPED}." and the exporter strips that prefix again.
WRAPPED = "wrapped"


def _positions(position_ids: torch.Tensor | None) -> dict[str, torch.Tensor]:
    # Models without position ids (BLOOM's ALiBi) are called without the keyword.
    return {} if position_ids is None else {"position_ids": position_ids}


class LogitsModel(torch.nn.Module):
    """`(input_ids, attention_mask, position_ids) → logits`, no cache; without `positions`,
    `(input_ids, attention_mask) → logits`."""

    def __init__(self, model: torch.nn.Module, positions: bool = True) -> None:
        super().__init__()
        setattr(self, WRAPPED, model)
        self.positions = positions

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        model = getattr(self, WRAPPED)
        return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                     **_positions(position_ids)).logits


class KVCacheModel(torch.nn.Module):
    """`(input_ids, attention_mask, position_ids, past key/value per layer) → (logits, present
    key/value per layer)`. `attention_mask` covers past and new tokens; each present tensor is
    the past one with the new tokens' keys or values appended on the sequence axis. The cache
    is a plain full-length DynamicCache per layer (verified on Llama-style models; sliding-
    window layers keep their whole history and rely on the mask)."""

    def __init__(self, model: torch.nn.Module, num_layers: int, positions: bool = True) -> None:
        super().__init__()
        setattr(self, WRAPPED, model)
        self.num_layers = num_layers
        self.positions = positions

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *rest: torch.Tensor) -> tuple[torch.Tensor, ...]:
        from transformers import DynamicCache

        position_ids, past = (rest[0], rest[1:]) if self.positions else (None, rest)
        model = getattr(self, WRAPPED)
        pairs = [(past[2 * i], past[2 * i + 1]) for i in range(self.num_layers)]
        cache = DynamicCache(ddp_cache_data=pairs)
        output = model(
            input_ids=input_ids, attention_mask=attention_mask, cache=cache, use_cache=True, **_positions(position_ids)
        )
        present: list[torch.Tensor] = []
        for layer in output.cache.layers:
            present.extend((layer.keys, layer.values))
        return (output.logits, *present)
