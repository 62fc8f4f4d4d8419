"""Norm→projection sites of real models, shared by the kernel benchmark and its tests.

Each site is one FlashNorm call: x [M, K] → outputs [M, N_i], N = sum of the splits. RMSNorm sites
(decoders: decode and prefill rows) and LayerNorm sites (pre-LN encoders: M = batch × tokens, the
model's token count fixed), the latter timed in the library's LayerNorm mode with a bias.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Site:
    model: str
    name: str  # which projections share the norm
    k: int
    splits: tuple[int, ...]
    norm: str = "rms"  # "rms" (RMSNorm) or "layer" (LayerNorm: the variance statistic and a bias)
    rows: tuple[int, ...] = ()  # the M to time where the model fixes them (batch × tokens); else TOKEN_COUNTS

    @property
    def statistic(self) -> str:
        """The library's statistic for this site's norm."""
        return "variance" if self.norm == "layer" else "rms"

    @property
    def n(self) -> int:
        return sum(self.splits)

    @property
    def label(self) -> str:
        return f"{self.model} {self.name}"

    def describe(self) -> str:
        return f"K={self.k} → N={'+'.join(str(s) for s in self.splits)}={self.n}"


SITES: tuple[Site, ...] = (
    # SmolLM2-135M: hidden 576, 9 heads / 3 KV heads of 64, intermediate 1536.
    Site("SmolLM2-135M", "qkv", 576, (576, 192, 192)),
    Site("SmolLM2-135M", "gate/up", 576, (1536, 1536)),
    # Llama-3.2-1B: hidden 2048, 32 heads / 8 KV heads of 64, intermediate 8192.
    Site("Llama-3.2-1B", "qkv", 2048, (2048, 512, 512)),
    Site("Llama-3.2-1B", "gate/up", 2048, (8192, 8192)),
    # Llama-3.1-8B: hidden 4096, 32 heads / 8 KV heads of 128, intermediate 14336.
    Site("Llama-3.1-8B", "qkv", 4096, (4096, 1024, 1024)),
    Site("Llama-3.1-8B", "gate/up", 4096, (14336, 14336)),
)

# Pre-LN encoders' LayerNorm→projection sites; M = batch × tokens. ViT-B/16 (224², 196 patches + class
# token = 197 tokens; hidden 768, 12 heads, MLP 3072) at batch 1, 8, 64, and the Whisper-small encoder
# (1500 frames of 30 s audio; the same hidden 768 and MLP 3072, so the same site) at batch 1 and 10;
# CLIP ViT-L/14 (224², 256 patches + 1 = 257 tokens; hidden 1024, 16 heads, MLP 4096) at batch 1, 8, 63
# (16 191 rows: the largest batch within 16 384).
ENCODER_ROWS = (197, 1500, 1576, 12608, 15000)
LN_SITES: tuple[Site, ...] = (
    Site("ViT-B/16, Whisper-small enc.", "qkv", 768, (768, 768, 768), "layer", ENCODER_ROWS),
    Site("ViT-B/16, Whisper-small enc.", "fc1", 768, (3072,), "layer", ENCODER_ROWS),
    Site("CLIP ViT-L/14", "qkv", 1024, (1024, 1024, 1024), "layer", (257, 2056, 16191)),
    Site("CLIP ViT-L/14", "fc1", 1024, (4096,), "layer", (257, 2056, 16191)),
)

TOKEN_COUNTS: tuple[int, ...] = (1, 4, 16, 64, 256, 1024, 4096)
EPS = 1e-5
