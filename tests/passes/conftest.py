"""Helpers shared by the pass tests: run passes on an in-memory model and compare the
result with the original in ONNX Runtime."""

from __future__ import annotations

import onnx
import onnx_graphsurgeon as gs
import pytest

from flashnorm.passes import run_passes
from flashnorm.progress import Progress
from synthetic import feeds, relative_error, run


@pytest.fixture(autouse=True)
def _quiet_progress(monkeypatch):
    monkeypatch.setattr(Progress, "enabled", False)


@pytest.fixture
def optimize():
    """optimize(model, passes, untie=False) → (optimized ModelProto, {pass name: PassReport})."""
    def apply(model: onnx.ModelProto, passes, *, untie: bool = False):
        graph, reports = run_passes(gs.import_onnx(model), passes, untie=untie)
        return gs.export_onnx(graph), {r.name: r for r in reports}
    return apply


@pytest.fixture
def max_error(rng):
    """The largest relative error over all graph outputs of two models on fresh random inputs."""
    def compare(reference: onnx.ModelProto, candidate: onnx.ModelProto) -> float:
        inputs = feeds(reference, rng)
        expected, actual = run(reference, inputs), run(candidate, inputs)
        assert len(expected) == len(actual)
        return max(relative_error(a, e) for a, e in zip(actual, expected))
    return compare


@pytest.fixture
def external_reads(monkeypatch):
    """[(tensor name, whether modelio.save was running)] for every external weight read."""
    from flashnorm import modelio

    reads: list[tuple[str, bool]] = []
    saving = [False]
    real_load, real_save = modelio.ExternalValues.load, modelio.save

    def load(self):
        reads.append((self.tensor.name, saving[0]))
        return real_load(self)

    def save(*args, **kwargs):
        saving[0] = True
        try:
            return real_save(*args, **kwargs)
        finally:
            saving[0] = False

    monkeypatch.setattr(modelio.ExternalValues, "load", load)
    monkeypatch.setattr(modelio, "save", save)
    return reads
