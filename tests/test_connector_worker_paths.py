"""The vLLM connector's worker paths without vLLM: :mod:`ucm.integration.vllm.worker_save` and
:mod:`ucm.integration.vllm.worker_load` over a small CPU :class:`ucm.KVLayout` (per layer a
strided view of one packed allocation, as vLLM-CPU hands them) and a real memory|posix store in a
temporary folder.

A save then a load moves each block's bytes from one set of caches into other blocks of another
set (filled with a sentinel): the loaded blocks equal the saved ones bit for bit, every other
block keeps its sentinel, blocks the store never held are reported as load errors and left
untouched. Covered: end-of-step saves (foreground and background), saves during the forward,
layer-wise saves and loads, loads borrowed from the memory tier and loads staged from the posix
tier (a store reopened over the same folder). One case runs in a fresh interpreter and checks
that none of this imported vLLM.
"""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import ucm
from ucm.config import Config
from ucm.integration.vllm.records import Transfer
from ucm.integration.core import WorkerCore
from ucm.integration.vllm.worker_load import WorkerLoad
from ucm.integration.vllm.worker_save import WorkerSave
from ucm.store import open_store

L, NB, H, BS, D = 3, 9, 2, 4, 8
NS = b"worker-paths-tst"
SAVED = [5, 1, 7, 2]  # cache blocks saved, in that order (the last one a prompt's tail)
LOADED = [0, 8, 3, 6]  # the blocks they are loaded into, in another cache
SENTINEL = -7


def _caches(fill=None, seed=0):
    """Per layer a view ``[blocks, heads, block_size, 2 * head_dim]`` of one packed float32
    allocation (vLLM-CPU 0.32's layout: K then V of each slot); ``fill``: an int pattern, else
    random bits."""
    packed = torch.empty(L, NB, H, BS, 2 * D, dtype=torch.float32)
    if fill is None:
        g = torch.Generator().manual_seed(seed)
        packed.view(torch.int32).copy_(torch.randint(-2**31, 2**31 - 1, packed.shape, generator=g,
                                                     dtype=torch.int32))
    else:
        packed.view(torch.int32).fill_(fill)
    return packed, [packed[k] for k in range(L)]


def _ids(blocks, salt):
    return np.array([[salt, b] for b in blocks], dtype=np.uint64)


def _transfers(ids, blocks):
    """Two requests' blocks; the second one's last block is a prompt tail."""
    return [Transfer("a", ids[:2], list(blocks[:2])), Transfer("b", ids[2:], list(blocks[2:]), tail=True)]


def _source(root: str, seed: int):
    """A memory|posix store over ``root`` and a worker core over fresh random caches:
    ``(cfg, packed caches, layout, store, core)``."""
    cfg = Config({"store.pipeline": "memory|posix", "store.posix.roots": [root]})
    src_packed, src_views = _caches(seed=seed)
    layout = ucm.KVLayout.from_views(src_views)
    store = open_store(cfg, block_bytes=layout.block_bytes, shard_bytes=layout.shard_bytes(0),
                       namespace=NS)
    return cfg, src_packed, layout, store, WorkerCore(layout, store, "cpu")


def round_trip(root: str, *, background: bool = True, during: bool = False,
               layerwise: bool = False, reopen: bool = False) -> dict:
    """Save ``SAVED`` blocks of one cache through the save path, load them into ``LOADED``
    blocks of another through the load path, check the bytes; returns both paths' counters."""
    cfg, src_packed, layout, store, core = _source(root, 11)
    assert core.shard == layout.shard_bytes(0) and core.shard * L == layout.block_bytes
    save = WorkerSave(core, background=background, during_forward=during, layerwise=layerwise)
    assert save.during == (background and during and not layerwise)
    ids = _ids(SAVED, 3)
    steps = [(ids[:1], SAVED[:1]), (ids[1:], SAVED[1:])]  # step 1 learns the layer hooks
    for step_ids, step_blocks in steps:
        saves = [Transfer("a", step_ids, list(step_blocks), tail=len(step_blocks) > 1)]
        save.begin_step(saves)
        for k in range(L):
            save.layer_done(k)
        assert save.end_step()
        save.clear_step()
        assert save.drain(timeout=30)
        if save.background:
            assert save.finished({"a"}) == {"a"}
    assert not save._req_jobs and not save._finishing and save._jobs_in_flight == 0
    if save.during:
        assert core.metrics.get("ucm_saves_during_forward_total") == 1
    assert core.metrics.get("ucm_save_blocks_total") == 3 and core.metrics.get("ucm_save_tail_blocks_total") == 1
    assert core.metrics.get("ucm_save_failed_blocks_total") == 0
    save.shutdown()
    if reopen:  # a new process: the memory tier is empty, the posix tier has the blocks
        store.close()
        store = open_store(cfg, block_bytes=layout.block_bytes, shard_bytes=layout.shard_bytes(0),
                           namespace=NS)

    dst_packed, dst_views = _caches(fill=SENTINEL)
    dst = WorkerCore(ucm.KVLayout.from_views(dst_views), store, "cpu")
    drained = []
    load = WorkerLoad(dst, layerwise=layerwise, before_load=lambda: drained.append(1))
    missing = _ids([100, 101], 4)  # never stored
    loads = [Transfer("m", missing, [4, 5])] + _transfers(ids, LOADED)  # failures come first
    load.start(loads)
    assert drained == [1]  # the save path is drained before the store is read
    for k in range(L):
        load.wait_layer(k)
    load.end_step()
    assert load.take_errors() == {4, 5} and load.take_errors() == set()
    for k in range(L):
        want, got = src_packed[k].view(torch.int32), dst_packed[k].view(torch.int32)
        assert torch.equal(got[LOADED], want[SAVED]), f"layer {k}: loaded bytes differ"
        untouched = [b for b in range(NB) if b not in LOADED]  # 4 and 5 (failed) included
        assert (got[untouched] == SENTINEL).all(), f"layer {k}: stray write"
    assert dst.metrics.get("ucm_load_blocks_total") == 3 and dst.metrics.get("ucm_load_tail_blocks_total") == 1
    assert dst.metrics.get("ucm_load_failed_blocks_total") == 2
    load.shutdown()
    store.close()
    return {"save": core.metrics.totals(), "load": dst.metrics.totals()}


