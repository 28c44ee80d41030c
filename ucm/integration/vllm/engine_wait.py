"""The engine core's wait for its worker's results, made to sleep instead of spin (CPU engines).

vLLM 0.32's multiprocess executor hands each step to the worker process over a shared-memory
ring buffer and reads the result back from another one. The engine core process, while the
worker computes, polls that buffer in a loop that calls ``sched_yield()`` for up to one second
after every read (``SpinCondition.wait`` in ``vllm/distributed/device_communicators/
shm_broadcast.py``). On a GPU that costs a CPU nobody needs. On a CPU engine the worker's compute
threads are bound to most cores and the rest are where everything else runs, ucm's overlapped
copy of loaded blocks among it: the spinning engine core takes that CPU for the whole forward
(measured on a 2-core VM: the background copy took 33-97 ms instead of 13; benchmarks/RESULTS.md).

With this patch the reader, inside vLLM's busy window, sleeps ``poll_us`` microseconds per check
instead of yielding, leaving the CPU to other threads. Outside the busy window vLLM's own code
runs unchanged (it waits on its notification socket). The sleep adds on average half a poll
period to each step's hand-back: ~0.1 ms against the 20-100 ms steps of a CPU engine.
Same-engine A/B on the 2-core VM (warm 4,000-token prompt, requests alternating; RESULTS.md):
warm TTFT 0.87-0.90x with the patch.

The UCM connector applies it in its scheduler process (the engine core) when
``connector.engine_poll_us`` > 0 and the engine runs on CPU; other processes and engines are
left alone. :func:`ucm.integration.verify_patches` reports it as ``engine_wait``;
:func:`ucm.integration.unpatch` restores vLLM's method.
"""
from __future__ import annotations

import importlib
import logging
import time

log = logging.getLogger("ucm.integration")

PATCH_NAME = "engine_wait"

_state = {"poll_s": 0.0, "original": None}


def _spin_condition():
    try:
        from vllm.distributed.device_communicators import shm_broadcast
    except Exception:  # (another vLLM layout: nothing to patch)
        return None
    cls = getattr(shm_broadcast, "SpinCondition", None)
    return cls if cls is not None and hasattr(cls, "wait") else None


def _quiet_wait(self, timeout_ms=None):
    if (self.is_reader and _state["poll_s"] > 0
            and time.monotonic() <= self.last_read + self.busy_loop_s):
        time.sleep(_state["poll_s"])  # (vLLM: sched_yield(); the caller re-checks the buffer)
        return
    return _state["original"](self, timeout_ms)


def _apply() -> None:
    cls = _spin_condition()
    if cls is None or cls.wait is _quiet_wait:
        return
    init = getattr(getattr(cls, "__init__", None), "__code__", None)
    if init is None or not {"is_reader", "last_read", "busy_loop_s"} <= set(init.co_names):
        log.warning("ucm: vLLM's SpinCondition has changed; the engine wait is left as it is")
        return
    _state["original"] = cls.wait
    cls.wait = _quiet_wait


def _revert() -> None:
    cls = _spin_condition()
    if cls is not None and cls.wait is _quiet_wait and _state["original"] is not None:
        cls.wait = _state["original"]


def _check() -> bool:
    cls = _spin_condition()
    return cls is not None and cls.wait is _quiet_wait


def _wanted() -> bool:
    return _state["poll_s"] > 0


def enable(poll_us: float) -> bool:
    """Apply the patch in this process with a poll period of ``poll_us`` microseconds (0 or less:
    leave vLLM's spin). True when the patch is in place afterwards."""
    _state["poll_s"] = max(0.0, float(poll_us)) * 1e-6
    patch_mod = importlib.import_module("ucm.integration.patch")  # (the package exports patch())
    return patch_mod.apply_patch(PATCH_NAME)


def _register() -> None:
    from ucm.integration.patch import register_patch

    register_patch(PATCH_NAME, _apply, _revert, _check, _wanted)


_register()
