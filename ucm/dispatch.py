"""Platform detection and the implementation registry: one place decides which code runs.

Every op has a reference implementation (readable Python/PyTorch) and zero or more fast ones
(``numba``, ``native``, ``triton`` ...). Each implementation is registered declaratively with the
platforms it supports, an availability probe, a priority and optionally a per-call verifier.

Selection order for one call of an op:

1. ``backend=`` passed to the op (strict),
2. ``ucm.set_backend(...)`` (strict),
3. the ``UCM_BACKEND`` environment variable (strict),
4. auto: the available implementation with the highest priority; quietly falls back to the
   reference (logged once per op).

A backend is ``"auto"``, ``"reference"``, ``"fast"`` (best non-reference implementation) or the
name of one implementation. A global name (2, 3) that an op does not register leaves that op on
auto; a per-call name (1) the op does not know is an error. A strict request that cannot be
honoured raises :class:`BackendUnavailableError` listing what is available and why not.
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

log = logging.getLogger("ucm.dispatch")

PLATFORMS = ("cuda", "npu", "cpu")
ALL_PLATFORMS = frozenset(PLATFORMS)
GENERIC_BACKENDS = ("auto", "reference", "fast")


class BackendUnavailableError(ValueError):
    """An explicitly requested implementation cannot run here."""


Probe = Callable[[], "tuple[bool, str]"]
Verifier = Callable[..., "tuple[bool, str]"]


@dataclass
class Impl:
    op: str
    name: str
    target: str  # "package.module:attr", imported on first use
    platforms: frozenset = ALL_PLATFORMS
    priority: int = 0
    probe: Optional[Probe] = None
    verifier: Optional[Verifier] = None
    _fn: Any = field(default=None, repr=False)
    _probe_result: Optional[tuple] = field(default=None, repr=False)

    def available(self, platform: str) -> tuple[bool, str]:
        if platform not in self.platforms:
            return False, f"not built for platform {platform!r} (supports {sorted(self.platforms)})"
        if self._probe_result is None:
            if self.probe is None:
                self._probe_result = (True, "always available")
            else:
                try:
                    self._probe_result = tuple(self.probe())
                except Exception as exc:  # a probe must never break dispatch
                    self._probe_result = (False, f"probe failed: {exc!r}")
        return self._probe_result

    def load(self) -> Any:
        if self._fn is None:
            module, _, attr = self.target.partition(":")
            self._fn = getattr(importlib.import_module(module), attr)
        return self._fn


_REGISTRY: dict[str, list[Impl]] = {}
_lock = threading.Lock()
_global_backend: Optional[str] = None
_platform: Optional[str] = None
_fallback_logged: set = set()


def register(op: str, name: str, target: str, *, platforms=ALL_PLATFORMS, priority: int = 0,
             probe: Optional[Probe] = None, verifier: Optional[Verifier] = None) -> None:
    """Register one implementation of ``op``. The reference must be named ``"reference"``."""
    if name in GENERIC_BACKENDS and name != "reference":
        raise ValueError(f"implementation name {name!r} is reserved")
    impl = Impl(op, name, target, frozenset(platforms), priority, probe, verifier)
    with _lock:
        impls = [i for i in _REGISTRY.get(op, []) if i.name != name]
        impls.append(impl)
        impls.sort(key=lambda i: -i.priority)
        _REGISTRY[op] = impls


@dataclass(frozen=True)
class ImplSpec:
    """One row of an op family's table of implementations: ``target`` names the callable as
    ``"package.module:attr"``, where ``{op}`` stands for the op's name."""
    name: str
    target: str
    priority: int = 0
    platforms: frozenset = ALL_PLATFORMS
    probe: Optional[Probe] = None
    verifier: Optional[Verifier] = None


def register_table(ops: "tuple[str, ...] | list[str]", table) -> None:
    """Register every row of ``table`` (:class:`ImplSpec`) for every op of ``ops``."""
    for op in ops:
        for spec in table:
            register(op, spec.name, spec.target.format(op=op), platforms=spec.platforms,
                     priority=spec.priority, probe=spec.probe, verifier=spec.verifier)


def ops() -> list[str]:
    return sorted(_REGISTRY)


def implementations(op: str) -> list[Impl]:
    try:
        return list(_REGISTRY[op])
    except KeyError:
        raise ValueError(f"unknown op {op!r}; known ops: {ops()}") from None


# ---------------------------------------------------------------------------------------------
# platform

def detect_platform() -> str:
    """``"cuda"`` if torch sees a CUDA device, ``"npu"`` if ``torch_npu`` sees an Ascend NPU,
    else ``"cpu"``. torch is optional: without it the platform is ``"cpu"``."""
    global _platform
    if _platform is None:
        _platform = _detect()
    return _platform


def _accelerator_device_files() -> bool:
    """Device nodes of an NVIDIA GPU or an Ascend NPU (cheap check before importing torch)."""
    import glob

    return bool(glob.glob("/dev/nvidia[0-9]*") or glob.glob("/dev/nvidiactl")
                or glob.glob("/dev/davinci[0-9]*") or os.environ.get("CUDA_VISIBLE_DEVICES"))


