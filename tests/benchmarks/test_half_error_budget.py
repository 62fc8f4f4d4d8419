"""benchmarks/half_error_budget.py on one small draw: a row per backend with the fields
docs/HALF_PRECISION.md reads, and the weights-only backend really computes in fp32 (an fp16
model run that way is as accurate as its weights allow, closer to fp32 than the emulation)."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import half_error_budget  # noqa: E402

pytest.importorskip("torch")


def test_one_draw_reports_every_backend(rng):
    from flashnorm.progress import Progress
    from test_hf_architectures import CASES

    Progress.enabled = False
    case = next(c for c in CASES if c.name == "llama")
    rows = half_error_budget.measure_draw(case, "fp16", 8, rng)
    assert [row["backend"] for row in rows] == ["emulated", "onnxruntime", "weights_only"]
    errors = {row["backend"]: row["unfolded_rel_l2"] for row in rows}
    # fp16 rounding only: well under 1 %, and each backend skips roundings the previous one keeps.
    assert 0 < errors["weights_only"] < errors["onnxruntime"] < errors["emulated"] < 1e-2, errors
    for row in rows:
        assert row["positions"] == 8 * half_error_budget.SEQUENCE
        for name in ("folded", "deferred"):
            assert 0.5 < row[name]["rel_l2_ratio"] < 2, row
            assert row[name]["rel_l2"] == pytest.approx(row[name]["rel_l2_ratio"] * row["unfolded_rel_l2"], rel=1e-2)
            assert 0 <= row[name]["argmax_differs_percent"] <= 100
            assert np.isfinite(row[name]["top1_change_points"])
