"""Test setup. Without a CUDA GPU the Triton kernels run in the Triton interpreter, which must be switched on before
any ``@triton.jit`` kernel is defined, so this comes before anything imports gdnpass.kernels' Triton modules."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

HAS_GPU = torch.cuda.is_available()
DEVICE = "cuda" if HAS_GPU else "cpu"


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.gpu`` tests are skipped on machines without CUDA."""
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture
def kernel_exp(monkeypatch):
    """In the interpreter, the torch reference computed with the kernels' exp and log (numpy's: the interpreter has
    no libdevice), so the bytes of a kernel calling them must be identical to it. Compiled, the reference as it is
    (the kernels call CUDA's expf / logf, as torch does). tests/kernels/test_triton_ops.py says why."""
    from gdnpass.kernels import triton_core

    if not triton_core.INTERPRETED:
        return
    import numpy as np

    def numpy_fn(fn):
        def call(t):
            with np.errstate(all="ignore"):
                return torch.from_numpy(fn(t.detach().cpu().numpy()))
        return call

    monkeypatch.setattr(torch, "exp", numpy_fn(np.exp))
    monkeypatch.setattr(torch, "log", numpy_fn(np.log))


@pytest.fixture(scope="session")
def llama():
    """The pinned llama.cpp (ggml + libllama, -O0), built into the user's cache the first time (about 2.5 min on 2
    cores, download included), found there in milliseconds after. Skips only without a compiler toolchain."""
    import sys

    from gdnpass.frontends.llama import build

    missing = build.toolchain_missing()
    if missing:
        pytest.skip(f"cannot build llama.cpp here: {missing}")
    return build.ensure(log=lambda line: print(f"[llama.cpp build] {line}", file=sys.stderr))