def _detect() -> str:
    forced = os.environ.get("UCM_PLATFORM")
    if forced:
        if forced not in PLATFORMS:
            raise ValueError(f"UCM_PLATFORM={forced!r}: expected one of {list(PLATFORMS)}")
        return forced
    if importlib.util.find_spec("torch") is None:
        return "cpu"
    if "torch" not in sys.modules and not _accelerator_device_files():
        return "cpu"  # importing torch (about a second) only to learn there is no device
    try:
        import torch

        if torch.cuda.is_available():
            return "cuda"
        if importlib.util.find_spec("torch_npu") is not None:
            import torch_npu  # noqa: F401  (registers torch.npu)

            if torch.npu.is_available():
                return "npu"
    except Exception as exc:  # broken driver installs must not break import
        log.warning("ucm: platform detection failed (%r); using cpu", exc)
    return "cpu"


# ---------------------------------------------------------------------------------------------
# backend selection

def _check_backend_name(name: str, where: str) -> str:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: backend must be a non-empty string, got {name!r}")
    known = set(GENERIC_BACKENDS) | {i.name for impls in _REGISTRY.values() for i in impls}
    if name not in known:
        raise ValueError(f"{where}: unknown backend {name!r}; expected one of {sorted(known)}")
    return name


def set_backend(name: Optional[str]) -> None:
    """Set the process-wide backend (``None`` or ``"auto"`` restores automatic selection)."""
    global _global_backend
    _global_backend = None if name in (None, "auto") else _check_backend_name(name, "set_backend")


def get_backend() -> str:
    return _global_backend or "auto"


def _requested(op: str, backend: Optional[str]) -> tuple[str, str]:
    """(backend name, source) with per-call > set_backend > UCM_BACKEND > auto."""
    if backend is not None:
        return _check_backend_name(backend, f"{op}(backend=...)"), "argument"
    names = {i.name for i in _REGISTRY.get(op, [])}
    for value, source in ((_global_backend, "set_backend"), (os.environ.get("UCM_BACKEND"), "UCM_BACKEND")):
        if value and value != "auto":
            _check_backend_name(value, source)
            if value in GENERIC_BACKENDS or value in names:
                return value, source
            return "auto", f"{source}={value} (not an implementation of {op}; auto)"
    return "auto", "auto"


def _describe(op: str, platform: str) -> str:
    parts = []
    for impl in _REGISTRY.get(op, []):
        ok, why = impl.available(platform)
        parts.append(f"{impl.name} ({'available' if ok else 'unavailable: ' + why})")
    return ", ".join(parts)


def select(op: str, backend: Optional[str] = None, args: tuple = (), kwargs: Optional[dict] = None
           ) -> tuple[Impl, str]:
    """Choose the implementation of ``op`` for a call with these arguments: ``(impl, reason)``."""
    impls = implementations(op)
    platform = detect_platform()
    name, source = _requested(op, backend)
    strict = name != "auto"
    kwargs = kwargs or {}

    if name == "reference":
        candidates = [i for i in impls if i.name == "reference"]
    elif name == "fast":
        candidates = [i for i in impls if i.name != "reference"]
    elif name == "auto":
        candidates = impls
    else:
        candidates = [i for i in impls if i.name == name]
        if not candidates:
            raise BackendUnavailableError(
                f"{op}: backend {name!r} ({source}) is not an implementation of this op; "
                f"implementations: {[i.name for i in impls]}")

    rejected = []
    for impl in candidates:
        ok, why = impl.available(platform)
        if ok and impl.verifier is not None and (args or kwargs):
            ok, why = impl.verifier(*args, **kwargs)
        if ok:
            if not strict and impl.name == "reference" and len(impls) > 1 and op not in _fallback_logged:
                _fallback_logged.add(op)
                log.info("ucm: %s uses the reference implementation (%s)", op, "; ".join(rejected))
            if strict:
                reason = f"{source}: {why}"
            else:
                reason = f"auto: highest-priority available ({why})"
                if source != "auto":
                    reason = f"{source}; {reason}"
            return impl, reason
        rejected.append(f"{impl.name}: {why}")

    raise BackendUnavailableError(
        f"{op}: backend {name!r} requested by {source} cannot be used on platform {platform!r}: "
        f"{'; '.join(rejected) or 'no candidates'}. Implementations: {_describe(op, platform)}")


def call(op: str, *args, backend: Optional[str] = None, **kwargs):
    impl, _ = select(op, backend, args, kwargs)
    return impl.load()(*args, **kwargs)


def backend_info() -> dict:
    """Platform, the requested backend and, per op, the chosen implementation and why."""
    platform = detect_platform()
    info = {"platform": platform, "backend": get_backend(),
            "env_backend": os.environ.get("UCM_BACKEND"), "ops": {}}
    for op in ops():
        entry = {"implementations": {}}
        for impl in _REGISTRY[op]:
            ok, why = impl.available(platform)
            entry["implementations"][impl.name] = {"available": ok, "priority": impl.priority,
                                                   "reason": why}
        try:
            impl, reason = select(op)
            entry["selected"], entry["reason"] = impl.name, reason
        except BackendUnavailableError as exc:
            entry["selected"], entry["reason"] = None, str(exc)
        info["ops"][op] = entry
    return info


def _reset_for_tests() -> None:
    """Forget cached probes, platform and the global backend (tests only)."""
    global _platform, _global_backend
    _platform = None
    _global_backend = None
    _fallback_logged.clear()
    for impls in _REGISTRY.values():
        for impl in impls:
            impl._probe_result = None
