"""Shared fixtures of the mesa_ops tests.

* every test starts from ``torch.manual_seed(0)`` (Mesa's stochastic-rounding seeds are drawn
  from torch's generator, so this makes every quantization in a test reproducible);
* ``no_forced_backend`` clears ``MESA_BACKEND`` for tests that check the default backend (the
  rest honour a value set by the caller, e.g. MESA_BACKEND=torch to run on the reference);
* ``cpp_backend`` / ``ref_backend`` / ``cuda_backend`` give the three backends of
  :mod:`mesa_ops.backend` (the C++ extension is JIT-built on first use, ~30 s, then cached);
* tests marked ``@pytest.mark.cuda`` are skipped, with the reason, when no GPU is visible.
"""
from __future__ import annotations

import os

import pytest
import torch

NO_CUDA_REASON = "needs a CUDA device (torch.cuda.is_available() is False)"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=NO_CUDA_REASON)
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def no_forced_backend(monkeypatch):
    """Clears MESA_BACKEND for a test that checks the default choice of backend."""
    monkeypatch.delenv("MESA_BACKEND", raising=False)


@pytest.fixture(scope="session")
def cpp_backend():
    from mesa_ops import backend

    be = backend.get_backend(torch.zeros(1), "cpp")
    if be.name != "cpu":  # the build failed and get_backend fell back to the reference
        pytest.fail("the C++ extension could not be built (get_backend fell back to the "
                    "pure-PyTorch reference); see the RuntimeWarning above")
    return be


@pytest.fixture(scope="session")
def ref_backend():
    from mesa_ops import backend

    be = backend.get_backend(torch.zeros(1), "torch")
    assert be.name == "torch"
    return be


@pytest.fixture(scope="session")
def cuda_backend():
    if not torch.cuda.is_available():
        pytest.skip(NO_CUDA_REASON)
    from mesa_ops import backend

    return backend.get_backend(torch.zeros(1, device="cuda"), "cuda")
