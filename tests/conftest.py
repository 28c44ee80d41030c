import os
import subprocess
import sys

import numpy as np
import pytest

# The Triton interpreter only works if triton's standard library was jitted under
# TRITON_INTERPRET=1, i.e. if triton was first imported with it set; and a kernel first compiled
# (or a module of kernels first imported) while it is set stays interpreted. So one process runs
# Triton either natively or through the interpreter, never both:
# * CPU machines: the interpreter. Other modules (vLLM, the transfer tests) import triton too, so
#   import it here, before any test module, then restore the variable: the Triton tests set it
#   per test;
# * GPU machines: natively. The interpreter cases (marked ``triton_interpreter``: Triton on CPU
#   tensors) are skipped, and run in a process of their own started with
#   UCM_TEST_TRITON_INTERPRETER=1 (``make test-gpu`` runs both processes).
GPU_MACHINE = any(os.path.exists(p) for p in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/kfd"))
INTERPRETER_PROCESS = not GPU_MACHINE or os.environ.get("UCM_TEST_TRITON_INTERPRETER") == "1"
if INTERPRETER_PROCESS:
    from ucm.fast.triton import prepare_interpreter

    prepare_interpreter()

from ucm import dispatch

# tests/sglang_backend runs with SGLang's modules on PYTHONPATH (scripts/install_sglang.sh; `make
# test` runs it so after the main suite); elsewhere SGLang is absent and the folder is left out
import importlib.util  # noqa: E402

collect_ignore = [] if importlib.util.find_spec("sglang") else ["sglang_backend"]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _clean_dispatch():
    """Each test starts from fresh probes and no ``set_backend``. An ``UCM_BACKEND`` set outside
    is honoured: ``make test`` runs the op test modules again with ``UCM_BACKEND=reference`` so
    that the calls without ``backend=`` run the reference too; tests that need one implementation
    pass ``backend=``, tests of automatic selection unset the variable themselves."""
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


def require_vllm_module():
    """Call at the top of a test module that needs vLLM: a failure in CI
    (``UCM_REQUIRE_SERVICES=1``), a skip of the whole module elsewhere."""
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the machine
        if os.environ.get("UCM_REQUIRE_SERVICES") == "1":
            pytest.fail(f"vLLM is required here (UCM_REQUIRE_SERVICES=1): {exc!r}", pytrace=False)
        pytest.skip(f"vLLM not installed: {exc!r}", allow_module_level=True)


def _old_interpreter() -> bool:
    """Triton's interpreter before 3.9 cannot run the transfer kernels' loops over a loaded
    length (TypeError: only 0-dimensional arrays can be converted to Python scalars; seen with
    the Triton 3.6 of the H200 image). CI's CPU machines run Triton 3.9."""
    try:
        from importlib.metadata import version

        major, minor = (int(x) for x in version("triton").split(".")[:2])
        return (major, minor) < (3, 9)
    except Exception:
        return False


# The longest modules run first: under pytest-xdist (make test: two workers, a file each) they
# then start at once instead of last, and the short files fill the other worker meanwhile.
FIRST = ("test_vllm_e2e.py", "test_vllm_serve.py", "test_vllm_sparse.py",
         "test_integration_patch.py")


def pytest_collection_modifyitems(config, items):
    def rank(item):
        name = os.path.basename(str(item.fspath))
        return FIRST.index(name) if name in FIRST else len(FIRST)
    items.sort(key=rank)   # (stable: each module's own order stays)
    if INTERPRETER_PROCESS:
        if GPU_MACHINE and _old_interpreter():
            old = pytest.mark.skip(reason="Triton < 3.9: its interpreter cannot run these kernels "
                                          "(they run natively on this GPU and interpreted in CI)")
            for item in items:
                if item.get_closest_marker("triton_interpreter"):
                    item.add_marker(old)
        return
    skip = pytest.mark.skip(reason="Triton-interpreter case: on a GPU machine it runs in its own "
                                   "process (UCM_TEST_TRITON_INTERPRETER=1; make test-gpu)")
    for item in items:
        if item.get_closest_marker("triton_interpreter"):
            item.add_marker(skip)
