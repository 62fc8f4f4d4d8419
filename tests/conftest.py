"""Shared test configuration.

GPU tests carry `@pytest.mark.gpu` and are skipped where no CUDA device (or no built kernel
library) exists. Model fixtures that take long to build (exports) are cached per session.
"""

from __future__ import annotations

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
    """A fresh, differently seeded generator for every test run (never zeros, never fixed)."""
    import numpy as np

    seed = np.random.SeedSequence().entropy % (2**32)
    print(f"rng seed for {request.node.name}: {seed}")
    return np.random.default_rng(seed)


@pytest.fixture(scope="session")
def session_tmp(tmp_path_factory):
    path = tmp_path_factory.mktemp("session")
    yield path
    shutil.rmtree(path, ignore_errors=True)
