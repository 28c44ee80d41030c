"""ucm.integration.patch(): registration with vLLM's connector factory, idempotence, unpatch,
verify_patches, UCM_DISABLE_PATCHES, the vLLM plugin entry point."""

import pytest

from conftest import require_vllm_module, run_python

require_vllm_module()

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402

import ucm.integration as integ  # noqa: E402


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv("UCM_DISABLE_PATCHES", raising=False)
    integ.unpatch()
    KVConnectorFactory._registry.pop("UCMConnector", None)
    yield
    integ.unpatch()


def test_patch_registers_and_is_idempotent():
    state = integ.patch()
    assert state["vllm_version"].startswith("0.32")
    assert state["patches"]["connector_registration"] == {"applied": True, "wanted": True}
    assert "UCMConnector" in KVConnectorFactory._registry
    integ.patch()  # a second call changes nothing and does not raise
    cls = KVConnectorFactory._registry["UCMConnector"]()
    from ucm.integration.vllm import UCMConnector

    assert cls is UCMConnector


def test_unpatch_restores():
    integ.patch()
    state = integ.unpatch()
    assert "UCMConnector" not in KVConnectorFactory._registry
    assert state["patches"]["connector_registration"]["applied"] is False


def test_disable_patches(monkeypatch):
    monkeypatch.setenv("UCM_DISABLE_PATCHES", "1")
    state = integ.patch()
    assert state["disabled"] is True
    assert "UCMConnector" not in KVConnectorFactory._registry


def test_plugin_entry_point_registers_in_a_fresh_vllm_process():
    code = ("from vllm.plugins import load_general_plugins; load_general_plugins();"
            "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory as F;"
            "print('UCMConnector' in F._registry)")
    r = run_python(code)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "True"
    r = run_python(code, env={"UCM_DISABLE_PATCHES": "1"})
    assert r.stdout.strip().splitlines()[-1] == "False"


def test_version_warning(monkeypatch, caplog):
    import logging
    import sys

    p = sys.modules["ucm.integration.patch"]  # the package's `patch` name is the function

    monkeypatch.setattr(p, "vllm_version", lambda: "0.99.0")
    monkeypatch.setattr(p, "_warned", False)
    with caplog.at_level(logging.WARNING, logger="ucm.integration"):
        p.patch()
    assert any("outside the tested range" in r.message for r in caplog.records)


def test_evict_failed_loads_wraps_and_reverts_the_scheduler_method():
    from vllm.v1.core.sched.scheduler import Scheduler

    original = Scheduler.__dict__["_handle_invalid_blocks"]
    state = integ.patch()
    assert state["patches"]["evict_failed_loads"] == {"applied": True, "wanted": True}
    assert Scheduler.__dict__["_handle_invalid_blocks"] is not original
    integ.unpatch()
    assert Scheduler.__dict__["_handle_invalid_blocks"] is original
    assert integ.verify_patches()["patches"]["evict_failed_loads"]["applied"] is False


def test_without_the_eviction_patch_a_failed_load_fails_its_request(monkeypatch, tmp_path):
    """UCM_DISABLE_PATCHES=1: vLLM would keep a block whose load failed in its prefix cache
    under the recompute policy, so the connector leaves vLLM's fail policy in place."""
    import connector_harness as H

    monkeypatch.setenv("UCM_DISABLE_PATCHES", "1")
    with H.Engine(H.store_config(tmp_path, "posix")) as e:
        assert e.scheduler.recompute_kv_load_failures is False
    monkeypatch.delenv("UCM_DISABLE_PATCHES")
    with H.Engine(H.store_config(tmp_path, "posix")) as e:
        assert e.scheduler.recompute_kv_load_failures is True
        assert integ.verify_patches()["patches"]["evict_failed_loads"]["applied"] is True


def test_inside_vllm_ucm_logs_through_vllm_and_config_errors_stop_the_engine():
    """A fresh vLLM process: after vLLM's plugins load, a ucm warning appears in vLLM's log
    format with no extra variable; a near miss of an option name stops the plugin loading (vLLM
    would not start) instead of leaving sparse attention silently off; an unrelated UCM_
    variable does not."""
    code = ("import logging; from vllm.plugins import load_general_plugins; load_general_plugins();"
            "from vllm.config.logging import LoggingConfig; from vllm.logger import configure_logging;"
            "configure_logging(LoggingConfig());"  # what each vLLM engine process does
            "logging.getLogger('ucm.test').warning('ucm-visible-%d', 42)")
    r = run_python(code, env={"UCM_HOME": "/somewhere"})  # (unrelated to ucm: a warning only)
    assert r.returncode == 0, r.stderr[-2000:]
    line = next(ln for ln in (r.stdout + r.stderr).splitlines() if "ucm-visible-42" in ln)
    assert "WARNING" in line and line.strip() != "ucm-visible-42"  # vLLM's format, not bare
    assert "UCM_HOME" in r.stdout + r.stderr
    r = run_python(code, env={"UCM_SPARSE_RATO": "0.3"})
    assert r.returncode != 0 and "UCM_SPARSE_RATIO" in r.stderr


def test_the_connectors_backend_option_applies(tmp_path):
    import connector_harness as H
    import ucm

    before = ucm.get_backend()
    try:
        with H.Engine({**H.store_config(tmp_path, "posix"), "backend": "reference"}):
            assert ucm.get_backend() == "reference"
            assert ucm.backend_info()["ops"]["hash_blocks"]["selected"] == "reference"
    finally:
        ucm.set_backend(before)
