"""`flashnorm fold-checkpoint` on random tiny Hugging Face models of every architecture family
(the same builders and gain randomization as tests/models/test_hf_architectures.py): the
folded checkpoint, reloaded with stock transformers, computes the original's logits, and
exactly the norms whose every consumer is a linear layer are folded (the same counts as the
ONNX fold: a tied LM head keeps the final norm's gain unless --untie)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashnorm import cli
from flashnorm.progress import Progress

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from models.test_hf_architectures import CASES, _randomize_gains  # noqa: E402

CHECKPOINT_CASES = [c for c in CASES if c.name != "gemma4"]


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setattr(Progress, "enabled", False)


def _tied(model) -> bool:
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


def _save(case, directory: Path, rng, shard: str = "60KB"):
    torch.manual_seed(int(rng.integers(2**31)))
    model = case.build().eval()
    _randomize_gains(model, rng)
    model.save_pretrained(directory, max_shard_size=shard)
    return model


def _fold(source: Path, output: Path, *extra: str) -> dict:
    report_path = output.with_suffix(".json")
    assert cli.main(["fold-checkpoint", str(source), "-o", str(output), "-q", "--report", str(report_path), *extra]) == 0
    return json.loads(report_path.read_text())


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.double()


def _assert_same(original, folded, ids) -> float:
    """fp32 logits within 1e-5 relative and the same top-1 everywhere; returns the error."""
    a, b = _logits(original, ids), _logits(folded, ids)
    rel = float((a - b).norm() / a.norm())
    assert rel < 1e-5, rel
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    return rel


def graph_breaks(model, ids) -> int:
    """torch.compile's graph breaks on `model(input_ids=ids).logits`, from a fresh dynamo state."""
    torch._dynamo.reset()
    return torch._dynamo.explain(lambda i: model(input_ids=i).logits)(ids).graph_break_count


@pytest.mark.parametrize("untie", [False, True], ids=["tied", "untie"])
@pytest.mark.parametrize("case", CHECKPOINT_CASES, ids=[c.name for c in CHECKPOINT_CASES])
def test_folded_checkpoint_loads_and_matches(case, untie, tmp_path, rng):
    original = _save(case, tmp_path / "src", rng)
    assert len(list((tmp_path / "src").glob("*.safetensors"))) > 1  # sharded, with an index
    report = _fold(tmp_path / "src", tmp_path / "out", *(["--untie"] if untie else []))
    tied = _tied(original)
    assert report["norm_sites"] == case.sites
    assert report["folded"] == case.folded + (1 if untie and tied else 0), [s for s in report["sites"] if s["reason"]]

    folded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = torch.from_numpy(rng.integers(0, 96, (2, 11)))
    _assert_same(original, folded, ids)
    assert _tied(folded) == (tied and not untie)

    config = json.loads((tmp_path / "out" / "config.json").read_text())
    weightless = config["flashnorm"]["weightless_norms"]
    assert sorted(weightless) == sorted(s["name"] for s in report["sites"] if s["status"] == "folded")
    identity = 0.0 if case.gain_convention == "1+w" else 1.0
    modules = dict(folded.named_modules())
    for name, convention in weightless.items():
        assert convention == case.gain_convention
        assert torch.all(modules[name].weight == identity), name
    for site in report["sites"]:
        if site["status"] != "folded":  # left alone: the gain is untouched
            assert torch.equal(modules[site["name"]].weight, dict(original.named_modules())[site["name"]].weight)
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()


def test_one_rounding_in_bfloat16(tmp_path, rng):
    """A bfloat16 checkpoint: each folded weight is W·g formed in float64 and rounded once."""
    case = next(c for c in CASES if c.name == "llama")
    torch.manual_seed(int(rng.integers(2**31)))
    model = case.build().eval()
    _randomize_gains(model, rng)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "src")
    report = _fold(tmp_path / "src", tmp_path / "out")
    assert report["folded"] == case.folded
    folded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.bfloat16)
    gain = model.model.layers[1].post_attention_layernorm.weight.detach().double()
    for proj in ("gate_proj", "up_proj"):
        expected = (getattr(model.model.layers[1].mlp, proj).weight.detach().double() * gain).to(torch.bfloat16)
        assert torch.equal(getattr(folded.model.layers[1].mlp, proj).weight, expected)
    growth = next(s for s in report["sites"] if s["name"] == "model.layers.1.post_attention_layernorm")["range_growth"]
    up = model.model.layers[1].mlp.up_proj.weight.detach().double()
    expected_growth = ((up * gain).abs().amax(1) / up.abs().amax(1))
    assert growth["model.layers.1.mlp.up_proj.weight"]["max"] == pytest.approx(float(expected_growth.max()))


