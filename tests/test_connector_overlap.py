"""Overlapped loads of the vLLM connector (``connector.overlap_load``): the worker's load path
(:class:`ucm.integration.vllm.worker_load.WorkerLoad`), no engine and no vLLM.

The copy of a step's loaded blocks into the paged cache runs layer by layer on the load thread;
``wait_layer(k)`` (vLLM's ``wait_for_layer_load``) must return only once that layer's blocks are
in the cache. The copy thread is slowed down here (a delay before each layer's copy: timing
cannot be forced otherwise, so this is the one simulated part) so that a missing wait fails
deterministically. Real parts: the load path over real CPU caches in vLLM-CPU's layout, the real
native/reference copies, a real background thread. The engine-level check (token-identical
outputs with overlapped loads, counters) is in ``test_vllm_e2e.py``.
"""
import threading
import time

import numpy as np
import torch

import ucm
from ucm.integration.core import WorkerCore
from ucm.integration.vllm.worker_load import WorkerLoad

L, NB, BS, H, D = 4, 10, 8, 2, 16
DELAY = 0.03


def _worker(monkeypatch, hook_seen=True):
    """A worker's load path over real caches (vLLM-CPU layout [2, blocks, heads, bs, d]), no
    store (the tests hand it staged rows), as register_kv_caches would build it."""
    caches = {f"model.layers.{k}.self_attn.attn": torch.zeros(2, NB, H, BS, D, dtype=torch.bfloat16)
              for k in range(L)}
    names = list(caches)
    core = WorkerCore(_layout([caches[n] for n in names]), None, "cpu")
    load = WorkerLoad(core, overlap=True, spare_cpu=True)
    load.hook_ok = hook_seen
    real = WorkerLoad._scatter_layer

    def slow(self, ov, k):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(DELAY)  # the copy thread lags behind the forward
        return real(self, ov, k)

    monkeypatch.setattr(WorkerLoad, "_scatter_layer", slow)
    return load, caches, names


def _same(a, b):
    """Bitwise equality (random bytes make NaNs, which torch.equal calls different)."""
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def _layout(per_layer):
    """K and V of each layer as two views (``kv.unbind(0)``), layer by layer."""
    return ucm.KVLayout.from_views([v for kv in per_layer for v in kv.unbind(0)],
                                   layer_of_view=[k for k in range(len(per_layer)) for _ in range(2)])


def _rows(n):
    g = torch.Generator().manual_seed(n)
    return torch.randint(0, 256, (n, 2 * H * BS * D * 2 * L), generator=g, dtype=torch.uint8)


def _expected(layout, src, idx):
    want = {k: torch.zeros(2, NB, H, BS, D, dtype=torch.bfloat16) for k in range(L)}
    ucm.scatter_blocks(_layout([want[k] for k in range(L)]), src, idx, backend="reference")
    return want


def test_each_layer_is_in_the_cache_when_its_wait_returns(monkeypatch):
    c, caches, names = _worker(monkeypatch)
    src = _rows(5)
    idx = torch.tensor([7, 2, -1, 4, 9])
    tails = np.array([False, False, False, False, True])  # the last row: a partial tail block
    assert src.shape[1] == c.core.layout.block_bytes
    want = _expected(c.core.layout, src, idx)
    released = []
    assert c._scatter_overlapped(src, idx, tails, lambda: released.append(1))
    # the tail block is complete in every layer before the forward starts (vLLM writes the
    # step's new token into it before the attention's wait)
    for k in range(L):
        assert _same(caches[names[k]][:, 9], want[k][:, 9]), k
    for k in range(L):
        c.wait_layer(k)
        assert _same(caches[names[k]], want[k]), f"layer {k} read before its copy ended"
    assert not released  # the source (memory-tier rows) stays held until the step ends
    c.finish_overlap()
    assert released == [1] and c._ov is None
    assert c.core.metrics.get("ucm_overlapped_load_blocks_total") == 3  # 4 blocks, the tail copied at once
    c.shutdown()


def test_a_failed_background_copy_is_redone_before_the_layer_is_read(monkeypatch):
    c, caches, names = _worker(monkeypatch)
    real = WorkerLoad._scatter_layer
    calls = []

    def flaky(self, ov, k):
        calls.append((threading.current_thread() is threading.main_thread(), k))
        if k == 2 and threading.current_thread() is not threading.main_thread():
            raise RuntimeError("copy failed")  # simulated: a memcpy does not fail on its own
        return real(self, ov, k)

    monkeypatch.setattr(WorkerLoad, "_scatter_layer", flaky)
    src, idx = _rows(3), torch.tensor([1, 5, 3])
    want = _expected(c.core.layout, src, idx)
    assert c._scatter_overlapped(src, idx, np.zeros(3, dtype=bool), None)
    for k, name in enumerate(names):
        c.wait_layer(k)
        assert _same(caches[name], want[k])
    c.finish_overlap()
    assert (True, 2) in calls  # redone on the engine's thread
    c.shutdown()


def test_an_unknown_layer_waits_for_every_layer_and_the_step_end_waits_for_the_rest(monkeypatch):
    c, caches, names = _worker(monkeypatch)
    src, idx = _rows(2), torch.tensor([0, 6])
    want = _expected(c.core.layout, src, idx)
    assert c._scatter_overlapped(src, idx, np.zeros(2, dtype=bool), None)
    c.wait_layer(None)  # a layer the caches do not know ("model.layers.99.cross_attn")
    for k, name in enumerate(names):
        assert _same(caches[name], want[k])
    c.finish_overlap()
    # a step whose forward waited for no layer at all: the step end still completes the copy,
    # and the connector stops overlapping (the engine no longer calls the hook)
    assert c._scatter_overlapped(_rows(2), torch.tensor([3, 8]), np.zeros(2, dtype=bool), None)
    c.finish_overlap()
    assert c.overlap is False
    assert not c._scatter_overlapped(_rows(2), torch.tensor([3, 8]), np.zeros(2, dtype=bool), None)
    c.shutdown()


def test_no_overlap_before_the_engine_was_seen_waiting_per_layer(monkeypatch):
    c, _, _ = _worker(monkeypatch, hook_seen=False)
    assert not c._scatter_overlapped(_rows(1), torch.tensor([1]), np.zeros(1, dtype=bool), None)
    assert c._ov is None and c._executor is None


def test_no_overlap_without_a_cpu_beside_the_compute(monkeypatch):
    """With every CPU computing (no reserved CPU), the copy would take the forward's cores."""
    c, _, _ = _worker(monkeypatch)
    c.spare_cpu = False
    assert not c._scatter_overlapped(_rows(1), torch.tensor([1]), np.zeros(1, dtype=bool), None)
    from ucm import threads
    busy = threads.compute_cpus(threads.allowed_cpus())
    assert not threads.beside_compute(busy) and not threads.beside_compute(None)
    spare = threads.allowed_cpus() - busy
    assert threads.beside_compute(spare) == bool(spare)
