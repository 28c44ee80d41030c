"""Background thread placement (ucm/threads.py): real threads, real affinity."""
import os
import threading

import pytest

from ucm import threads

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux affinity API")


@pytest.fixture(autouse=True)
def _reset(monkeypatch):
    monkeypatch.delenv("UCM_BACKGROUND_CPUS", raising=False)
    yield
    threads.set_background(None)


def _in_pool():
    with threads.pool(1, "t") as ex:
        return ex.submit(lambda: os.sched_getaffinity(0)).result()


def _from_bound_thread(cpus):
    """place_beside_current_thread() called from a thread bound to ``cpus`` (as vLLM binds its
    compute thread), and the affinity a pool thread started from there gets."""
    out = {}

    def body():
        os.sched_setaffinity(0, cpus)
        out["placement"] = threads.place_beside_current_thread()
        out["pool"] = _in_pool()
    t = threading.Thread(target=body)
    t.start()
    t.join()
    return out


def _all_usable():
    allowed = sorted(os.sched_getaffinity(0))
    if threads.allowed_cpus() != set(allowed):
        pytest.skip("this process may not use every CPU of its cgroup")
    return allowed


def test_allowed_cpus_covers_this_process():
    assert os.sched_getaffinity(0) <= threads.allowed_cpus()


def test_pool_threads_go_to_the_cpus_the_compute_thread_does_not_use():
    allowed = _all_usable()
    out = _from_bound_thread({allowed[0]})
    expect = set(allowed[1:]) or set(allowed)  # one CPU: it is the only choice
    assert out["placement"] == frozenset(expect)
    assert out["pool"] == expect


def test_pinned_threads_of_the_process_count_as_compute():
    """vLLM-CPU with no reserved CPU: the main thread is pinned to one core and each other OpenMP
    thread to another; none is spare, so background threads may use every CPU (not only the
    starting thread's)."""
    allowed = _all_usable()
    if len(allowed) < 2:
        pytest.skip("needs two CPUs")
    release, pinned = threading.Event(), threading.Event()

    def omp_worker():  # pinned to every CPU but the first while the placement is chosen
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
    assert out["placement"] == frozenset(allowed)
    assert out["pool"] == set(allowed)


def test_environment_overrides_the_choice(monkeypatch):
    first = min(os.sched_getaffinity(0))
    monkeypatch.setenv("UCM_BACKGROUND_CPUS", f"{first}-{first}")
    assert threads.place_beside_current_thread() == frozenset({first})
    assert _in_pool() == {first}
    monkeypatch.setenv("UCM_BACKGROUND_CPUS", "none")
    assert threads.place_beside_current_thread() is None
    assert _in_pool() == os.sched_getaffinity(0)
    # a ucm variable, not a config option: the configuration accepts it; a bad list is a clear error
    from ucm.config import Config
    assert Config.load()["sparse_method"] == "none"
    monkeypatch.setenv("UCM_BACKGROUND_CPUS", "two")
    with pytest.raises(ValueError, match="UCM_BACKGROUND_CPUS"):
        threads.place_beside_current_thread()


def test_os_refusal_is_not_an_error():
    threads.set_background({10_000})  # no such CPU: sched_setaffinity fails, the thread runs
    assert _in_pool() == os.sched_getaffinity(0)
