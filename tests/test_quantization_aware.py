"""`fold --for-quantization`: the simulated round-to-nearest, the error it predicts for a folded
and an unfolded weight, the selection's arithmetic, and the pass on synthetic graphs (a gain of
even magnitude folds, a gain spread sixfold inside a block keeps its gain)."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto, helper

from flashnorm.errors import FlashNormError
from flashnorm.passes import run_passes
from flashnorm.quantization_aware import FORMATS, SiteError, fold_error, quantize_rtn, select_sites
from synthetic import GraphBuilder, pow_div, run

INT4 = FORMATS["int4"]


def test_rtn_is_on_the_grid_of_each_block(rng):
    w = rng.standard_normal((200, 6))  # 200 = one block of 128 and a padded one of 72
    q = quantize_rtn(w, INT4)
    for block in (slice(0, 128), slice(128, 200)):
        step = np.abs(w[block]).max(axis=0) / 7
        assert np.allclose(q[block] / step, np.round(q[block] / step))
        assert np.all(np.abs(q[block] - w[block]) <= step / 2 + 1e-12)
        assert np.all(np.abs(q[block] / step) <= 7 + 1e-9)
    per_channel = quantize_rtn(w, FORMATS["int8"])
    assert np.all(np.abs(per_channel - w) <= np.abs(w).max(axis=0) / 127 / 2 + 1e-12)


def test_a_gain_of_even_magnitude_costs_nothing(rng):
    w = rng.standard_normal((256, 8))
    gain = 1.7 * np.where(rng.random(256) < 0.3, -1, 1)
    error = fold_error(w, gain, INT4)
    assert error.ratio == pytest.approx(1.0, rel=1e-9)
    # A gain constant inside each block scales that block's step with it: nothing lost either.
    per_block = np.repeat([0.05, 3.0], 128)
    assert fold_error(w, per_block, INT4).ratio == pytest.approx(1.0, rel=1e-9)
    # ... but per output channel (int8: one block of all of K) it costs: about √2, half the rows lose
    # their step. The ratio is a mean over W's columns: over 8 it ranged 1.10-1.45 in 200 draws
    # (1.19 at seed 1656904017), over 64 1.27-1.38.
    wide = rng.standard_normal((256, 64))
    assert fold_error(wide, per_block, FORMATS["int8"]).ratio > 1.2


def test_a_gain_spread_inside_a_block_raises_the_error(rng):
    # 256 columns: the ratio is a mean over W's columns; with 16 it ranged 1.09-1.35 over 300
    # draws and crossed the bound now and then (1.18 at seed 1433554533); with 256, 1.24-1.30.
    w = rng.standard_normal((128, 256))
    gain = np.where(np.arange(128) % 2 == 0, 3.0, 0.5)
    error = fold_error(w, gain, INT4)
    assert error.ratio > 1.2  # the 0.5 rows round with the 3.0 rows' step
    # [N, K] storage (gain_axis 1) gives the same numbers.
    transposed = fold_error(w.T.copy(), gain, INT4, gain_axis=1)
    assert transposed.unfolded == pytest.approx(error.unfolded) and transposed.folded == pytest.approx(error.folded)


def test_selection_spends_its_share_on_the_cheapest_sites():
    errors = [SiteError("cheap", 10.0, 10.2), SiteError("mid", 10.0, 10.4), SiteError("dear", 10.0, 20.0)]
    # Total unfolded 30; 5 % is 1.5: cheap (+0.2) and mid (+0.4) fit, dear (+10) does not.
    assert set(select_sites(errors, INT4, share=0.05)) == {"dear"}
    assert set(select_sites(errors, INT4, share=0.01)) == {"mid", "dear"}  # 0.3: cheap only
    assert select_sites(errors, INT4, share=1.0) == {}
    assert errors[0].ratio == pytest.approx(np.sqrt(1.02))


def _one_site(gain: np.ndarray, rng) -> gs.Graph:
    b = GraphBuilder()
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", gain.size])
    y = pow_div(b, "x", gain.astype(np.float32), 1e-5)
    # 256 output columns: the predicted ratio is a mean over W's columns, and with 24 it spread
    # enough (int4-b32 on the spread gain: 1.14-1.31 over 300 draws) to cross the test's bound.
    out = b.op("MatMul", [y, b.const(rng.standard_normal((gain.size, 256)).astype(np.float32), "w")])
    return gs.import_onnx(b.model([x], [out]))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_the_pass_folds_an_even_gain_and_keeps_a_spread_one(fmt, rng):
    even = _one_site(1.3 * np.where(rng.random(128) < 0.25, -1.0, 1.0), rng)
    graph, (report,) = run_passes(even, ["fold"], for_quantization=fmt)
    (site,) = report.decisions
    assert site.action == "folded" and site.details["predicted_error_ratio"] == pytest.approx(1.0, abs=1e-6)

    spread = _one_site(np.where(np.arange(128) % 2 == 0, 3.0, 0.5), rng)
    model = gs.export_onnx(spread.copy())
    x = {"x": rng.standard_normal((2, 3, 128)).astype(np.float32)}
    graph, (report,) = run_passes(spread, ["fold"], for_quantization=fmt)
    (site,) = report.decisions
    assert site.action == "skipped" and f"kept the gain for {fmt} quantization" in site.reason
    assert site.details["predicted_error_ratio"] > 1.15  # 1.21-1.31 over 200 draws of each format
    np.testing.assert_array_equal(run(gs.export_onnx(graph), x)[0], run(model, x)[0])  # untouched
    # Without the option the same site folds.
    graph, (report,) = run_passes(_one_site(np.where(np.arange(128) % 2 == 0, 3.0, 0.5), rng), ["fold"])
    assert report.decisions[0].action == "folded"


def test_an_unknown_format_is_one_line(rng):
    with pytest.raises(FlashNormError, match="unknown quantization format 'int3'; choose from"):
        run_passes(_one_site(np.ones(8) * 2, rng), ["fold"], for_quantization="int3")


def test_fold_checkpoint_selects_the_same_way(tmp_path):
    """`fold-checkpoint --for-quantization`: a site whose gain is spread sixfold inside each
    block keeps it, sites of even gain magnitude fold; the predicted ratios are in the report."""
    pytest.importorskip("torch")
    import torch

    from flashnorm.checkpoint import fold_checkpoint
    from models import cache

    model = cache.tiny_llama_model()
    hf = tmp_path / "hf"
    model.save_pretrained(hf)
    # The tiny model's hidden size is 64: one int4 block of 128 (padded) covers all of K.
    with torch.no_grad():
        state = {k: v.clone() for k, v in model.state_dict().items()}
    state["model.layers.0.input_layernorm.weight"] = torch.where(torch.arange(64) % 2 == 0, 3.0, 0.5)
    for name in ("model.layers.0.post_attention_layernorm.weight", "model.layers.1.input_layernorm.weight",
                 "model.layers.1.post_attention_layernorm.weight"):
        state[name] = torch.full((64,), 1.3)
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items() if k != "lm_head.weight"}, str(hf / "model.safetensors"))
    report = fold_checkpoint(hf, tmp_path / "out", for_quantization="int4")
    sites = {s["name"]: s for s in report["sites"]}
    assert sites["model.layers.0.input_layernorm"]["status"] == "left alone"  # +96 % of a quarter of the error
    assert "kept the gain for int4 quantization" in sites["model.layers.0.input_layernorm"]["reason"]
    assert sites["model.layers.0.input_layernorm"]["predicted_error_ratio"] > 1.2
    for name in ("model.layers.0.post_attention_layernorm", "model.layers.1.input_layernorm"):
        assert sites[name]["status"] == "folded" and sites[name]["predicted_error_ratio"] == pytest.approx(1.0)
    assert report["for_quantization"] == "int4" and report["folded"] == 3


# Pinned before the selection moved out of passes/ (docs/QUANTIZATION.md's routes select with it):
# per format, which of seven sites of growing gain spread fold and their predicted error ratios.
_SPREADS = (0.0, 0.05, 0.2, 0.4, 0.7, 1.0, 1.5)
_PINNED = {
    "int4": (3, (1.0, 1.0075, 1.1023, 1.3261, 1.7936, 1.7901, 1.4889)),
    "int4-b32": (4, (1.0, 1.0043, 1.0613, 1.2231, 1.4836, 1.5107, 1.2414)),
    "int8": (3, (1.0, 1.0028, 1.1153, 1.3726, 2.0365, 2.1849, 2.6791)),
}


def _pinned_model() -> gs.Graph:
    """Seven norms in a chain (hidden 256: two int4 blocks, eight of 32), gain i log-normal with
    spread _SPREADS[i] and one sign in ten negative; fixed seed."""
    rng = np.random.default_rng(49)
    b, hidden, h = GraphBuilder(), 256, "x"
    for i, spread in enumerate(_SPREADS):
        gain = np.exp(rng.normal(0, spread, hidden)) * np.where(rng.random(hidden) < 0.1, -1, 1)
        y = pow_div(b, h, gain.astype(np.float32), 1e-5)
        h = b.op("MatMul", [y, b.const((rng.standard_normal((hidden, hidden)) / 16).astype(np.float32), f"w{i}")])
    return gs.import_onnx(b.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", hidden])], [h]))


@pytest.mark.parametrize("fmt", sorted(_PINNED))
def test_the_selection_is_pinned(fmt):
    folded, ratios = _PINNED[fmt]
    _, (report,) = run_passes(_pinned_model(), ["fold"], for_quantization=fmt)
    assert [d.action for d in report.decisions] == ["folded"] * folded + ["skipped"] * (len(_SPREADS) - folded)
    assert [d.details["predicted_error_ratio"] for d in report.decisions] == pytest.approx(ratios, abs=2e-4)
