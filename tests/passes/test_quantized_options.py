"""`optimize`'s options on quantized inputs: what each combination does, or the one line that
says why not (exit 2)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from flashnorm import cli
from test_fold_quantized import _float_model, ort_nbits


def test_for_quantization_on_a_quantized_file_is_one_line(tmp_path, capsys):
    model, _ = _float_model(np.random.default_rng(0), widths=(40, 24))
    path = tmp_path / "q.onnx"
    onnx.save(ort_nbits(model, 4, 32, False), str(path))
    code = cli.main(["optimize", str(path), "-o", str(tmp_path / "out.onnx"), "--passes", "fold",
                     "--for-quantization", "int8", "--quant-limit", "100"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
