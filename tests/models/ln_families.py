"""Tiny random-weight models of the LayerNorm families FlashNorm targets, built in code (no
network), saved as Hugging Face folders and exported with `flashnorm export`'s own path.

Every family is L = 2 layers, hidden 32, with its norms' gains drawn from U(0.5, 1.5) with a
quarter of the signs flipped and their biases from N(0, 0.5), and every projection bias from
N(0, 0.1): a fold that drops the bias, mixes an axis up or forgets the centring shows up in the
outputs. Each `Family` says how many LayerNorms the graph has and how many fold (and so defer),
with the reasoning:

- A LayerNorm folds when every consumer of its output is a projection (MatMul/Gemm with a
  constant weight). The residual stream, another norm, a graph output or a tied head's
  weight (the embedding table) keep it.
- Pre-LN blocks have one norm in front of attention and one in front of the MLP (Falcon and
  Phi-2: one norm feeds both, in parallel), plus a final norm.
- Post-LN BERT: every norm's output is the next residual: nothing folds.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

import numpy as np

L = 2
HIDDEN = 32
HEADS = 4
VOCAB = 96
IMAGE, PATCH = 16, 4
MEL_BINS, SOURCE_POSITIONS = 8, 8
TOKENS = dict(bos_token_id=0, pad_token_id=1, eos_token_id=2)
"""Special tokens inside the tiny vocabulary (the configs' defaults are the real models')."""


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    build: Callable[[], Any]
    kind: str
    """'causal' (input_ids, attention_mask[, position_ids] → logits), 'vision', 'text' or 'speech'."""
    layer_norms: int
    folded: int
    pre_ln: bool = True
    tower: str | None = None


def _transformers():
    import transformers

    return transformers


def _gpt2():
    t = _transformers()
    return t.GPT2LMHeadModel(t.GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=L, n_head=HEADS, n_positions=64, **TOKENS))


def _opt():
    t = _transformers()
    return t.OPTForCausalLM(t.OPTConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=L,
                                        num_attention_heads=HEADS, ffn_dim=64, max_position_embeddings=64,
                                        word_embed_proj_dim=HIDDEN, do_layer_norm_before=True, **TOKENS))


def _bloom():
    t = _transformers()
    return t.BloomForCausalLM(t.BloomConfig(vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=L, n_head=HEADS, **TOKENS))


def _falcon():
    t = _transformers()
    return t.FalconForCausalLM(t.FalconConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=L,
                                              num_attention_heads=HEADS, parallel_attn=True,
                                              new_decoder_architecture=False, alibi=False, bias=True,
                                              **TOKENS))


def _phi():
    t = _transformers()
    return t.PhiForCausalLM(t.PhiConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64,
                                        num_hidden_layers=L, num_attention_heads=HEADS, max_position_embeddings=64,
                                        partial_rotary_factor=0.5, tie_word_embeddings=False, **TOKENS))


def _gpt_neox():
    t = _transformers()
    return t.GPTNeoXForCausalLM(t.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64,
                                                num_hidden_layers=L, num_attention_heads=HEADS,
                                                max_position_embeddings=64, rotary_pct=0.5,
                                                tie_word_embeddings=False, **TOKENS))


def _vit():
    t = _transformers()
    return t.ViTModel(t.ViTConfig(hidden_size=HIDDEN, num_hidden_layers=L, num_attention_heads=HEADS,
                                  intermediate_size=64, image_size=IMAGE, patch_size=PATCH))


def _clip_vision():
    t = _transformers()
    return t.CLIPVisionModelWithProjection(t.CLIPVisionConfig(
        hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=L, num_attention_heads=HEADS,
        image_size=IMAGE, patch_size=PATCH, projection_dim=16))


def _clip_text():
    t = _transformers()
    return t.CLIPTextModelWithProjection(t.CLIPTextConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=L,
        num_attention_heads=HEADS, max_position_embeddings=32, projection_dim=16, **TOKENS))


def _whisper():
    t = _transformers()
    return t.WhisperModel(t.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=MEL_BINS, d_model=HIDDEN, encoder_layers=L, encoder_attention_heads=HEADS,
        decoder_layers=1, decoder_attention_heads=HEADS, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_source_positions=SOURCE_POSITIONS, max_target_positions=16, decoder_start_token_id=0, **TOKENS))


def _bert():
    t = _transformers()
    return t.BertModel(t.BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=L,
                                    num_attention_heads=HEADS, intermediate_size=64, max_position_embeddings=64,
                                    pad_token_id=1))


FAMILIES = [
    # GPT-2: ln_1 → c_attn (fused q|k|v), ln_2 → c_fc per layer; ln_f → the tied LM head (the
    # embedding table): 2L+1 norms, 2L fold.
    Family("gpt2", _gpt2, "causal", 2 * L + 1, 2 * L),
    # OPT (pre-LN, do_layer_norm_before): self_attn_layer_norm → q, k, v; final_layer_norm → fc1;
    # the decoder's final norm → the tied head: 2L+1 norms, 2L fold.
    Family("opt", _opt, "causal", 2 * L + 1, 2 * L),
    # BLOOM: word_embeddings_layernorm feeds the residual stream (and the first block's norm);
    # input_layernorm → query_key_value, post_attention_layernorm → dense_h_to_4h; ln_f → the
    # tied head: 2L+2 norms, 2L fold. No position ids (ALiBi).
    Family("bloom", _bloom, "causal", 2 * L + 2, 2 * L),
    # Falcon (parallel attention and MLP): one input_layernorm per layer feeds query_key_value
    # AND dense_h_to_4h; ln_f → the tied head: L+1 norms, L fold.
    Family("falcon", _falcon, "causal", L + 1, L),
    # Phi-2: one input_layernorm feeds q, k, v and fc1 (parallel); final_layernorm → the untied
    # lm_head (with a bias): L+1 norms, all fold.
    Family("phi", _phi, "causal", L + 1, L + 1),
    # GPT-NeoX (Pythia): input_layernorm → query_key_value, post_attention_layernorm →
    # dense_h_to_4h (parallel residual); final_layer_norm → the untied embed_out: all 2L+1 fold.
    Family("gpt_neox", _gpt_neox, "causal", 2 * L + 1, 2 * L + 1),
    # ViT: layernorm_before → q, k, v; layernorm_after → intermediate; the final layernorm's
    # output is last_hidden_state (a graph output) and the pooler's input: 2L+1 norms, 2L fold.
    Family("vit", _vit, "vision", 2 * L + 1, 2 * L),
    # CLIP vision: pre_layrnorm feeds the residual stream; layer_norm1 → q, k, v; layer_norm2 →
    # fc1; post_layernorm (on the CLS token) → visual_projection only: 2L+2 norms, 2L+1 fold.
    Family("clip_vision", _clip_vision, "vision", 2 * L + 2, 2 * L + 1),
    # CLIP text: layer_norm1, layer_norm2 per layer; final_layer_norm's output is
    # last_hidden_state (a graph output; its EOS row goes to text_projection): 2L+1, 2L fold.
    Family("clip_text", _clip_text, "text", 2 * L + 1, 2 * L),
    # Whisper encoder: self_attn_layer_norm → q, k, v; final_layer_norm → fc1; the encoder's
    # layer_norm output is last_hidden_state (and its mean the pooled output): 2L+1, 2L fold.
    Family("whisper", _whisper, "speech", 2 * L + 1, 2 * L),
    # BERT (post-LN): the embeddings' LayerNorm and both norms of each layer produce the
    # residual stream (the last one is last_hidden_state): 2L+1 norms, none folds.
    Family("bert", _bert, "text", 2 * L + 1, 0, pre_ln=False),
]
FAMILY = {family.name: family for family in FAMILIES}


def randomize(model: Any, rng: np.random.Generator) -> None:
    """Every LayerNorm's gain → U(0.5, 1.5), a quarter negative; its bias → N(0, 0.5); every
    linear bias → N(0, 0.1) (GPT-2's Conv1D included)."""
    import torch

    with torch.no_grad():
        for module in model.modules():
            weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
            if isinstance(module, torch.nn.LayerNorm) or "LayerNorm" in type(module).__name__:
                size = weight.shape[0]
                gain = rng.uniform(0.5, 1.5, size) * np.where(rng.random(size) < 0.25, -1.0, 1.0)
                weight.copy_(torch.from_numpy(gain.astype(np.float32)))
                if bias is not None:
                    bias.copy_(torch.from_numpy(rng.normal(0.0, 0.5, size).astype(np.float32)))
            elif isinstance(bias, torch.nn.Parameter) and bias.ndim == 1:
                bias.copy_(torch.from_numpy(rng.normal(0.0, 0.1, bias.shape[0]).astype(np.float32)))


def build_folder(family: Family, directory: Path, seed: int) -> Path:
    """The family's random model, saved as a Hugging Face folder `directory`."""
    import torch

    torch.manual_seed(seed)
    model = family.build().eval()
    randomize(model, np.random.default_rng(seed))
    model.save_pretrained(directory)
    return directory


def export_folder(family: Family, folder: Path, output: Path, *, opset: int, dynamo: bool = False) -> dict[str, Any]:
    """`flashnorm export FOLDER -o OUTPUT --opset OPSET` (legacy or dynamo exporter), as the CLI runs it."""
    from flashnorm.export import export_source, resolve_source

    return export_source(resolve_source(folder), output, dynamo=dynamo, opset=opset, tower=family.tower)


def feeds(family: Family, rng: np.random.Generator, batch: int = 2) -> dict[str, np.ndarray]:
    """Inputs for one run of the family's graph: random pixels, features or token ids; text
    rows padded at the end of the second row."""
    if family.kind == "vision":
        return {"pixel_values": rng.standard_normal((batch, 3, IMAGE, IMAGE)).astype(np.float32)}
    if family.kind == "speech":
        return {"input_features": rng.standard_normal((batch, MEL_BINS, 2 * SOURCE_POSITIONS)).astype(np.float32)}
    sequence = 9
    ids = rng.integers(3, VOCAB, (batch, sequence)).astype(np.int64)
    mask = np.ones((batch, sequence), dtype=np.int64)
    if family.kind == "text":
        ids[:, -1] = 2  # CLIP's text pooling reads the EOS token's row
        mask[1, -3:] = 0
        return {"input_ids": ids, "attention_mask": mask}
    result = {"input_ids": ids, "attention_mask": mask}
    if family.name != "bloom":
        result["position_ids"] = np.broadcast_to(np.arange(sequence), (batch, sequence)).astype(np.int64).copy()
    return result
