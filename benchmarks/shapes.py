"""Norm→projection sites of real models, shared by the kernel benchmark and its tests.

Each site is one FlashNorm call: x [M, K] → outputs [M, N_i], N = sum of the splits.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Site:
    model: str
    name: str  # which projections share the norm
    k: int
    splits: tuple[int, ...]

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

TOKEN_COUNTS: tuple[int, ...] = (1, 4, 16, 64, 256, 1024, 4096)
EPS = 1e-5