def test_dtype_option_converts_and_records(tmp_path, rng):
    case = next(c for c in CASES if c.name == "mistral")
    original = _save(case, tmp_path / "src", rng, shard="5GB")
    report = _fold(tmp_path / "src", tmp_path / "out", "--dtype", "float16")
    assert report["dtype"] == "float16" and report["shards"] == 1
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()
    folded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert folded.model.layers[0].self_attn.q_proj.weight.dtype == torch.float16
    ids = torch.from_numpy(rng.integers(0, 96, (1, 9)))
    a, b = _logits(original, ids), _logits(folded.float(), ids)
    assert float((a - b).norm() / a.norm()) < 5e-3  # float16 storage, not the fold, sets this


def test_gguf_quantization_config_is_not_written(tmp_path, rng, monkeypatch):
    """A GGUF source is written as plain float safetensors, so the GGUF quantization_config
    that transformers attaches when it reads the file is not carried into config.json: with
    it, the reloaded folded model counts as quantized and refuses `.half()`. (A tiny model
    carrying that config stands in for the loaded GGUF; the real one: test_checkpoint_smollm2.)"""
    from transformers.utils.quantization_config import GgufConfig

    from flashnorm.checkpoint import fold_checkpoint
    from flashnorm.export import sources

    class Tokenizer:
        def save_pretrained(self, directory):
            (Path(directory) / "tokenizer.json").write_text("{}")

    monkeypatch.setattr(sources, "load_tokenizer", lambda source: Tokenizer())
    case = next(c for c in CASES if c.name == "llama")
    torch.manual_seed(int(rng.integers(2**31)))
    model = case.build().eval()
    _randomize_gains(model, rng)
    model.config.quantization_config = GgufConfig(gguf_file="model.gguf")
    report = fold_checkpoint(sources.ModelSource(tmp_path, "model.gguf"), tmp_path / "out", model=model)
    assert report["folded"] == case.folded
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config and config["flashnorm"]["weightless_norms"]
    folded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert not getattr(folded, "is_quantized", False)
    _assert_same(model, folded, torch.from_numpy(rng.integers(0, 96, (1, 9))))
    assert folded.half().model.layers[0].self_attn.q_proj.weight.dtype == torch.float16


def test_already_weightless_gains_are_left_alone(tmp_path, rng):
    """A norm whose gain is already the identity is reported, not 'folded' again."""
    case = next(c for c in CASES if c.name == "llama")
    torch.manual_seed(int(rng.integers(2**31)))
    model = case.build().eval()
    _randomize_gains(model, rng)
    with torch.no_grad():
        model.model.layers[0].input_layernorm.weight.fill_(1.0)
    model.save_pretrained(tmp_path / "src")
    report = _fold(tmp_path / "src", tmp_path / "out")
    assert report["folded"] == case.folded - 1
    site = next(s for s in report["sites"] if s["name"] == "model.layers.0.input_layernorm")
    assert site["status"] == "left alone" and "already the identity" in site["reason"]


def test_compile_same_logits_no_more_graph_breaks(tmp_path, rng):
    """torch.compile (Inductor, CPU) of the folded model: the original's logits, and no more
    graph breaks than the original under torch._dynamo.explain."""
    case = next(c for c in CASES if c.name == "qwen3")
    original = _save(case, tmp_path / "src", rng)
    _fold(tmp_path / "src", tmp_path / "out")
    folded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = torch.from_numpy(rng.integers(0, 96, (1, 7)))
    breaks = {"original": graph_breaks(original, ids), "folded": graph_breaks(folded, ids)}
    assert breaks["folded"] <= breaks["original"], breaks
    torch._dynamo.reset()
    compiled = torch.compile(folded)
    _assert_same(original, compiled, ids)


