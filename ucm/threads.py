"""Where ucm's background threads run.

An engine's compute threads own some CPUs: vLLM-CPU binds its worker's main thread and its
OpenMP team to cores of its choosing, and a thread inherits the binding of the thread that starts
it. Without care, ucm's save/I/O threads (started from that main thread) land on the very cores
the forward pass is using, and each time one of them runs, an OpenMP team waits at its next
barrier for the thread it displaced.

``pool(n, name)`` is the one way ucm makes a thread pool. Its threads apply the current
placement when they start:

* ``place_beside_current_thread()`` (the vLLM connector calls it in ``register_kv_caches``, on
  the engine's bound main thread) picks the CPUs the process may use that no compute thread is
  bound to (the calling thread, and every thread of the process pinned to a subset of the CPUs:
  vLLM-CPU pins each OpenMP thread to its own core), and background threads go there;
* where there is no such CPU (the engine uses every core), background threads may run on any
  CPU the process may use, at a lower priority (nice ``+10``), so that they take the cores' idle
  time rather than compute time.

``UCM_BACKGROUND_CPUS`` overrides the choice: a list such as ``"3,5-7"`` or ``"none"`` (leave
threads alone). Errors from the OS (a sandbox that forbids affinity or priority changes) are
ignored: placement is an optimisation, never a failure.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

_lock = threading.Lock()
_cpus: frozenset | None = None   # where background threads go (None: leave the affinity alone)
_nice = 0                        # added to their nice value when they start
_ENV = "UCM_BACKGROUND_CPUS"


def _parse_list(text: str) -> set[int]:
    out: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        a, _, b = part.partition("-")
        out.update(range(int(a), int(b or a) + 1))
    return out


def allowed_cpus() -> set[int]:
    """CPUs this process may run on: the cgroup's cpuset when there is one, else all online."""
    for path in ("/sys/fs/cgroup/cpuset.cpus.effective", "/sys/fs/cgroup/cpuset/cpuset.cpus"):
        try:
            with open(path) as f:
                cpus = _parse_list(f.read().strip())
            if cpus:
                return cpus
        except (OSError, ValueError):
            pass
    return set(range(os.cpu_count() or 1))


def set_background(cpus, nice: int = 0) -> None:
    """Set the placement for background threads started from now on (``cpus=None``: keep)."""
    global _cpus, _nice
    with _lock:
        _cpus = frozenset(cpus) if cpus else None
        _nice = int(nice)


def background() -> tuple[frozenset | None, int]:
    with _lock:
        return _cpus, _nice


def compute_cpus(allowed: set[int]) -> set[int]:
    """CPUs the engine computes on: the calling thread's, plus those of every thread of this
    process bound to fewer CPUs than the process may use (vLLM-CPU binds each OpenMP thread to
    one core; the calling thread is only one of them)."""
    busy = set(os.sched_getaffinity(0))
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        tasks = []
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                line = next((x for x in f if x.startswith("Cpus_allowed_list:")), "")
            cpus = _parse_list(line.split(":", 1)[1].strip()) if line else set()
        except (OSError, ValueError):
            continue
        if cpus and cpus < allowed:
            busy |= cpus
    return busy


def place_beside_current_thread() -> tuple[frozenset | None, int]:
    """Send background threads to the CPUs the engine's compute threads (the calling thread and
    the process's pinned threads) do not use; with none left, lower their priority instead.
    Returns the placement chosen."""
    env = os.environ.get(_ENV, "").strip().lower()
    if env == "none":
        set_background(None, 0)
    elif env:
        set_background(_parse_list(env), 0)
    else:
        try:
            allowed = allowed_cpus()
            spare = allowed - compute_cpus(allowed)
        except (AttributeError, OSError):
            return background()
        # no spare CPU: any CPU (not just the one the starting thread is pinned to), lower priority
        set_background(spare, 0) if spare else set_background(allowed, 10)
    return background()


def _apply() -> None:
    cpus, nice = background()
    try:
        if cpus:
            os.sched_setaffinity(0, cpus)  # 0: the calling thread
        if nice:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(19, os.getpriority(
                os.PRIO_PROCESS, threading.get_native_id()) + nice))
    except (AttributeError, OSError, ValueError):
        pass


def pool(n: int, name: str) -> ThreadPoolExecutor:
    """A thread pool whose threads take the background placement when they start (threads start
    lazily, so a pool made before ``place_beside_current_thread`` still follows it)."""
    return ThreadPoolExecutor(max(1, int(n)), thread_name_prefix=name, initializer=_apply)
