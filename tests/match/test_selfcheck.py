"""The numeric self-check: a site is accepted only if its own nodes compute its formula."""

from __future__ import annotations

import onnx_graphsurgeon as gs
import pytest

from flashnorm.match import find_norm_sites
from flashnorm.match.rejection import Rejected
from flashnorm.match.selfcheck import self_check
from synthetic import build_norm_model


@pytest.mark.parametrize("spelling", ["legacy_torch", "rms_normalization", "skip_simplified_layernorm", "ln_decomposed_cast",
                                      "layer_normalization", "skip_layer_normalization"])
def test_matching_formula_passes(spelling, rng):
    graph = gs.import_onnx(build_norm_model(spelling, rng))
    (site,) = find_norm_sites(graph)
    self_check(site, graph.opset, rng)


@pytest.mark.parametrize("spelling", ["pow_div", "rms_normalization", "ln_reciprocal", "layer_normalization"])
def test_wrong_eps_is_caught(spelling, rng):
    graph = gs.import_onnx(build_norm_model(spelling, rng, eps=1e-5))
    (site,) = find_norm_sites(graph)
    site.eps = 1e-3
    with pytest.raises(Rejected, match="self-check failed"):
        self_check(site, graph.opset, rng)


def test_wrong_gain_is_caught(rng):
    graph = gs.import_onnx(build_norm_model("mul_reciprocal", rng))
    (site,) = find_norm_sites(graph)
    site.gain = site.gain[::-1].copy()
    with pytest.raises(Rejected, match="self-check failed"):
        self_check(site, graph.opset, rng)


def test_missing_gain_is_caught(rng):
    graph = gs.import_onnx(build_norm_model("gemma_add_one", rng))
    (site,) = find_norm_sites(graph)
    site.gain = None
    with pytest.raises(Rejected, match="self-check failed"):
        self_check(site, graph.opset, rng)


@pytest.mark.parametrize("spelling", ["ln_decomposed", "layer_normalization"])
def test_wrong_bias_or_kind_is_caught(spelling, rng):
    """A LayerNorm checked as an RMSNorm (no mean subtracted), or with another bias, fails."""
    graph = gs.import_onnx(build_norm_model(spelling, rng))
    (site,) = find_norm_sites(graph)
    bias = site.bias
    site.bias = bias[::-1].copy()
    with pytest.raises(Rejected, match="self-check failed"):
        self_check(site, graph.opset, rng)
    site.bias, site.kind = bias, "rms"
    with pytest.raises(Rejected, match="self-check failed"):
        self_check(site, graph.opset, rng)