def test_cli_text_output(tmp_path, rng, capsys):
    case = next(c for c in CASES if c.name == "gemma2")
    _save(case, tmp_path / "src", rng)
    assert cli.main(["fold-checkpoint", str(tmp_path / "src"), "-o", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert f"{case.sites} norm sites, {case.folded} folded, {case.sites - case.folded} left alone" in out
    assert "left alone: model.norm: lm_head is tied to model.embed_tokens.weight" in out
    assert f"left alone: model.layers.0.post_attention_layernorm and {2 * 2 - 1} more like it: its output reaches add" in out
    assert "largest per-channel range growth" in out


# ---------------------------------------------------------------------------------------------
# Bad input: one line, a non-zero exit, nothing left behind.

def _listing(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


def _refused(args: list[str], capsys, where: Path) -> str:
    before = _listing(where)
    capsys.readouterr()  # what building the inputs printed
    code = cli.main(["fold-checkpoint", *args])
    err = capsys.readouterr().err
    assert code != 0
    assert len(err.strip().splitlines()) == 1, err
    assert _listing(where) == before
    return err


def test_not_a_checkpoint(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("hello")
    err = _refused([str(tmp_path / "empty"), "-o", str(tmp_path / "out")], capsys, tmp_path)
    assert "not a Hugging Face model directory" in err
    err = _refused([str(tmp_path / "notes.txt"), "-o", str(tmp_path / "out")], capsys, tmp_path)
    assert "is not a model" in err
    (tmp_path / "noweights").mkdir()
    transformers.LlamaConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2).save_pretrained(tmp_path / "noweights")
    err = _refused([str(tmp_path / "noweights"), "-o", str(tmp_path / "out")], capsys, tmp_path)
    assert "has no model.safetensors" in err
    (tmp_path / "noweights" / "model.safetensors").write_bytes(b"not safetensors at all")
    err = _refused([str(tmp_path / "noweights"), "-o", str(tmp_path / "out")], capsys, tmp_path)
    assert "is not a safetensors file" in err


def test_unsupported_architecture_named(tmp_path, rng, capsys):
    bert = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                   intermediate_size=48, is_decoder=True)
    torch.manual_seed(0)
    transformers.BertLMHeadModel(bert).save_pretrained(tmp_path / "bert")
    err = _refused([str(tmp_path / "bert"), "-o", str(tmp_path / "out")], capsys, tmp_path)
    assert "unsupported architecture BertLMHeadModel: it has no RMSNorm module" in err
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text(json.dumps({"architectures": ["OddForCausalLM"], "model_type": "odd"}))
    err = _refused([str(tmp_path / "odd"), "-o", str(tmp_path / "out")], capsys, tmp_path)
    assert "unsupported architecture ['OddForCausalLM']" in err


def test_already_folded_is_refused(tmp_path, rng, capsys):
    case = next(c for c in CASES if c.name == "llama")
    _save(case, tmp_path / "src", rng)
    _fold(tmp_path / "src", tmp_path / "once")
    err = _refused([str(tmp_path / "once"), "-o", str(tmp_path / "twice")], capsys, tmp_path)
    assert f"is already folded (config.json 'flashnorm' lists {case.folded} weightless norms)" in err
    # The key survives a load and save with stock transformers, and so does the refusal.
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "once").save_pretrained(tmp_path / "resaved")
    err = _refused([str(tmp_path / "resaved"), "-o", str(tmp_path / "twice")], capsys, tmp_path)
    assert "is already folded" in err


def test_unwritable_output(tmp_path, rng, capsys, monkeypatch):
    case = next(c for c in CASES if c.name == "llama")
    _save(case, tmp_path / "src", rng)
    (tmp_path / "file").write_text("x")
    err = _refused([str(tmp_path / "src"), "-o", str(tmp_path / "file" / "out")], capsys, tmp_path)
    assert "file is not a directory" in err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    err = _refused([str(tmp_path / "src"), "-o", str(tmp_path / "full")], capsys, tmp_path)
    assert "is not empty (pass --force" in err

    # The disk fills while the second shard is written: the staged directory goes away.
    from flashnorm.checkpoint import fold as fold_module

    real, calls = fold_module.write_shard, []

    def failing(path, tensors, progress):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(path, tensors, progress)

    monkeypatch.setattr(fold_module, "write_shard", failing)
    err = _refused([str(tmp_path / "src"), "-o", str(tmp_path / "out")], capsys, tmp_path)
    assert "No space left on device" in err and len(calls) == 2


def test_exported_folded_checkpoint_is_weightless_in_inspect(tmp_path, rng, capsys):
    """`flashnorm export` of a folded checkpoint: `inspect` finds every folded norm already
    weightless (gain all ones, nothing left to fold), and only the tied head's norm foldable."""
    case = next(c for c in CASES if c.name == "qwen2")
    _save(case, tmp_path / "src", rng)
    report = _fold(tmp_path / "src", tmp_path / "out")
    assert cli.main(["export", str(tmp_path / "out"), "-o", str(tmp_path / "folded.onnx"), "-q"]) == 0
    assert cli.main(["inspect", str(tmp_path / "folded.onnx"), "--report", "-"]) == 0
    inspected = json.loads(capsys.readouterr().out)
    assert inspected["norm_sites"] == case.sites
    assert inspected["weightless"] == report["folded"] == case.folded
    weightless = [s for s in inspected["sites"] if s["weightless"]]
    assert all(s["fold"]["reason"] == "already weightless (gain is all ones)" for s in weightless)
    assert inspected["foldable"] == 0  # the last norm feeds the tied head: left alone in ONNX too
    assert cli.main(["inspect", str(tmp_path / "folded.onnx")]) == 0
    assert f"{case.folded} already weightless" in capsys.readouterr().out


def test_check_int8_needs_a_tokenizer_before_any_work(tmp_path, rng, capsys):
    case = next(c for c in CASES if c.name == "llama")
    _save(case, tmp_path / "src", rng)
    err = _refused([str(tmp_path / "src"), "-o", str(tmp_path / "out"), "--check-int8"], capsys, tmp_path)
    assert "cannot load a tokenizer" in err


@pytest.mark.slow
def test_check_int8_cli(tmp_path, rng, smollm2_tokenizer, capsys):
    """--check-int8 on a tiny Llama with SmolLM2's tokenizer (and vocabulary size): both
    errors, their ratio and the verdict in the report and the text."""
    torch.manual_seed(int(rng.integers(2**31)))
    config = transformers.LlamaConfig(vocab_size=len(smollm2_tokenizer), hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      initializer_range=0.2, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).eval()
    _randomize_gains(model, rng)
    model.save_pretrained(tmp_path / "src")
    smollm2_tokenizer.save_pretrained(tmp_path / "src")
    report_path = tmp_path / "out.json"
    status = cli.main(["fold-checkpoint", str(tmp_path / "src"), "-o", str(tmp_path / "out"), "-q",
                       "--report", str(report_path), "--check-int8"])
    q = json.loads(report_path.read_text())["int8"]
    assert q["ratio"] == pytest.approx(q["folded_int8_error"] / q["original_int8_error"])
    assert q["passed"] == (q["ratio"] <= 1.1) and q["tokens"] > 50 and len(q["layers"]) == 10
    assert status == (0 if q["passed"] else 1)  # random gains land on either side of the limit
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    assert cli.main(["fold-checkpoint", str(tmp_path / "src"), "-o", str(tmp_path / "again"), "--check-int8"]) == status
    assert "int8 weight-only logits error vs float32 original" in capsys.readouterr().out


def test_uniform_gain_leaves_int8_error_unchanged():
    """A gain c on every channel scales each row's range by c and divides the input by c:
    the estimate is exactly 1, whatever c."""
    from flashnorm.quantization_aware import int8_error_estimate

    for c in (0.1, 1.0, 7.5):
        gain = torch.full((64,), c, dtype=torch.float64)
        assert int8_error_estimate([c, c], gain) == pytest.approx(1.0)
    spiky = torch.full((64,), 0.2, dtype=torch.float64)
    spiky[3] = 20.0  # one channel sets every row's maximum after the fold
    assert int8_error_estimate([20.0 * 0.5], spiky) > 3


def test_int8_limit_keeps_risky_gains(tmp_path, rng):
    """One layer's attention norm gets a single channel 100× the rest: with --int8-limit the
    report gives its estimate, that site keeps its gain (reason says why) and the rest fold; the
    checkpoint still computes the original's logits."""
    torch.manual_seed(int(rng.integers(2**31)))
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).eval()
    _randomize_gains(model, rng)
    risky = "model.layers.1.input_layernorm"
    with torch.no_grad():
        gain = dict(model.named_modules())[risky].weight
        gain.fill_(0.5)
        gain[int(rng.integers(64))] = 50.0
    model.save_pretrained(tmp_path / "src")

    everything = _fold(tmp_path / "src", tmp_path / "all")
    estimates = {s["name"]: s["int8_error_estimate"] for s in everything["sites"] if s["status"] == "folded"}
    assert everything["folded"] == 5 and everything["int8_limit"] is None
    limit = 1.5
    assert estimates[risky] > limit and sum(e > limit for e in estimates.values()) == 1, estimates

    guarded = _fold(tmp_path / "src", tmp_path / "guarded", "--int8-limit", str(limit))
    by_name = {s["name"]: s for s in guarded["sites"]}
    assert guarded["folded"] == 4 and guarded["int8_limit"] == limit
    assert by_name[risky]["status"] == "left alone" and "int8 error about" in by_name[risky]["reason"]
    folded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "guarded", dtype=torch.float32).eval()
    assert torch.equal(dict(folded.named_modules())[risky].weight, gain)
    _assert_same(model, folded, torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(int(rng.integers(2**31)))))


