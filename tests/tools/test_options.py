"""One vocabulary across commands (flashnorm.tools.options): --backend means the TensorRT
flavour only (triton's is --triton-backend, the old spelling a deprecated alias that says so),
--shapes is the one profile option, --dtype takes both spellings everywhere, option ranges are
checked by their types, and -q silences third-party progress bars too."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from flashnorm import cli
from flashnorm.tools import options


def _parse(argv: list[str]) -> argparse.Namespace:
    return cli.build_parser(argv).parse_args(argv)


def test_triton_backend_and_its_deprecated_spelling(capsys):
    new = _parse(["triton", "--triton-backend", "python", "--onnx", "m.onnx", "-o", "repo"])
    assert new.triton_backend == "python" and capsys.readouterr().err == ""
    old = _parse(["triton", "--backend", "python", "--onnx", "m.onnx", "-o", "repo"])
    assert old.triton_backend == "python"
    assert "--backend is deprecated here, use --triton-backend" in capsys.readouterr().err
    assert _parse(["triton", "-o", "repo"]).triton_backend == "tensorrt"
    for command in (["build", "m.onnx", "-o", "m.plan"], ["compare", "a.onnx", "b.onnx"]):
        assert _parse([*command, "--backend", "tensorrt-rtx"]).backend == "tensorrt-rtx"


def test_one_shape_profile_option(capsys):
    for argv in (["build", "m.onnx", "-o", "m.plan"], ["compare", "a.onnx", "b.onnx"], ["triton", "-o", "r"]):
        assert _parse([*argv, "--shapes", "x:1x1,1x8,1x64"]).shapes == ["x:1x1,1x8,1x64"]
    old = _parse(["compare", "a.onnx", "b.onnx", "--trt-shapes", "x:1x1,1x8,1x64", "--shapes", "y:1,2,3"])
    assert sorted(old.shapes) == ["x:1x1,1x8,1x64", "y:1,2,3"]
    assert "--trt-shapes is deprecated here, use --shapes" in capsys.readouterr().err


@pytest.mark.parametrize("given, short, long", [("fp16", "fp16", "float16"), ("float16", "fp16", "float16"),
                                                ("BF16", "bf16", "bfloat16"), ("float32", "fp32", "float32")])
def test_every_dtype_option_takes_both_spellings(given, short, long):
    assert _parse(["export", "hf", "-o", "m.onnx", "--dtype", given]).dtype == short
    assert _parse(["demo", "--dtype", given]).dtype == short
    assert _parse(["fold-checkpoint", "hf", "-o", "out", "--dtype", given]).dtype == long


def test_a_dtype_outside_the_vocabulary_is_one_line(capsys):
    assert cli.main(["export", "hf", "-o", "m.onnx", "--dtype", "int8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'int8' is not one of fp32, fp16, bf16, float32, float16, bfloat16" in err
    assert _parse(["fold-checkpoint", "hf", "-o", "out", "--dtype", "auto"]).dtype == "auto"
    assert cli.main(["export", "hf", "-o", "m.onnx", "--dtype", "auto"]) == 2


@pytest.mark.parametrize("kind, lowest, good, bad", [
    (int, 1, ["1", "7"], ["0", "-3", "1.5", "x"]),
    (float, 0.0, ["0", "2.5", "1e-9"], ["-1", "nan", "inf", "-inf", "x"]),
])
def test_range_types(kind, lowest, good, bad):
    parse = options.at_least(lowest, kind)
    assert [parse(text) for text in good] == [kind(text) for text in good]
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)
    for text in ("0", "-1", "nan"):
        with pytest.raises(argparse.ArgumentTypeError):
            options.positive(float)(text)
    assert options.seed("0") == 0 and options.seed(str(2**63 - 1)) == 2**63 - 1
    for text in ("-1", str(2**63)):
        with pytest.raises(argparse.ArgumentTypeError):
            options.seed(text)


def test_quiet_silences_third_party_progress_bars(tmp_path):
    """transformers prints a 'Loading weights' bar when it loads a checkpoint; -q hides it."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, architectures=["LlamaForCausalLM"])
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    env = {k: v for k, v in os.environ.items() if k not in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS")}
    command = [sys.executable, "-m", "flashnorm.cli", "export", str(tmp_path / "hf")]
    loud = subprocess.run([*command, "-o", str(tmp_path / "a.onnx")], capture_output=True, text=True, env=env)
    assert loud.returncode == 0 and "Loading weights" in loud.stderr  # the bar exists without -q
    quiet = subprocess.run([*command, "-o", str(tmp_path / "b.onnx"), "-q"], capture_output=True, text=True, env=env)
    assert quiet.returncode == 0 and quiet.stderr == "" and quiet.stdout == ""
