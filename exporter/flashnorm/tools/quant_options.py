"""--quant-limit, the one option of quantized folds, defined once for `optimize` and `inspect`
(self-contained, to move into the shared option groups as it is)."""

from __future__ import annotations

import argparse
import math
from typing import Optional

from flashnorm.errors import FlashNormError


def add_quant_limit_option(parser: argparse.ArgumentParser) -> None:
    """--quant-limit RATIO: the largest requantization error a folded quantized site may have."""
    from flashnorm.passes.quantized import DEFAULT_QUANT_LIMIT

    parser.add_argument(
        "--quant-limit", metavar="RATIO", default=None,
        help="quantized weights: fold a site that must be requantized only if the error it adds is at most RATIO "
             "times the format's own quantization noise (finite, >= 0; default "
             f"{DEFAULT_QUANT_LIMIT:g}: at most 1.06x the noise power; 0 takes exact folds only). Every site's "
             "measured error is in the report")


def quant_limit(args: argparse.Namespace) -> Optional[float]:
    """The validated --quant-limit (None: the default); FlashNormError (one line, exit 2) otherwise."""
    text = getattr(args, "quant_limit", None)
    if text is None:
        return None
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise FlashNormError(f"--quant-limit {text!r} is not a number (a finite ratio >= 0)") from None
    if not math.isfinite(value) or value < 0:
        raise FlashNormError(f"--quant-limit {text} must be finite and >= 0")
    return value
