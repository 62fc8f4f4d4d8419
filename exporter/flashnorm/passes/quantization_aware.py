"""Folding a gain into a weight that will be quantized afterwards: predict, per site, whether
the fold raises the quantization error, and keep the gain where it does
(`flashnorm optimize --passes fold --for-quantization FORMAT`).

Folding is exact in float, but a quantizer that runs after it sees diag(g)·W instead of W.
With blocks along K (the channels g runs over), each block's scale follows its large-g rows
and its small-g rows lose precision; per output channel the same happens across all of K.
The prediction simulates the target format's round-to-nearest quantization on both weights
and compares their errors where they matter, at the projection's output for a normalized
input x̂ of even magnitude across channels:

    unfolded: ‖diag(g)·(Q(W) − W)‖_F      (the unfolded graph multiplies x̂ by g, then by Q(W))
    folded:   ‖Q(diag(g)·W) − diag(g)·W‖_F

Folding never lowers this error (each block's scale can only follow the larger g·W), so a
selection trades error for folded sites: `select_sites` folds the sites with the smallest
increase first, while the predicted squared error of all the norms' consumers stays within the
format's `share` of its unfolded value. Each share is calibrated on SmolLM2-135M with the real
quantizers, on the four shipped texts, judged by the budget's 95 % interval (docs/QUANTIZATION.md,
"The selection"): the measured growth of the extra NLL is several times the predicted growth of
squared error, since real inputs are not of even magnitude across channels (int4 blocks of 128:
1.5 % predicted left ONNX Runtime's MatMulNBits at 1.06–1.08×, inconclusive; 0.75 %, 9 sites,
holds it).
This predicts the quantizer's
*weight* error only: a quantizer that also scales activations (AWQ, SmoothQuant,
static int8/fp8 activation scales) sees other statistics, and the route is measured with the
real quantizer in docs/QUANTIZATION.md.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    """A weight quantizer's round-to-nearest: `bits`-bit symmetric integers, one scale per
    output channel and block of `block` channels along K (0: the whole of K)."""

    name: str
    bits: int
    block: int
    description: str
    share: float = 0.015
    """The largest predicted growth of the consumers' total squared quantization error that a
    selection may spend on folds (`select_sites`), calibrated per format."""

    @property
    def levels(self) -> int:
        """The largest integer magnitude: 7 for int4 (−8 unused, as symmetric RTN does), 127 for int8."""
        return 2 ** (self.bits - 1) - 1


FORMATS: dict[str, QuantFormat] = {
    "int4": QuantFormat("int4", 4, 128, "int4 weight-only, blocks of 128 along K (ModelOpt rtn_dq; ONNX Runtime's "
                                        "MatMulNBitsQuantizer RTN, symmetric or not, --block_size 128; "
                                        "onnxruntime-genai's builder with --int4_block_size 128). Not held, quantize "
                                        "unfolded: ModelOpt awq_clip, MatMulNBitsQuantizer HQQ", share=0.0075),
    "int4-b32": QuantFormat("int4-b32", 4, 32, "int4 weight-only, blocks of 32 along K (onnxruntime-genai's "
                                               "builder default; MatMulNBitsQuantizer RTN asymmetric, --block_size "
                                               "32). Not held, quantize unfolded: MatMulNBitsQuantizer RTN symmetric "
                                               "--block_size 32", share=0.015),
    "int8": QuantFormat("int8", 8, 0, "int8 weights, one scale per output channel (ModelOpt int8, TensorRT)"),
}


def quantize_rtn(weight_kn: np.ndarray, fmt: QuantFormat) -> np.ndarray:
    """Symmetric round-to-nearest of a [K, N] weight (K: input channels) in `fmt`, dequantized,
    float64: one scale per column and block of K."""
    w = np.asarray(weight_kn, dtype=np.float64)
    k, n = w.shape
    block = fmt.block or k
    pad = (-k) % block
    padded = np.concatenate([w, np.zeros((pad, n))]) if pad else w
    blocks = padded.reshape(-1, block, n)
    scale = np.abs(blocks).max(axis=1, keepdims=True) / fmt.levels
    scale[scale == 0] = 1.0
    q = np.clip(np.round(blocks / scale), -fmt.levels - 1, fmt.levels) * scale
    return q.reshape(-1, n)[:k]


@dataclasses.dataclass(frozen=True)
class QuantizedFoldError:
    unfolded: float
    """‖diag(g)·(Q(W) − W)‖_F"""
    folded: float
    """‖Q(diag(g)·W) − diag(g)·W‖_F"""

    @property
    def ratio(self) -> float:
        return self.folded / self.unfolded if self.unfolded > 0 else (1.0 if self.folded == 0 else float("inf"))


def fold_error(weight: np.ndarray, gain: np.ndarray, fmt: QuantFormat, *, gain_axis: int = 0) -> QuantizedFoldError:
    """The output-space quantization error of one consumer weight, unfolded and folded.
    `gain_axis` 0: `weight` is [K, N] (ONNX MatMul); 1: [N, K] (Gemm transB, nn.Linear)."""
    w = np.asarray(weight, dtype=np.float64)
    w = w if gain_axis == 0 else w.T
    g = np.asarray(gain, dtype=np.float64).reshape(-1, 1)
    unfolded = float(np.linalg.norm(g * (quantize_rtn(w, fmt) - w)))
    scaled = g * w
    folded = float(np.linalg.norm(quantize_rtn(scaled, fmt) - scaled))
    return QuantizedFoldError(unfolded, folded)


@dataclasses.dataclass(frozen=True)
class SiteError:
    """A site's consumers' squared output errors, summed: unfolded and folded."""

    name: str
    unfolded: float
    folded: float

    @property
    def ratio(self) -> float:
        """Folded over unfolded output error (the square root of the squared ratio)."""
        return float(np.sqrt(self.folded / self.unfolded)) if self.unfolded > 0 else 1.0


def site_error(name: str, weights: list[tuple[np.ndarray, int]], gain: np.ndarray, fmt: QuantFormat) -> SiteError:
    """`weights`: (values, gain_axis) of each consumer."""
    errors = [fold_error(values, gain, fmt, gain_axis=axis) for values, axis in weights]
    return SiteError(name, sum(e.unfolded ** 2 for e in errors), sum(e.folded ** 2 for e in errors))


def select_sites(errors: list[SiteError], fmt: QuantFormat, share: float | None = None) -> dict[str, str]:
    """The sites to leave unfolded, each with its reason: every site beyond the cheapest ones
    whose added squared error fits in `share` (default: the format's) of the total unfolded
    squared error."""
    share = fmt.share if share is None else share
    total = sum(e.unfolded for e in errors)
    spent, keep = 0.0, {}
    for e in sorted(errors, key=lambda e: e.ratio):
        added = e.folded - e.unfolded
        if spent + added <= share * total:
            spent += added
            continue
        keep[e.name] = (f"kept the gain for {fmt.name} quantization: folding raises its consumers' predicted "
                        f"error more than the {share:.1%} the selection spends (predicted_error_ratio)")
    return keep
