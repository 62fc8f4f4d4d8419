"""What torch.onnx writes for nn.LayerNorm → nn.Linear (the decomposed form at opset 14, with
the Casts of a half model; LayerNormalization at 18) is matched, folded and deferred."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest

from flashnorm.match import find_norm_sites
from flashnorm.passes import run_passes
from synthetic import relative_error, run

torch = pytest.importorskip("torch")


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.q, self.k = torch.nn.LayerNorm(16), torch.nn.Linear(16, 8), torch.nn.Linear(16, 4, bias=False)
        with torch.no_grad():
            self.norm.weight.uniform_(-2, 2)
            self.norm.bias.uniform_(-1, 1)

    def forward(self, x):
        y = self.norm(x)
        return self.q(y), self.k(y)


@pytest.mark.parametrize("opset, dtype", [(14, "float32"), (14, "float16"),
                                          pytest.param(18, "float32", marks=pytest.mark.slow)])  # dynamo: ~9 s
def test_torch_onnx_layernorm(opset, dtype, tmp_path, rng):
    import warnings

    torch.manual_seed(int(rng.integers(2**31)))
    block = _Block().to(getattr(torch, dtype))
    x = torch.randn(2, 3, 16, dtype=getattr(torch, dtype))
    path = tmp_path / "block.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(block, (x,), str(path), opset_version=opset, dynamo=opset >= 18, input_names=["x"],
                          dynamic_axes=None if opset >= 18 else {"x": {0: "batch", 1: "seq"}})
    model = onnx.load(str(path))
    (site,) = find_norm_sites(gs.import_onnx(model))
    assert site.kind == "layer" and site.spelling == ("LayerNormalization" if opset >= 18 else "decomposed")
    assert np.any(site.bias != 0) and len(site.consumers) == 2
    graph, reports = run_passes(gs.import_onnx(model), ["fold", "defer"])
    assert [r.count("folded" if r.name == "fold" else "deferred") for r in reports] == [1, 1]
    deferred = gs.export_onnx(graph)
    inputs = {"x": x.numpy()}
    bound = 1e-5 if dtype == "float32" else 3e-3
    for got, want in zip(run(deferred, inputs), run(model, inputs)):
        assert relative_error(got.astype(np.float64), want.astype(np.float64)) < bound
