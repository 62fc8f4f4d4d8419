"""Which norm sites to fold before a later quantizer: the one selection behind `flashnorm optimize
--passes fold --for-quantization FORMAT` and `flashnorm fold-checkpoint --for-quantization FORMAT`
(and the deprecated `fold-checkpoint --int8-limit`). Each caller hands `Rule.select` its
foldable sites as `Candidate`s (a gain and a way to read the consumers' float weights); the rule
says which keep their gains, and why. Only numpy: the ONNX fold and the checkpoint fold both
import it, neither imports the other.

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

`--int8-limit RATIO` (fold-checkpoint only, deprecated) is a second, older estimate of the same
question for int8 per-channel weights (`int8_error_estimate`: the consumers' median row range
growth over the gain's RMS, kept where it exceeds RATIO); it is kept working for one release
through `Rule`, and `--for-quantization int8` replaces it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Optional, Sequence

import numpy as np

from flashnorm.errors import FlashNormError


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
    "int4": QuantFormat("int4", 4, 128, "int4 weight-only, blocks of 128 along K (ModelOpt rtn_dq and awq_clip; "
                                        "ONNX Runtime's MatMulNBitsQuantizer RTN, symmetric or not, --block_size 128; "
                                        "onnxruntime-genai's builder with --int4_block_size 128). Not held, quantize "
                                        "unfolded: MatMulNBitsQuantizer HQQ", share=0.0075),
    "int4-b32": QuantFormat("int4-b32", 4, 32, "int4 weight-only, blocks of 32 along K (onnxruntime-genai's "
                                               "builder default; MatMulNBitsQuantizer RTN asymmetric, --block_size "
                                               "32). Not held, quantize unfolded: MatMulNBitsQuantizer RTN symmetric "
                                               "--block_size 32", share=0.015),
    "int8": QuantFormat("int8", 8, 0, "int8 weights, one scale per output channel (ModelOpt int8, TensorRT; "
                                      "ONNX Runtime's quantize_dynamic and quantize_static, whose default is one "
                                      "scale per tensor, held too)"),
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


def int8_error_estimate(row_growth_medians: Sequence[float], gain: np.ndarray) -> float:
    """By how much folding `gain` raises int8 per-channel weight quantization error at one
    site, from the weights alone (the deprecated `--int8-limit`'s estimate). A consumer row's
    quantization step is its largest |w|, which the fold multiplies by that row's range growth;
    the error it causes scales with the step times the norm of the row's input, which the fold
    divides by about the gain's RMS (x∘g before, x after, for an x of even magnitude across
    channels). The median row of the worst consumer. On SmolLM2-135M it ranks the sites whose
    unfolding brings the measured int8 logits error back under 1.1× (docs/CHECKPOINTS.md)."""
    rms = float(np.sqrt(np.mean(np.square(np.asarray(gain, dtype=np.float64)))))
    return max(row_growth_medians) / rms if rms > 0 else float("inf")


def row_growth_median(weight: np.ndarray, gain: np.ndarray, gain_axis: int) -> Optional[float]:
    """The median over output channels of max|w·g| / max|w| (the lower median, as torch.median
    takes it), rows whose ratio is not finite left out; None when none is."""
    w = np.abs(np.asarray(weight, dtype=np.float64))
    g = np.abs(np.asarray(gain, dtype=np.float64)).reshape((-1, 1) if gain_axis == 0 else (1, -1))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = (w * g).max(axis=gain_axis) / w.max(axis=gain_axis)
    ratio = np.sort(ratio[np.isfinite(ratio)])
    return float(ratio[(ratio.size - 1) // 2]) if ratio.size else None


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A foldable site as the selection sees it."""

    name: str
    gain: np.ndarray
    """The effective gain, float64 [K]."""

    weights: Callable[[], list[tuple[np.ndarray, int]]]
    """Reads each consumer's float weight as a later quantizer would see it, unfolded, with the
    axis its gain runs over (0: [K, N] as ONNX MatMul stores it; 1: [N, K], nn.Linear)."""


@dataclasses.dataclass(frozen=True)
class Selection:
    kept: dict[str, str]
    """Sites that keep their gains, each with its reason."""

    estimates: dict[str, float]
    """Every candidate's estimate (rounded to 4 digits), under `Rule.estimate_name`."""


@dataclasses.dataclass(frozen=True)
class Rule:
    """Which sites to fold before a later quantizer: by `format`'s simulated round-to-nearest and
    the error share (`--for-quantization`), or by the deprecated int8 estimate's `int8_limit`."""

    format: Optional[QuantFormat] = None
    int8_limit: Optional[float] = None
    share: Optional[float] = None
    """The error share of the selection; None: the format's (`QuantFormat.share`)."""

    @property
    def estimate_name(self) -> str:
        """The report field each site's estimate goes in."""
        return "predicted_error_ratio" if self.format is not None else "int8_error_estimate"

    def select(self, candidates: Iterable[Candidate]) -> Selection:
        """Reads each candidate's weights once, in order (wrap `candidates` to show progress)."""
        if self.format is not None:
            errors = [site_error(c.name, c.weights(), c.gain, self.format) for c in candidates]
            return Selection(select_sites(errors, self.format, self.share), {e.name: round(e.ratio, 4) for e in errors})
        kept, estimates = {}, {}
        for c in candidates:
            medians = [row_growth_median(values, c.gain, axis) for values, axis in c.weights()]
            estimate = int8_error_estimate([1.0 if m is None else m for m in medians] or [1.0], c.gain)
            estimates[c.name] = round(estimate, 4)
            if estimate > self.int8_limit:
                kept[c.name] = (f"folding would raise its consumers' int8 error about {estimate:.2f}× "
                                f"(--int8-limit {self.int8_limit:g})")
        return Selection(kept, estimates)


def rule(for_quantization: Optional[str] = None, int8_limit: Optional[float] = None) -> Optional[Rule]:
    """The selection `--for-quantization FORMAT` (or the deprecated `--int8-limit RATIO`) asks for;
    None for neither. A bad value, or both at once, is one line (FlashNormError)."""
    if for_quantization is not None and int8_limit is not None:
        raise FlashNormError("--int8-limit and --for-quantization are two selections of the sites to fold; "
                             "give one (--for-quantization int8 replaces the deprecated --int8-limit)")
    if for_quantization is not None:
        if for_quantization not in FORMATS:
            raise FlashNormError(f"unknown quantization format {for_quantization!r}; choose from {', '.join(FORMATS)}")
        return Rule(format=FORMATS[for_quantization])
    if int8_limit is not None:
        if not int8_limit >= 1.0:
            raise FlashNormError(f"--int8-limit {int8_limit} is below 1 (the factor by which folding may raise int8 error)")
        return Rule(int8_limit=float(int8_limit))
    return None
