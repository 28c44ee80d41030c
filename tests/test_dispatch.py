"""Dispatcher: selection order, strictness, fallback, verifiers, backend_info."""
import logging

import numpy as np
import pytest

import ucm
from ucm import dispatch
from conftest import run_python


@pytest.fixture(autouse=True)
def _auto_selection(monkeypatch):
    """These tests set the selection environment they test: none unless they say so."""
    monkeypatch.delenv("UCM_BACKEND", raising=False)


def _native_built() -> bool:
    """Whether the C engine loads here. CI exports UCM_REQUIRE_NATIVE=1, under which importing
    ucm without it fails; the GPU machine has no cffi to build it."""
    from ucm import fast

    return fast.native_status()[0]


def test_auto_picks_fast_on_this_machine():
    info = ucm.backend_info()
    assert info["platform"] in ("cpu", "cuda", "npu")
    assert info["ops"]["hash_blocks"]["selected"] == "numba"
    assert info["ops"]["block_index"]["selected"] == "numba"
    copy = info["ops"]["copy_segments"]
    if _native_built():
        assert copy["selected"] == "native"
    else:   # the reference, with the engine listed as unavailable and why
        native = copy["implementations"]["native"]
        assert copy["selected"] == "reference" and not native["available"] and native["reason"]
    for op, entry in info["ops"].items():
        assert entry["reason"] and "reference" in entry["implementations"], op


def test_precedence_argument_over_set_backend_over_env(monkeypatch):
    monkeypatch.setenv("UCM_BACKEND", "reference")
    assert dispatch.select("hash_blocks")[0].name == "reference"
    ucm.set_backend("fast")
    assert dispatch.select("hash_blocks")[0].name == "numba"
    assert dispatch.select("hash_blocks", "reference")[0].name == "reference"
    ucm.set_backend(None)
    assert dispatch.select("hash_blocks")[0].name == "reference"
    monkeypatch.delenv("UCM_BACKEND")
    assert dispatch.select("hash_blocks")[0].name == "numba"


def test_global_impl_name_applies_only_where_registered():
    if not _native_built():
        pytest.skip("the native engine is not built on this machine (CI requires it)")
    ucm.set_backend("native")
    assert dispatch.select("copy_segments")[0].name == "native"
    impl, reason = dispatch.select("hash_blocks")
    assert impl.name == "numba" and "not an implementation" in reason


def test_unknown_backend_names_are_errors(monkeypatch):
    with pytest.raises(ValueError, match="unknown backend 'cuda_magic'"):
        ucm.set_backend("cuda_magic")
    with pytest.raises(ValueError, match="expected one of"):
        ucm.hash_blocks([1] * 16, bytes(16), 16, backend="fastest")
    with pytest.raises(dispatch.BackendUnavailableError, match="not an implementation"):
        ucm.hash_blocks([1] * 16, bytes(16), 16, backend="native")
    monkeypatch.setenv("UCM_BACKEND", "nope")
    with pytest.raises(ValueError, match="UCM_BACKEND"):
        dispatch.select("hash_blocks")


def _register_toy(monkeypatch, probe_ok: bool, verifier=None):
    """A toy op on a CPU platform (forced: on a GPU machine `gpuonly` would be available)."""
    monkeypatch.setattr(dispatch, "_platform", "cpu")
    monkeypatch.setattr(dispatch, "_REGISTRY", dict(dispatch._REGISTRY))
    dispatch.register("toy", "reference", "numpy:add")
    dispatch.register("toy", "gpuonly", "numpy:multiply", platforms={"cuda"}, priority=20)
    dispatch.register("toy", "probed", "numpy:subtract", priority=10,
                      probe=lambda: (probe_ok, "probe says " + ("yes" if probe_ok else "no")),
                      verifier=verifier)


def test_auto_falls_back_quietly_and_logs_once(monkeypatch, caplog):
    _register_toy(monkeypatch, probe_ok=False)
    with caplog.at_level(logging.INFO, logger="ucm.dispatch"):
        assert dispatch.call("toy", 2, 3) == 5
        assert dispatch.call("toy", 2, 3) == 5
    msgs = [r.message for r in caplog.records if "toy" in r.message]
    assert len(msgs) == 1 and "probe says no" in msgs[0]


def test_explicit_request_that_cannot_run_lists_what_is_available(monkeypatch):
    _register_toy(monkeypatch, probe_ok=False)
    with pytest.raises(dispatch.BackendUnavailableError) as e:
        dispatch.call("toy", 2, 3, backend="fast")
    text = str(e.value)
    assert "gpuonly" in text and "platform 'cpu'" in text and "probe says no" in text
    assert "reference (available)" in text
    with pytest.raises(dispatch.BackendUnavailableError, match="probed"):
        dispatch.call("toy", 2, 3, backend="probed")


def test_verifier_rejects_per_call(monkeypatch):
    _register_toy(monkeypatch, probe_ok=True,
                  verifier=lambda a, b: (a >= 0, "negative first argument unsupported"))
    assert dispatch.call("toy", 5, 3) == 2  # probed (subtract)
    assert dispatch.call("toy", -5, 3) == -2  # auto falls back to reference (add)
    with pytest.raises(dispatch.BackendUnavailableError, match="negative first argument"):
        dispatch.call("toy", -5, 3, backend="probed")


def test_probe_exception_is_contained(monkeypatch):
    monkeypatch.setattr(dispatch, "_REGISTRY", dict(dispatch._REGISTRY))
    dispatch.register("toy2", "reference", "numpy:add")
    dispatch.register("toy2", "broken", "numpy:subtract", priority=5, probe=lambda: 1 / 0)
    assert dispatch.call("toy2", 1, 1) == 2
    info = dispatch.backend_info()["ops"]["toy2"]
    assert info["selected"] == "reference"
    assert "ZeroDivisionError" in info["implementations"]["broken"]["reason"]


def test_unknown_op():
    with pytest.raises(ValueError, match="unknown op"):
        dispatch.select("no_such_op")


def test_platform_override_and_validation(monkeypatch):
    monkeypatch.setenv("UCM_PLATFORM", "cuda")
    dispatch._reset_for_tests()
    assert dispatch.detect_platform() == "cuda"
    monkeypatch.setenv("UCM_PLATFORM", "tpu")
    dispatch._reset_for_tests()
    with pytest.raises(ValueError, match="UCM_PLATFORM"):
        dispatch.detect_platform()


def test_env_backend_in_fresh_process():
    r = run_python("import ucm; i = ucm.backend_info(); print(i['ops']['hash_blocks']['selected'], "
                   "i['ops']['copy_segments']['selected'])", env={"UCM_BACKEND": "reference"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["reference", "reference"]


def test_numba_disabled_jit_still_equal(tmp_path):
    """Convention: the Numba code also runs as plain Python (NUMBA_DISABLE_JIT=1)."""
    code = ("import ucm, numpy as np; t = np.arange(200) * 7 % 1000; ns = ucm.Namespace('m','f',16);"
            "a = ucm.hash_blocks(t, ns, backend='numba'); b = ucm.hash_blocks(t, ns, backend='reference');"
            "ix = ucm.BlockIndex(5, backend='numba'); ix.insert(a, np.arange(len(a)));"
            "print(bool((a == b).all()), ix.lookup(a).tolist())")
    r = run_python(code, env={"NUMBA_DISABLE_JIT": "1"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[0] == "True" and "[-1, -1, -1, -1, -1, -1, -1, 7, 8, 9, 10, 11]" in r.stdout
