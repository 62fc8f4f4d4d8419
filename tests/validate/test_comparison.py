"""compare_models: statistics against float64 references, pass/fail at the tolerances, and
outputs paired by exact name only (never by substring or position, as Polygraphy's default
pairing would)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import pytest

from flashnorm.errors import FlashNormError
from flashnorm.validate import compare_models, error_statistics, exact_name


def _linear_model(path, weights: dict[str, np.ndarray]) -> None:
    """x [b, 8] → one MatMul per named output, in the dict's order."""
    nodes = [oh.make_node("MatMul", ["x", f"w_{name}"], [name]) for name in weights]
    graph = oh.make_graph(
        nodes, "linear",
        [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["b", 8])],
        [oh.make_tensor_value_info(name, onnx.TensorProto.FLOAT, ["b", w.shape[1]]) for name, w in weights.items()],
        [onh.from_array(w.astype(np.float32), f"w_{name}") for name, w in weights.items()],
    )
    onnx.save(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)]), str(path))


def _feeds(rng, iterations=2):
    return [{"x": rng.standard_normal((3, 8)).astype(np.float32)} for _ in range(iterations)]


def test_statistics_match_float64(rng):
    reference = rng.standard_normal((4, 50))
    candidate = reference + rng.standard_normal((4, 50)) * 1e-3
    stats = error_statistics(candidate.astype(np.float32), reference.astype(np.float32))
    a, b = candidate.astype(np.float32).astype(np.float64), reference.astype(np.float32).astype(np.float64)
    assert stats["max_abs"] == pytest.approx(np.abs(a - b).max())
    assert stats["mean_abs"] == pytest.approx(np.abs(a - b).mean())
    assert stats["max_rel"] == pytest.approx((np.abs(a - b) / np.abs(b)).max())
    assert stats["rel_l2"] == pytest.approx(np.linalg.norm(a - b) / np.linalg.norm(b))
    assert stats["scaled_max_abs"] == pytest.approx(np.abs(a - b).max() / np.abs(b).max())
    assert stats["nonfinite"] == 0


def test_identical_models_pass_with_zero_error(tmp_path, rng):
    w = rng.standard_normal((8, 5))
    _linear_model(tmp_path / "a.onnx", {"y": w})
    _linear_model(tmp_path / "b.onnx", {"y": w})
    report = compare_models(tmp_path / "a.onnx", tmp_path / "b.onnx", _feeds(rng))
    assert report.passed and report.output("y").max_abs == 0.0 and report.output("y").shape == [3, 5]


@pytest.mark.parametrize("relative_change, passes", [(1e-7, True), (1e-3, False)])
def test_tolerances_decide(tmp_path, rng, relative_change, passes):
    w = rng.standard_normal((8, 5))
    _linear_model(tmp_path / "a.onnx", {"y": w})
    _linear_model(tmp_path / "b.onnx", {"y": w * (1 + relative_change)})
    feeds = _feeds(rng)
    report = compare_models(tmp_path / "a.onnx", tmp_path / "b.onnx", feeds, atol=1e-5, rtol=1e-5, max_rel_l2=1e-5)
    assert report.passed is passes
    expected = np.concatenate([(f["x"].astype(np.float64) @ w).ravel() for f in feeds])
    assert report.output("y").rel_l2 == pytest.approx(relative_change, rel=0.1, abs=2e-7)
    assert report.output("y").max_abs == pytest.approx(np.abs(expected).max() * relative_change, rel=0.1, abs=2e-6)


def test_rel_l2_limit_fails_even_within_elementwise_tolerance(tmp_path, rng):
    w = rng.standard_normal((8, 5))
    _linear_model(tmp_path / "a.onnx", {"y": w})
    _linear_model(tmp_path / "b.onnx", {"y": w * (1 + 1e-4)})
    report = compare_models(tmp_path / "a.onnx", tmp_path / "b.onnx", _feeds(rng), atol=1.0, rtol=1.0, max_rel_l2=1e-6)
    assert report.output("y").polygraphy_passed and not report.passed


def test_outputs_are_paired_by_name_not_position(tmp_path, rng):
    first, second = rng.standard_normal((8, 5)), rng.standard_normal((8, 5))
    _linear_model(tmp_path / "a.onnx", {"logits": first, "other": second})
    _linear_model(tmp_path / "b.onnx", {"other": second, "logits": first})  # swapped order
    report = compare_models(tmp_path / "a.onnx", tmp_path / "b.onnx", _feeds(rng))
    assert report.passed and all(o.max_abs == 0.0 for o in report.outputs)
    assert report.output("logits").top1_agreement == 1.0


def test_missing_output_fails_instead_of_fuzzy_pairing(tmp_path, rng):
    w = rng.standard_normal((8, 5))
    _linear_model(tmp_path / "a.onnx", {"logits": w})
    # Polygraphy's default pairing would match "logits" to "logits_scaled" by substring.
    _linear_model(tmp_path / "b.onnx", {"logits_scaled": w})
    report = compare_models(tmp_path / "a.onnx", tmp_path / "b.onnx", _feeds(rng))
    assert not report.passed and report.missing_outputs == ["logits"] and report.outputs == []


def test_exact_name_helper():
    assert exact_name("a", 0, {"a": 1, "ab": 2}) == ["a"]
    assert exact_name("a", 0, {"ab": 2}) is None


def test_different_inputs_are_refused(tmp_path, rng):
    _linear_model(tmp_path / "a.onnx", {"y": rng.standard_normal((8, 5))})
    graph = oh.make_graph(
        [oh.make_node("Identity", ["z"], ["y"])], "other",
        [oh.make_tensor_value_info("z", onnx.TensorProto.FLOAT, ["b", 5])],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["b", 5])],
    )
    onnx.save(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)]), str(tmp_path / "b.onnx"))
    with pytest.raises(FlashNormError, match="different inputs"):
        compare_models(tmp_path / "a.onnx", tmp_path / "b.onnx", _feeds(rng))


def test_nan_in_candidate_fails(tmp_path, rng):
    w = rng.standard_normal((8, 5))
    _linear_model(tmp_path / "a.onnx", {"y": w})
    poisoned = w.copy()
    poisoned[0, 0] = np.nan
    _linear_model(tmp_path / "b.onnx", {"y": poisoned})
    report = compare_models(tmp_path / "a.onnx", tmp_path / "b.onnx", _feeds(rng), atol=1e9, rtol=1e9, max_rel_l2=1e9)
    assert not report.passed and report.output("y").nonfinite > 0
