"""Saves during the forward (``connector.save_during_forward``), worker side, no engine.

vLLM reports each layer done through ``save_kv_layer``; with background saves the connector
then copies that layer's part of the step's new blocks out on the save thread while the forward
goes on, and ``wait_for_save`` only queues the rest and the commit. Checked here with real CPU
caches in vLLM-CPU's layout, a real memory|posix store in a temporary folder and the real save
thread: what the store holds equals the cache bytes of every layer, the layer jobs run before
``wait_for_save`` (a layer changed in the cache after its hook keeps the bytes it had then),
a step whose hooks miss some layers still stores whole blocks, and the first step (before vLLM
was seen calling the hook for every layer) saves at the end of the step as before. The
engine-level check (token-identical outputs, hits after a restart) is ``test_vllm_e2e.py``.
"""
import threading
import time

import numpy as np
import pytest
import torch

from conftest import require_vllm_module

pytestmark = [pytest.mark.vllm]

require_vllm_module()

import ucm  # noqa: E402
from ucm.config import Config  # noqa: E402
from ucm.integration.vllm import connector as conn, keys  # noqa: E402
from ucm.store import open_store  # noqa: E402

L, NB, BS, H, D = 4, 12, 8, 2, 16


def _worker(tmp_path):
    """A connector's worker half over real caches and a real store: only the state the save
    path reads (what register_kv_caches would set up)."""
    g = torch.Generator().manual_seed(5)
    caches = {f"model.layers.{k}.self_attn.attn":
              torch.randn(2, NB, H, BS, D, generator=g).to(torch.bfloat16) for k in range(L)}
    c = object.__new__(conn.UCMConnector)
    c.cfg = Config({"store.pipeline": "memory|posix", "store.posix.roots": [str(tmp_path)]})
    c._layer_names = list(caches)
    c._layer_index = {n: k for k, n in enumerate(c._layer_names)}
    c.layout = ucm.KVLayout.from_views([v for n in c._layer_names for v in caches[n].unbind(0)],
                                       layer_of_view=[k for k in range(L) for _ in range(2)])
    bb = c.layout.block_bytes
    c._shard = c.layout.shard_bytes(0)
    assert c._shard * L == bb
    c._device = torch.device("cpu")
    c.shape, c._rank = keys.ParallelShape(), 0
    c.store = open_store(c.cfg, block_bytes=bb, shard_bytes=c._shard, namespace=b"save-forward-tst")
    c._async, c._during, c._layerwise = True, True, False
    c._lsave, c._lsave_seen, c._lsave_ok = None, set(), False
    c._lock = threading.Lock()
    c._jobs_done = threading.Condition(c._lock)
    c._executor, c._jobs_in_flight, c._req_jobs, c._finishing = None, 0, {}, set()
    c._free_staging, c._staging = [], None
    c._counters = {k: 0 for k in ("save_blocks", "save_failed", "save_bytes", "save_tail_blocks",
                                  "saves_during_forward", "steps")}
    c._counters.update(save_s=0.0, gather_s=0.0, forward_s=0.0)
    c._forward_t0, c._ov, c._hooked, c._hook_ok, c._stats_file = None, None, set(), True, ""
    c._connector_metadata = None
    return c, caches


def _ids(blocks, salt):
    return np.array([[salt, b] for b in blocks], dtype=np.uint64)


def _step(c, caches, blocks, salt, hooks=None, after_hook=None):
    """One step that saves ``blocks`` (vLLM block numbers): bind, the layer hooks (``hooks``:
    which layers report, default all), wait_for_save."""
    meta = conn.UCMConnectorMetadata(saves=[conn.Transfer("r", _ids(blocks, salt), list(blocks))])
    c.bind_connector_metadata(meta)
    for k, name in enumerate(c._layer_names):
        if hooks is None or k in hooks:
            c.save_kv_layer(name, caches[name], None)
            if after_hook is not None:
                after_hook(k)
    c.wait_for_save()
    c.clear_connector_metadata()
    assert c._drain(timeout=10)


def _stored(c, blocks, salt):
    ids = _ids(blocks, salt)
    rows = torch.zeros(len(blocks), c.layout.block_bytes, dtype=torch.uint8)
    r = c.store.wait(c.store.load(ids, 0, rows))
    return r.ok, rows


def _cache_rows(c, blocks):
    rows = torch.zeros(len(blocks), c.layout.block_bytes, dtype=torch.uint8)
    ucm.gather_blocks(c.layout, torch.tensor(blocks), rows, backend="reference")
    return rows


def test_layers_saved_during_the_forward(tmp_path):
    c, caches = _worker(tmp_path)
    try:
        _step(c, caches, [3, 7], salt=1)              # first step: hooks not yet seen
        assert c._lsave_ok and c._counters["saves_during_forward"] == 0
        ok, rows = _stored(c, [3, 7], 1)
        assert ok.all() and torch.equal(rows, _cache_rows(c, [3, 7]))

        before = {}
        changed = []

        def overwrite(k):  # once layer k is copied out, change the cache: the store keeps the old bytes
            deadline = time.time() + 10   # (one save thread, layers in order: k's dump is task k)
            while len(c._lsave["tasks"]) <= k and time.time() < deadline:
                time.sleep(0.001)
            before[k] = _cache_rows(c, [1, 5, 9])
            caches[c._layer_names[k]][:, [1, 5, 9]] += 1.0
            changed.append(k)
        _step(c, caches, [1, 5, 9], salt=2, after_hook=overwrite)
        assert c._counters["saves_during_forward"] == 1 and changed == list(range(L))
        ok, rows = _stored(c, [1, 5, 9], 2)
        assert ok.all()
        for k in range(L):   # each layer's part is what the cache held right after its hook
            lo, hi = k * c._shard, (k + 1) * c._shard
            assert torch.equal(rows[:, lo:hi], before[k][:, lo:hi]), k
        assert not torch.equal(rows, _cache_rows(c, [1, 5, 9]))   # the overwrite was real

        _step(c, caches, [0, 11], salt=3, hooks={0, 2})  # hooks for two layers only
        ok, rows = _stored(c, [0, 11], 3)
        assert ok.all() and torch.equal(rows, _cache_rows(c, [0, 11]))
        assert c._counters["saves_during_forward"] == 2
        assert c._counters["save_blocks"] == 7 and c._counters["save_failed"] == 0
        assert c._jobs_in_flight == 0 and not c._req_jobs.get("r")
        assert len(c._free_staging) >= 1            # the staging came back to the pool
    finally:
        c._executor.shutdown(wait=True) if c._executor else None
        c.store.close()


def test_steps_without_saves_cost_no_job(tmp_path):
    """Decode steps with nothing to save: one metadata check in the first hook, no job."""
    c, caches = _worker(tmp_path)
    try:
        _step(c, caches, [2], salt=4)                 # learns the hooks
        c.bind_connector_metadata(conn.UCMConnectorMetadata())
        for name in c._layer_names:
            c.save_kv_layer(name, caches[name], None)
            assert c._lsave is False
        c.wait_for_save()
        assert c._lsave is None and c._counters["saves_during_forward"] == 0
    finally:
        c._executor.shutdown(wait=True) if c._executor else None
        c.store.close()
