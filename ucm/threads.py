"""Where ucm's background threads run.

An engine's compute threads own some CPUs: vLLM-CPU binds its worker's main thread and its
OpenMP team to cores of its choosing, and a thread inherits the binding of the thread that starts
it. Without care, ucm's save/I/O threads (started from that main thread) land on the very core
the main thread computes on, and each time one of them runs, the OpenMP team waits at its next
barrier for the thread it displaced.

``pool(n, name)`` is the one way ucm makes a thread pool. Its threads take the current placement
when they start (threads start lazily, so a pool made earlier still follows it):

* ``place_beside_current_thread()`` (the vLLM connector calls it in ``register_kv_caches``, on
  the engine's bound main thread) picks the CPUs the process may use that no compute thread is
  bound to: the calling thread's, and those of every thread of the process pinned to a subset of
  the CPUs (vLLM-CPU pins each OpenMP thread to its own core). Background threads go there.
* Where no CPU is left (no CPU reserved: the engine computes on every core), background threads
  may run on any CPU of the process rather than only on the starting thread's core. Their work
  then takes compute time; a lower priority was measured and did not help (the saves took 5-10x
  longer for the same slowdown, ``benchmarks/RESULTS.md``).

``UCM_BACKGROUND_CPUS`` overrides the choice: a list such as ``"3,5-7"``, or ``"none"`` (leave
threads where they start). Errors from the OS (a sandbox that forbids affinity changes) are
ignored: placement is an optimisation, never a failure.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

_lock = threading.Lock()
_cpus: frozenset | None = None   # where background threads go (None: where they start)
_ENV = "UCM_BACKGROUND_CPUS"


def parse_cpu_list(text: str) -> set[int]:
    """CPU ids of a Linux CPU list such as ``"0-3,8"``."""
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
                cpus = parse_cpu_list(f.read().strip())
            if cpus:
                return cpus
        except (OSError, ValueError):
            pass
    return set(range(os.cpu_count() or 1))


def set_background(cpus) -> None:
    """Set the CPUs of background threads started from now on (``None``: where they start)."""
    global _cpus
    with _lock:
        _cpus = frozenset(cpus) if cpus else None


def background() -> frozenset | None:
    with _lock:
        return _cpus


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
            cpus = parse_cpu_list(line.split(":", 1)[1].strip()) if line else set()
        except (OSError, ValueError):
            continue
        if cpus and cpus < allowed:
            busy |= cpus
    return busy


def place_beside_current_thread() -> frozenset | None:
    """Send background threads to the CPUs the engine's compute threads (the calling thread and
    the process's pinned threads) do not use, or to every CPU of the process where none is left.
    Returns the placement chosen."""
    env = os.environ.get(_ENV, "").strip().lower()
    if env == "none":
        set_background(None)
    elif env:
        try:
            cpus = parse_cpu_list(env)
        except ValueError:
            raise ValueError(f"{_ENV}: expected a CPU list such as '3,5-7', or 'none'; got "
                             f"{os.environ[_ENV]!r}") from None
        set_background(cpus)
    else:
        try:
            allowed = allowed_cpus()
            spare = allowed - compute_cpus(allowed)
        except (AttributeError, OSError):
            return background()
        set_background(spare or allowed)
    return background()


def beside_compute(cpus) -> bool:
    """Whether the placement ``cpus`` shares no CPU with the engine's compute threads (so work
    on it runs in parallel with the compute rather than in its place)."""
    if not cpus:
        return False
    try:
        return not (set(cpus) & compute_cpus(allowed_cpus()))
    except (AttributeError, OSError):
        return False


def _apply() -> None:
    cpus = background()
    try:
        if cpus:
            os.sched_setaffinity(0, cpus)  # 0: the calling thread
    except (AttributeError, OSError, ValueError):
        pass


def pool(n: int, name: str) -> ThreadPoolExecutor:
    """A thread pool whose threads take the background placement when they start."""
    return ThreadPoolExecutor(max(1, int(n)), thread_name_prefix=name, initializer=_apply)


def default_threads() -> int:
    """Threads of one native copy call: the core count, at most 16."""
    return max(1, min(os.cpu_count() or 1, 16))
