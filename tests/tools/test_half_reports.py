"""What `flashnorm inspect` and `flashnorm optimize` say about a half-precision fold: the gain
range, the largest |g·W|, and how much rounding g·W once to the weight type changes."""

from __future__ import annotations

import json

import onnx

from flashnorm import cli
from synthetic import build_half_norm_model


def test_inspect_and_optimize_report_the_half_fold(tmp_path, rng, capsys):
    model = tmp_path / "fp16.onnx"
    onnx.save(build_half_norm_model("pow_div", int(rng.integers(2**31)), "float16", hidden=64), model)
    assert cli.main(["inspect", str(model), "--report", str(tmp_path / "inspect.json")]) == 0
    (site,) = json.loads((tmp_path / "inspect.json").read_text())["sites"]
    gain, rounding = site["gain"], site["fold"]["rounding"]
    assert gain["dtype"] == "float16" and 0 < gain["abs_min"] <= gain["abs_max"]
    assert rounding["weight_dtype"] == "float16" and 0 < rounding["estimated_output_rel_l2"] < 2.0 ** -11
    assert "#0 fold in float16: |g| in [" in capsys.readouterr().out

    assert cli.main(["optimize", str(model), "-o", str(tmp_path / "out.onnx"), "--report", str(tmp_path / "o.json")]) == 0
    assert "1 sites rounded g·W to float16 once" in capsys.readouterr().out
    report = json.loads((tmp_path / "o.json").read_text())
    (decision,) = report["reports"][0]["sites"]
    assert decision["details"]["rounding"] == rounding  # the same plan as inspect's dry run
