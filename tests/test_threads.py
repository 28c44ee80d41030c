"""Background thread placement (ucm/threads.py): real threads, real affinity and priority."""
import os
import threading

import pytest

from ucm import threads

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux affinity API")


@pytest.fixture(autouse=True)
def _reset(monkeypatch):
    monkeypatch.delenv("UCM_BACKGROUND_CPUS", raising=False)
    yield
    threads.set_background(None, 0)


def _in_pool():
    with threads.pool(1, "t") as ex:
        return ex.submit(lambda: (os.sched_getaffinity(0),
                                  os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))).result()


def _from_bound_thread(cpus):
    """place_beside_current_thread() called from a thread bound to ``cpus`` (as vLLM binds its
    compute thread), and what a pool thread started afterwards gets."""
    out = {}

    def body():
        os.sched_setaffinity(0, cpus)
        out["placement"] = threads.place_beside_current_thread()
        out["pool"] = _in_pool()
    t = threading.Thread(target=body)
    t.start()
    t.join()
    return out


def test_allowed_cpus_covers_this_process():
    assert os.sched_getaffinity(0) <= threads.allowed_cpus()


def test_pool_threads_go_to_the_cpus_the_compute_thread_does_not_use():
    allowed = sorted(os.sched_getaffinity(0))
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    out = _from_bound_thread({allowed[0]})
    spare = set(allowed[1:])
    if spare:  # the usual case (CI has 2 cores): affinity, no priority change
        assert out["placement"] == (frozenset(spare), 0)
        assert out["pool"] == (spare, base)
    else:      # one CPU: same CPU, lower priority
        assert out["placement"] == (frozenset(allowed), 10)
        assert out["pool"][1] == min(19, base + 10)


def test_pinned_threads_of_the_process_count_as_compute():
    """vLLM-CPU with no reserved CPU: the main thread is pinned to one core and each other OpenMP
    thread to another; those cores are not spare."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2 or threads.allowed_cpus() != set(allowed):
        pytest.skip("needs two CPUs, all usable by this process")
    release, pinned = threading.Event(), threading.Event()

    def omp_worker():  # pinned to every CPU but the first, as long as the placement is chosen
        os.sched_setaffinity(0, set(allowed[1:]))
        pinned.set()
        release.wait()
    t = threading.Thread(target=omp_worker)
    t.start()
    pinned.wait()
    try:
        out = _from_bound_thread({allowed[0]})
    finally:
        release.set()
        t.join()
    assert out["placement"] == (frozenset(allowed), 10)
    assert out["pool"] == (set(allowed), min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10))


def test_compute_thread_on_every_cpu_lowers_background_priority_only():
    allowed = os.sched_getaffinity(0)
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    if threads.allowed_cpus() - allowed:
        pytest.skip("this process may not use every CPU of its cgroup")
    out = _from_bound_thread(allowed)
    assert out["placement"] == (frozenset(allowed), 10)
    assert out["pool"] == (allowed, min(19, base + 10))
    # the pool thread's priority is its own: the caller's is unchanged
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base


def test_environment_overrides_the_choice(monkeypatch):
    first = min(os.sched_getaffinity(0))
    monkeypatch.setenv("UCM_BACKGROUND_CPUS", f"{first}-{first}")
    assert threads.place_beside_current_thread() == (frozenset({first}), 0)
    assert _in_pool()[0] == {first}
    monkeypatch.setenv("UCM_BACKGROUND_CPUS", "none")
    assert threads.place_beside_current_thread() == (None, 0)
    assert _in_pool()[0] == os.sched_getaffinity(0)


def test_os_refusal_is_not_an_error():
    threads.set_background({10_000}, 0)  # no such CPU: sched_setaffinity fails, the thread runs
    affinity, _ = _in_pool()
    assert affinity == os.sched_getaffinity(0)
