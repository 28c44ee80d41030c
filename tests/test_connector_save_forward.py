"""Saves during the forward (``connector.save_during_forward``): the worker's save path
(:class:`ucm.integration.vllm.worker_save.WorkerSave`), no engine and no vLLM.

vLLM reports each layer done through ``save_kv_layer`` (``layer_done``); with background saves
the save path then copies that layer's part of the step's new blocks out on the save thread while
the forward goes on, and ``wait_for_save`` (``end_step``) only queues the rest and the commit.
Checked here with real CPU caches in vLLM-CPU's layout, a real memory|posix store in a temporary
folder and the real save thread: what the store holds equals the cache bytes of every layer, the
layer jobs run before ``end_step`` (a layer changed in the cache after its hook keeps the bytes it
had then), a step whose hooks miss some layers still stores whole blocks, and the first step
(before vLLM was seen calling the hook for every layer) saves at the end of the step as before.
The engine-level check (token-identical outputs, hits after a restart) is ``test_vllm_e2e.py``.
"""
import time

import numpy as np
import torch

import ucm
from ucm.config import Config
from ucm.integration.vllm.records import Transfer
from ucm.integration.core import WorkerCore
from ucm.integration.vllm.worker_save import WorkerSave
from ucm.store import open_store

L, NB, BS, H, D = 4, 12, 8, 2, 16


def _worker(tmp_path):
    """A worker's save path over real caches and a real store, as register_kv_caches would
    build it."""
    g = torch.Generator().manual_seed(5)
    caches = {f"model.layers.{k}.self_attn.attn":
              torch.randn(2, NB, H, BS, D, generator=g).to(torch.bfloat16) for k in range(L)}
    names = list(caches)
    cfg = Config({"store.pipeline": "memory|posix", "store.posix.roots": [str(tmp_path)]})
    layout = ucm.KVLayout.from_views([v for n in names for v in caches[n].unbind(0)],
                                     layer_of_view=[k for k in range(L) for _ in range(2)])
    bb = layout.block_bytes
    shard = layout.shard_bytes(0)
    assert shard * L == bb
    store = open_store(cfg, block_bytes=bb, shard_bytes=shard, namespace=b"save-forward-tst")
    core = WorkerCore(layout, store, "cpu", shard_bytes=shard)
    c = WorkerSave(core, background=True, during_forward=True)
    assert c.during
    return c, caches, names


def _ids(blocks, salt):
    return np.array([[salt, b] for b in blocks], dtype=np.uint64)


def _step(c, caches, names, blocks, salt, hooks=None, after_hook=None):
    """One step that saves ``blocks`` (vLLM block numbers): begin, the layer hooks (``hooks``:
    which layers report, default all), end."""
    c.begin_step([Transfer("r", _ids(blocks, salt), list(blocks))])
    for k, name in enumerate(names):
        if hooks is None or k in hooks:
            c.layer_done(k)
            if after_hook is not None:
                after_hook(k)
    assert c.end_step()
    c.clear_step()
    assert c.drain(timeout=10)


def _stored(c, blocks, salt):
    ids = _ids(blocks, salt)
    rows = torch.zeros(len(blocks), c.core.block_bytes, dtype=torch.uint8)
    r = c.core.store.wait(c.core.store.load(ids, 0, rows))
    return r.ok, rows


def _cache_rows(c, blocks):
    rows = torch.zeros(len(blocks), c.core.block_bytes, dtype=torch.uint8)
    ucm.gather_blocks(c.core.layout, torch.tensor(blocks), rows, backend="reference")
    return rows


def test_layers_saved_during_the_forward(tmp_path):
    c, caches, names = _worker(tmp_path)
    counters, shard = c.core.metrics, c.core.shard
    try:
        _step(c, caches, names, [3, 7], salt=1)       # first step: hooks not yet seen
        assert c.lsave_ok and counters.get("ucm_saves_during_forward_total") == 0
        ok, rows = _stored(c, [3, 7], 1)
        assert ok.all() and torch.equal(rows, _cache_rows(c, [3, 7]))

        before = {}
        changed = []

        def overwrite(k):  # once layer k is copied out, change the cache: the store keeps the old bytes
            deadline = time.time() + 10   # (one save thread, layers in order: k's dump is task k)
            while len(c._lsave.tasks) <= k and time.time() < deadline:
                time.sleep(0.001)
            before[k] = _cache_rows(c, [1, 5, 9])
            caches[names[k]][:, [1, 5, 9]] += 1.0
            changed.append(k)
        _step(c, caches, names, [1, 5, 9], salt=2, after_hook=overwrite)
        assert counters.get("ucm_saves_during_forward_total") == 1 and changed == list(range(L))
        ok, rows = _stored(c, [1, 5, 9], 2)
        assert ok.all()
        for k in range(L):   # each layer's part is what the cache held right after its hook
            lo, hi = k * shard, (k + 1) * shard
            assert torch.equal(rows[:, lo:hi], before[k][:, lo:hi]), k
        assert not torch.equal(rows, _cache_rows(c, [1, 5, 9]))   # the overwrite was real

        _step(c, caches, names, [0, 11], salt=3, hooks={0, 2})  # hooks for two layers only
        ok, rows = _stored(c, [0, 11], 3)
        assert ok.all() and torch.equal(rows, _cache_rows(c, [0, 11]))
        assert counters.get("ucm_saves_during_forward_total") == 2
        assert counters.get("ucm_save_blocks_total") == 7 and counters.get("ucm_save_failed_blocks_total") == 0
        assert c._jobs_in_flight == 0 and not c._req_jobs.get("r")
        assert len(c.core.staging) >= 1         # the staging came back to the pool
    finally:
        c.shutdown()
        c.core.store.close()


def test_steps_without_saves_cost_no_job(tmp_path):
    """Decode steps with nothing to save: one metadata check in the first hook, no job."""
    c, caches, names = _worker(tmp_path)
    try:
        _step(c, caches, names, [2], salt=4)          # learns the hooks
        c.begin_step([])
        for k in range(L):
            c.layer_done(k)
            assert c._lsave is False
        c.end_step()
        assert c._lsave is None and c.core.metrics.get("ucm_saves_during_forward_total") == 0
    finally:
        c.shutdown()
        c.core.store.close()
