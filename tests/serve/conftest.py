"""Fixtures for the Triton tests: a small random projection model and the PyTriton venv that
holds the real `tritonserver` (SmolLM2 exports come from the session fixtures in tests/conftest.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper


@pytest.fixture
def projection_model(tmp_path, rng) -> Callable[..., tuple[Path, np.ndarray]]:
    """Writes `x [batch, k] fp32, ids [batch] int64 → y = x·W [batch, n], ids_out` with a fresh
    random W (optionally as external data); returns (path, W)."""

    def write(k: int = 6, n: int = 5, external_data: bool = False, name: str = "projection.onnx"):
        weight = rng.standard_normal((k, n)).astype(np.float32)
        graph = helper.make_graph(
            [helper.make_node("MatMul", ["x", "W"], ["y"]), helper.make_node("Identity", ["ids"], ["ids_out"])],
            "projection",
            [
                helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", k]),
                helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch"]),
            ],
            [
                helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", n]),
                helper.make_tensor_value_info("ids_out", TensorProto.INT64, ["batch"]),
            ],
            [numpy_helper.from_array(weight, "W")],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        path = tmp_path / name
        if external_data:
            onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                      location=f"{name}.weights", size_threshold=0)
        else:
            onnx.save(model, str(path))
        return path, weight

    return write


@pytest.fixture(scope="session")
def pytriton_venv() -> Path:
    """The separate venv holding nvidia-pytriton==0.7.0 and onnxruntime (`.ci/pytriton-env.sh`).

    Unset: the serving tests are skipped with this reason. Set but broken: they fail."""
    value = os.environ.get("FLASHNORM_PYTRITON_VENV")
    if not value:
        pytest.skip("FLASHNORM_PYTRITON_VENV is not set (source .ci/pytriton-env.sh to create the server venv)")
    venv = Path(value)
    if not (venv / "bin" / "python").exists():
        pytest.fail(f"FLASHNORM_PYTRITON_VENV={venv} is not a virtual environment (no bin/python)")
    return venv