@pytest.mark.parametrize("background,during,layerwise,reopen", [
    pytest.param(False, False, False, False, id="foreground-save"),
    pytest.param(True, False, False, True, id="background-save-reopened-store"),
    pytest.param(True, True, False, False, id="save-during-forward"),
    pytest.param(True, True, False, True, id="save-during-forward-reopened-store"),
    pytest.param(False, False, True, True, id="layerwise-reopened-store"),
])
def test_save_then_load_moves_the_bytes(tmp_path, background, during, layerwise, reopen):
    counters = round_trip(str(tmp_path), background=background, during=during,
                          layerwise=layerwise, reopen=reopen)
    # two of the blocks asked for were never stored: nothing can be borrowed, all is staged
    assert counters["load"]["ucm_borrowed_load_blocks_total"] == 0


def test_a_load_of_blocks_all_in_the_memory_tier_is_borrowed(tmp_path):
    _, src_packed, _, store, core = _source(str(tmp_path), 3)
    save = WorkerSave(core, background=True, during_forward=False)
    ids = _ids(SAVED, 9)
    save.begin_step(_transfers(ids, SAVED))
    assert save.end_step() and save.drain(timeout=30)
    save.shutdown()
    dst_packed, dst_views = _caches(fill=SENTINEL)
    dst = WorkerCore(ucm.KVLayout.from_views(dst_views), store, "cpu")
    load = WorkerLoad(dst)
    load.start(_transfers(ids, LOADED))
    load.end_step()
    try:
        assert load.take_errors() == set()
        assert dst.metrics.get("ucm_borrowed_load_blocks_total") == len(SAVED)
        for k in range(L):
            got = dst_packed[k].view(torch.int32)
            assert torch.equal(got[LOADED], src_packed[k].view(torch.int32)[SAVED])
            assert (got[[b for b in range(NB) if b not in LOADED]] == SENTINEL).all()
    finally:
        load.shutdown()
        store.close()


@pytest.mark.parametrize("method,where,overlap", [
    ("int8", "memory", True), ("int8", "posix", False), ("int4", "memory", False),
    ("int4", "posix", True)])
