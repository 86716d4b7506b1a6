"""Shared fixtures of the mesa_ops tests.

* every test starts from ``torch.manual_seed(0)`` and with quantizers numbered from 0 (Mesa's
  stochastic-rounding seeds are drawn from torch's generator and salted with a nameless
  quantizer's number, so this makes every quantization in a test reproducible, in any order);
* ``no_forced_backend`` clears ``MESA_BACKEND`` for tests that check the default backend (the
  rest honour a value set by the caller, e.g. MESA_BACKEND=torch to run on the reference);
* ``cpp_backend`` / ``ref_backend`` / ``cuda_backend`` give the three backends of
  :mod:`mesa_ops.backend` (the C++ extension is JIT-built on first use, ~30 s, then cached);
* tests marked ``@pytest.mark.cuda`` are skipped, with the reason, when no GPU is visible;
* the tests of :data:`COMPAT_FILES` are marked ``compat``: the subset scripts/compat.sh runs at
  other PyTorch releases (the floor in CI): the C++ and nvcc builds, quantizer, layers, attention
  (fake CUDA and the CUDA emulation included), models, torch.compile, timm's contract, training.
"""
from __future__ import annotations

import os

import pytest
import torch

NO_CUDA_REASON = "needs a CUDA device (torch.cuda.is_available() is False)"


COMPAT_FILES = frozenset({
    "test_kernels.py", "test_simd_builds.py", "test_cuda_emulation.py", "test_core_correctness.py",
    "test_layers.py", "test_amp.py", "test_attention.py", "test_fake_cuda.py", "test_models.py",
    "test_compile.py", "test_timm_contract.py", "test_train.py", "test_checkpoint.py", "test_cckpt.py",
    "test_compress.py", "test_memory.py", "test_policy.py", "test_prefix_tokens.py",
    "test_shared_copies.py", "test_silent_errors.py", "test_workspace.py", "test_gpu_check.py",
    "test_batchnorm.py", "test_any_model.py",
})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in COMPAT_FILES:
            item.add_marker(pytest.mark.compat)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=NO_CUDA_REASON)
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed(monkeypatch):
    torch.manual_seed(0)
    # a quantizer without a layer name salts its seeds with its construction number in the
    # process: numbered from 0 in each test, so that its draws do not depend on which tests ran
    # before it (a kv_reduced SDPA bound failed at 1.002e-2 only after other tests had run)
    import itertools

    from mesa_ops import quant
    monkeypatch.setattr(quant, "_INSTANCES", itertools.count())
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
