"""Export Hugging Face / GGUF causal LMs (and small torch modules) to ONNX.

`resolve_source` finds a model on disk, `export_source` loads and exports it,
`export_causal_lm` exports an already loaded model, and `export_module` any torch module
with an explicit `ExportSpec`. torch and transformers are imported only when an export runs.
"""

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
from flashnorm.export.sources import KNOWN_MODELS, ModelSource, load_causal_lm, load_tokenizer, resolve_source

__all__ = [
    "DEFAULT_OPSET", "INPUT_NAMES", "KNOWN_MODELS", "LOGITS", "ExportSpec", "KVLayout", "ModelSource",
    "causal_lm_spec", "export_causal_lm", "export_module", "export_source", "load_causal_lm",
    "load_tokenizer", "past_names", "present_names", "resolve_source", "retie_lm_head", "save_model",
]
