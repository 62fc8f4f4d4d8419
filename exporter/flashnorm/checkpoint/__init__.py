"""Folded Hugging Face checkpoints: every foldable RMSNorm's gain moved into the linear
weights that read it, stored as safetensors that stock transformers loads
(`flashnorm fold-checkpoint`). Needs torch, transformers and safetensors."""

from flashnorm.checkpoint.fold import DTYPES, FOLD_KEY, fold_checkpoint

__all__ = ["DTYPES", "FOLD_KEY", "fold_checkpoint"]
