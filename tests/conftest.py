import os
import subprocess
import sys

import numpy as np
import pytest

from ucm import dispatch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Implementations each equivalence test runs; a fast one that is unavailable is a failure in CI
# (UCM_REQUIRE_NATIVE=1) and a visible skip elsewhere.
FAST = {"hash_blocks": "numba", "block_index": "numba", "copy_segments": "native",
        "alloc_aligned": "native"}


@pytest.fixture(autouse=True)
def _clean_dispatch(monkeypatch):
    monkeypatch.delenv("UCM_BACKEND", raising=False)
    dispatch._reset_for_tests()
    yield
    dispatch._reset_for_tests()


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def impls_of(op):
    """pytest params over the implementations of op, ids = implementation names."""
    return [pytest.param(i.name, id=i.name) for i in dispatch.implementations(op)]


def run_python(code, env=None, cwd=None, timeout=120):
    """Run code in a fresh interpreter; returns CompletedProcess (text)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("UCM_")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=full_env, cwd=cwd, timeout=timeout)
