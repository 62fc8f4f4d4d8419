"""Structured test images for vision encoders: what a comparison of embeddings should see
instead of noise alone. Each image is deterministic (a seed draws only the 1/f texture's phases):

- `gradient`: colour ramps across and down the image;
- `checkerboard`: 8×8 tiles of two colours (sharp edges at every patch scale);
- `rings`: concentric sinusoidal rings (every orientation and a range of frequencies);
- `natural`: a 1/f amplitude spectrum with random phases, per channel, the power law of
  natural photographs (Field 1987), with correlated colour channels;
- `shapes`: a disc, a bar and a triangle on a ramp, flat regions with edges.

Pixels are in [0, 1], RGB, then normalized with the model's mean and standard deviation.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

KINDS = ("gradient", "checkerboard", "rings", "natural", "shapes")


def _image(kind: str, size: int, rng: np.random.Generator) -> np.ndarray:
    """One [3, size, size] image in [0, 1]."""
    y, x = np.mgrid[0:size, 0:size] / max(size - 1, 1)
    if kind == "gradient":
        return np.stack([x, y, 1.0 - 0.5 * (x + y)])
    if kind == "checkerboard":
        tiles = ((x * 8).astype(int) + (y * 8).astype(int)) % 2
        return np.stack([0.9 * tiles + 0.05, 0.2 + 0.6 * (1 - tiles), 0.5 * np.ones_like(x)])
    if kind == "rings":
        radius = np.hypot(x - 0.5, y - 0.5)
        return np.stack([0.5 + 0.5 * np.sin(2 * np.pi * f * radius ** 1.5) for f in (6.0, 11.0, 17.0)])
    if kind == "natural":
        frequency = np.hypot(*np.meshgrid(np.fft.fftfreq(size), np.fft.fftfreq(size), indexing="ij"))
        frequency[0, 0] = 1.0
        shared = rng.uniform(0, 2 * np.pi, (size, size))
        channels = []
        for _ in range(3):
            phase = shared + 0.5 * rng.uniform(0, 2 * np.pi, (size, size))  # correlated colours
            field = np.real(np.fft.ifft2(np.exp(1j * phase) / frequency))
            channels.append((field - field.min()) / (np.ptp(field) or 1.0))
        return np.stack(channels)
    if kind == "shapes":
        image = np.stack([0.3 + 0.4 * x, 0.3 + 0.4 * y, 0.6 * np.ones_like(x)])
        disc = np.hypot(x - 0.3, y - 0.35) < 0.18
        bar = (np.abs(x - 0.7) < 0.06) & (y > 0.15) & (y < 0.85)
        triangle = (y > 0.6) & (y < 0.95) & (np.abs(x - 0.35) < (y - 0.6))
        for mask, colour in ((disc, (0.95, 0.2, 0.1)), (bar, (0.1, 0.8, 0.2)), (triangle, (0.15, 0.2, 0.9))):
            for channel in range(3):
                image[channel][mask] = colour[channel]
        return image
    raise ValueError(f"unknown image kind {kind!r}; choose from {', '.join(KINDS)}")


def structured_images(size: int, kinds: Sequence[str] = KINDS, *, mean: Sequence[float] = (0.5, 0.5, 0.5),
                      std: Sequence[float] = (0.5, 0.5, 0.5), seed: int = 0) -> np.ndarray:
    """A float32 batch [len(kinds), 3, size, size] of the named images, normalized as
    (pixel − mean) / std per channel."""
    rng = np.random.default_rng(seed)
    batch = np.stack([_image(kind, size, rng) for kind in kinds])
    normalized = (batch - np.asarray(mean)[:, None, None]) / np.asarray(std)[:, None, None]
    return normalized.astype(np.float32)