def test_int8_limit_below_one_is_refused(tmp_path, capsys):
    transformers.LlamaConfig(architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path / "src")  # refused before any read
    assert cli.main(["fold-checkpoint", str(tmp_path / "src"), "-o", str(tmp_path / "out"), "--int8-limit", "0.9"]) == 2
    assert "argument --int8-limit: must be at least 1.0, got 0.9" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_int8_limit_is_deprecated_and_not_combined_with_for_quantization(tmp_path, capsys):
    """--int8-limit still selects (test_int8_limit_keeps_risky_gains) and says once that
    --for-quantization int8 replaces it; the two selections together are one line, exit 2."""
    transformers.LlamaConfig(architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path / "src")  # refused before any read
    assert cli.main(["fold-checkpoint", str(tmp_path / "src"), "-o", str(tmp_path / "out"), "--int8-limit", "1.3",
                     "--for-quantization", "int8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == ("flashnorm fold-checkpoint: warning: --int8-limit is deprecated here, use --for-quantization int8 "
                      "(one selection of the norms to fold before a quantizer, shared with optimize; --int8-limit "
                      "still works in this release and goes in the next)")
    assert len(err) == 2 and "--int8-limit and --for-quantization are two selections" in err[1]
    assert not (tmp_path / "out").exists()


def test_a_quantized_checkpoint_is_refused(tmp_path, capsys):
    """A consumer weight stored as fp8 (its scale in another tensor, as FP8 checkpoints keep it):
    folding g into the codes would be neither the fold nor the quantization: one line, exit 2."""
    from safetensors.torch import load_file, save_file

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "src")
    path = tmp_path / "src" / "model.safetensors"
    state = load_file(str(path))
    name = "model.layers.0.self_attn.q_proj.weight"
    state[name] = state[name].to(torch.float8_e4m3fn)
    save_file(state, str(path), metadata={"format": "pt"})
    capsys.readouterr()  # save_pretrained's progress
    assert cli.main(["fold-checkpoint", str(tmp_path / "src"), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{name} is stored as float8_e4m3fn (a quantized checkpoint)" in err and "\n" not in err
    assert not (tmp_path / "out").exists()


def test_a_float_checkpoint_folds_without_onnx_graphsurgeon(tmp_path):
    """The GPU machine has no onnx-graphsurgeon and folds checkpoints there
    (benchmarks/checkpoint_decode.py): a float fold never imports match/, which needs it."""
    import subprocess
    import sys

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "src")
    script = ("import sys\nfrom flashnorm.checkpoint import fold_checkpoint\nfrom flashnorm.progress import Progress\n"
              "Progress.enabled = False\n"
              f"fold_checkpoint({str(tmp_path / 'src')!r}, {str(tmp_path / 'out')!r}, for_quantization='int4')\n"
              "print(sorted(m for m in sys.modules if m.split('.')[0] in ('onnx_graphsurgeon', 'onnx') "
              "or m.startswith('flashnorm.match')))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip().splitlines()[-1] == "[]"
