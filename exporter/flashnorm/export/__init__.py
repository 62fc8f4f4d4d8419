"""Export Hugging Face / GGUF causal LMs (and small torch modules) to ONNX.

`resolve_source` finds a model on disk, `export_source` loads and exports it,
`export_causal_lm` exports an already loaded model, and `export_module` any torch module
with an explicit `ExportSpec`. torch and transformers are imported only when an export runs.

The exporter's names load `flashnorm.export.onnx_export` (onnx, onnx-graphsurgeon) when one of
them is first used, so that finding and loading a model (`flashnorm.export.sources`) needs only
torch and transformers (the GPU test machine has no onnx-graphsurgeon).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flashnorm.export.sources import KNOWN_MODELS, ModelSource, load_causal_lm, load_tokenizer, resolve_source

if TYPE_CHECKING:
    from flashnorm.export.onnx_export import (
        DEFAULT_OPSET,
        INPUT_NAMES,
        LOGITS,
        ExportSpec,
        KVLayout,
        causal_lm_spec,
        export_causal_lm,
        export_module,
        export_source,
        past_names,
        present_names,
        retie_lm_head,
        save_model,
    )

_EXPORTER_NAMES = (
    "DEFAULT_OPSET", "INPUT_NAMES", "LOGITS", "ExportSpec", "KVLayout", "causal_lm_spec", "export_causal_lm",
    "export_module", "export_source", "past_names", "present_names", "retie_lm_head", "save_model",
)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTER_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from flashnorm.export import onnx_export

    value = getattr(onnx_export, name)
    globals()[name] = value
    return value


__all__ = [
    "DEFAULT_OPSET", "INPUT_NAMES", "KNOWN_MODELS", "LOGITS", "ExportSpec", "KVLayout", "ModelSource",
    "causal_lm_spec", "export_causal_lm", "export_module", "export_source", "load_causal_lm",
    "load_tokenizer", "past_names", "present_names", "resolve_source", "retie_lm_head", "save_model",
]
