"""benchmarks/layernorm_numerics.py on one draw per case: the rows docs/LAYERNORM.md quotes, and
what they show (the fold and the deferred node near the unfolded error in half, at |μ|/σ = 100
too: the rounded columns sum to zero, flashnorm.rounding)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import layernorm_numerics  # noqa: E402


def test_one_draw_per_case_and_the_table(rng, capsys):
    from flashnorm.progress import Progress

    Progress.enabled = False
    small = layernorm_numerics.measure("layer_normalization", "float16", 0.0, rng)
    large = layernorm_numerics.measure("layer_normalization", "float16", 100.0, rng)
    assert 1e-4 < small["unfolded"] < 1e-3 and small["folded"] < 1.3 * small["unfolded"]
    assert small["deferred"] < 1.3 * small["unfolded"] and large["deferred"] < 1.3 * large["unfolded"]
    layernorm_numerics.main(["--draws", "1", "--ratios", "1", "--dtypes", "float32"])
    rows = capsys.readouterr().out.splitlines()
    assert len(rows) == 2 + len(layernorm_numerics.SPELLINGS) and rows[2].startswith("| LayerNormalization | float32 | 1 |")
