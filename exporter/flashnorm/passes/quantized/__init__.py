"""Folding a gain into quantized weights, format by format, node types unchanged.

Which consumers are quantized, how, and where their codes, scales and zero points are is
`flashnorm.match.quantized`'s answer; its table's `edit` column names the module here that folds
each. Each module plans one format (mutates nothing; reads the quantized weight once to measure
the error, raises `NotQuantFoldable` with a one-line reason) and returns a `QuantEdit` (a
`passes.edit.WeightEdit`) whose `apply` rewrites the consumer's inputs with lazily computed
constants:

- `prescale`: a per-input-channel constant Mul in front of the projection (ModelOpt int4_awq's
  pre_quant_scale, SmoothQuant scales): s' = s·g, exact; whatever follows it is untouched.
- `dequantize_linear`: a MatMul/Gemm weight written by DequantizeLinear (int4, uint4, int8,
  uint8, float8e4m3fn; per-tensor, per-axis, blocked; [K, N], or [N, K] behind Transpose or
  Gemm transB=1, Cast and Identity between). Exact where every quantization group lies in one input channel (scale per
  K, blocks along N, block_size 1 along K): the scales take g. Otherwise requantized.
  A float initializer behind QuantizeLinear → DequantizeLinear (fake quantization, as ModelOpt
  writes it) takes the gain itself, and the QuantizeLinear scale is recomputed as the producer
  computes it (amax per group).
- `matmulnbits`: com.microsoft::MatMulNBits, requantized per block.

`requantize` holds the per-group clipping search and the error metric (`QuantError`); a
requantized site whose `noise_ratio` exceeds the fold's `quant_limit` keeps its gain. A
quantized consumer no module folds is refused with the recogniser's reason.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import onnx_graphsurgeon as gs

from flashnorm.match.quantized import quantized_use
from flashnorm.passes.quantized.edit import NotQuantFoldable, QuantEdit
from flashnorm.passes.quantized.requantize import QuantError

DEFAULT_QUANT_LIMIT = 0.25
"""The largest `noise_ratio` a requantized site may reach and still be folded (`--quant-limit`).

Re-rounding a quantized weight onto a new grid adds about one rounding noise of that grid, so
blocks along K with trained gains measure 0.4–2 (SmolLM2-135M, ModelOpt int4 rtn_dq, block
128 along K: median 0.82 over 60 sites). Measured on that file (NLL on 2,045 tokens of real text,
ONNX Runtime CPU basic, 2026-12-05, commit 9c5dba3; fp32 2.940, int4 3.561): limit 1.0 folds
55 sites, NLL 4.179 (the fold doubles int4's excess); 0.5 folds 6 requantized sites (late MLP
inputs, ratios 0.43–0.50), NLL 3.635 (+0.073, 12% of int4's excess, several times what
1 + r² predicts for 6 of 60 sites); 0.25 takes none of them, NLL 3.561. 0.25 (noise power at most
1.06× per site) stays below where harm was seen: by default requantized folds are taken only
where the gains within each group are nearly equal, exact folds always. A larger limit is a
choice to make with a measured budget (the report gives every site's ratio)."""


def plan_quantized(node: gs.Node, activation: gs.Tensor, gain: np.ndarray) -> Optional[QuantEdit]:
    """The QuantEdit folding `gain` into consumer `node` when it computes with quantized values
    (`flashnorm.match.quantized.quantized_use`) or is a constant per-channel Mul (exact whatever
    follows it); None when it is a plain float consumer; NotQuantFoldable with the reason (the
    recogniser's, or the format module's) when it is quantized and cannot be folded."""
    from flashnorm.passes.quantized import dequantize_linear, matmulnbits, prescale

    gain = np.asarray(gain, dtype=np.float64).reshape(-1)
    use = quantized_use(node, activation)
    where = f"consumer {node.op} {node.name!r}"
    if use is None:
        return prescale.plan(node, activation, gain, where) if node.op == "Mul" else None
    if use.edit == "prescale":
        edit = prescale.plan(node, activation, gain, where)
        if edit is None:
            raise NotQuantFoldable(use.fold_reason())
        return edit
    planners = {"matmulnbits": matmulnbits.plan, "dequantize_linear": dequantize_linear.plan}
    if use.edit not in planners:
        raise NotQuantFoldable(use.fold_reason())
    return planners[use.edit](use, activation, gain)


def site_quant_error(edits: list) -> dict | None:
    """A site's quantized weights: whether all were folded exactly, the largest error of any
    of them (`rel_error`, `noise_ratio`: what the quant limit is compared with) and each
    weight's details."""
    quantized = [e for e in edits if isinstance(e, QuantEdit)]
    if not quantized:
        return None
    return {"exact": all(e.exact for e in quantized),
            "rel_error": max(e.error.rel_error for e in quantized),
            "noise_ratio": max(e.error.noise_ratio for e in quantized),
            "weights": [e.details() for e in quantized]}


__all__ = ["DEFAULT_QUANT_LIMIT", "NotQuantFoldable", "QuantEdit", "QuantError", "plan_quantized", "site_quant_error"]