def test_compressed_loads_decode_straight_into_the_cache(tmp_path, method, where, overlap):
    """With a compressing store the load path reads the encoded blocks (lent by the memory
    tier, or staged from the posix tier after a restart) and decodes them into the cache
    blocks, whole or layer by layer overlapping the forward: each loaded block holds exactly
    the codec's decoding of the saved one, every other block its sentinel, and the codec
    counts the decoded bytes."""
    from ucm.compress import KVShape, decode, encode
    from ucm.store.factory import codec_spec

    cfg = Config({"store.pipeline": "memory|posix", "store.posix.roots": [str(tmp_path)],
                  "compression.enabled": True, "compression.method": "quantize",
                  "compression.bits": 8 if method == "int8" else 4, "compression.group": 32})
    h, bs, d = 2, 16, 32
    shape = KVShape("hktd", bs, h, d, "float32", key_order="dt")
    g = torch.Generator().manual_seed(5)
    src_packed = torch.randn(L, NB, h, bs, 2 * d, generator=g)

    def geometry(packed):
        return ucm.KVLayout.from_views([packed[k] for k in range(L)])

    layout = geometry(src_packed)
    kw = dict(block_bytes=layout.block_bytes, shard_bytes=layout.shard_bytes(0), namespace=NS,
              kv_shape=shape)
    store = open_store(cfg, **kw)
    core = WorkerCore(layout, store, "cpu")
    assert core.codec is store
    save = WorkerSave(core, background=True, during_forward=False)
    ids = _ids(SAVED, 21)
    save.begin_step(_transfers(ids, SAVED))
    assert save.end_step() and save.drain(timeout=30)
    save.shutdown()
    if where == "posix":
        store.close()
        store = open_store(cfg, **kw)
    dst_packed = torch.empty(L, NB, h, bs, 2 * d)
    dst_packed.view(torch.int32).fill_(SENTINEL)
    dst = WorkerCore(geometry(dst_packed), store, "cpu")
    load = WorkerLoad(dst, overlap=overlap, spare_cpu=True)
    load.hook_ok = overlap       # (vLLM seen waiting for every layer: loads may overlap)
    try:
        load.start(_transfers(ids, LOADED))
        for k in range(L):
            load.wait_layer(k)
        load.end_step()
        assert load.take_errors() == set()
        m = dst.metrics
        assert m.get("ucm_borrowed_load_blocks_total") == (len(SAVED) if where == "memory" else 0)
        assert m.get("ucm_overlapped_load_blocks_total") == (3 if overlap else 0)  # (tail: now)
        spec = codec_spec(cfg)
        for k in range(L):
            raw = src_packed[k][SAVED].reshape(len(SAVED), -1).view(torch.uint8)
            enc = torch.empty((len(SAVED), store.enc), dtype=torch.uint8)
            assert encode(spec, shape, raw, enc, k, backend="reference").all()
            want = torch.empty_like(raw)
            decode(spec, shape, enc, want, k, backend="reference")
            got = dst_packed[k]
            assert torch.equal(got[LOADED].reshape(len(SAVED), -1).view(torch.uint8), want), \
                f"layer {k}: not the codec's decoding"
            assert (got[[b for b in range(NB) if b not in LOADED]].view(torch.int32) ==
                    SENTINEL).all(), f"layer {k}: stray write"
        assert store.stats()["codec"]["decoded_bytes"] == len(SAVED) * layout.block_bytes
    finally:
        load.shutdown()
        store.close()


_NO_VLLM = """
import sys
sys.path.insert(0, sys.argv[1])
import test_connector_worker_paths as t
assert "vllm" not in sys.modules, "imported vLLM: " + ", ".join(sorted(m for m in sys.modules if m.startswith("vllm"))[:5])
t.round_trip(sys.argv[2], background=True, during=True, reopen=True)
t.round_trip(sys.argv[3], layerwise=True, background=False)
bad = sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm."))
assert not bad, "imported vLLM: " + ", ".join(bad[:5])
print("NO-VLLM-OK")
"""


def test_the_worker_paths_run_without_vllm(tmp_path):
    """A fresh interpreter imports the worker paths and runs a save and a load: vLLM is never
    imported (so the same code runs under test where vLLM is not installed)."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(ucm.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    out = subprocess.run([sys.executable, "-c", _NO_VLLM, os.path.dirname(os.path.abspath(__file__)),
                          str(a), str(b)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "NO-VLLM-OK" in out.stdout, out.stdout[-2000:] + out.stderr[-4000:]


def test_a_layerwise_save_whose_wait_fails_is_logged_and_its_blocks_miss(tmp_path, caplog,
                                                                        monkeypatch):
    """A layer's dump whose wait raises (a wait that timed out: MOCKED, since a tier that stalls
    past the timeout cannot be produced on demand) fails the whole save: its blocks are counted
    as failed, never published (a later lookup misses), and a warning names the error."""
    from ucm.errors import TaskTimeoutError

    store, core = _source(str(tmp_path), 5)[3:]
    save = WorkerSave(core, background=False, during_forward=False, layerwise=True)
    real_wait, stall = store.wait, []

    def wait(task, timeout=None):
        if stall:
            raise TaskTimeoutError("mocked: a tier stalled past the wait timeout")
        return real_wait(task, timeout)

    monkeypatch.setattr(store, "wait", wait)
    ids = _ids(SAVED, 6)
    for step_ids, step_blocks in [(ids[:1], SAVED[:1]), (ids[1:], SAVED[1:])]:
        save.begin_step([Transfer("a", step_ids, list(step_blocks))])
        for k in range(L):
            save.layer_done(k)
        with caplog.at_level("WARNING", logger="ucm.integration.vllm"):
            save.end_step()
        save.clear_step()
        stall.append(1)                      # the second step's waits raise
    save.shutdown()
    assert core.metrics.get("ucm_save_blocks_total") == 1
    assert core.metrics.get("ucm_save_failed_blocks_total") == 3
    assert "layer-wise save of 3 blocks failed" in caplog.text and "mocked" in caplog.text
    assert list(store.lookup(ids[1:])) == [False, False, False]
    assert list(store.lookup(ids[:1])) == [True]
    store.close()
