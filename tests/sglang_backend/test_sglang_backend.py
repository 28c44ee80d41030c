"""ucm as SGLang 0.5.23's HiCache L3 backend, against SGLang's own classes: its CPU device pool
and ``MHATokenToKVPoolHost`` in every layout ucm supports, the backend loaded through
``StorageBackendFactory.create_backend("dynamic", ...)`` as a server loads it, and the calls its
cache controller makes (``batch_exists``; ``batch_get_v1``/``batch_set_v1`` with token
``host_indices``; the generic ``batch_get``/``batch_set`` over flat pages).

These run with SGLang's modules on ``PYTHONPATH`` (``scripts/install_sglang.sh``; ``make test``
runs them so); ``tests/conftest.py`` leaves this folder out where SGLang is absent.
"""
import os
import secrets
import sys

import numpy as np
import pytest
import torch

import sglang  # noqa: E402,F401  (this stage fails, never skips, without SGLang)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from services import require_module  # noqa: E402
from services.mooncake import MooncakeService  # noqa: E402
from services.redis import redis_server  # noqa: E402

LAYERS, HEADS, DIM, PAGE, TOKENS = 3, 2, 8, 4, 32
LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]


def host_pool(layout, page=PAGE, dtype=torch.bfloat16, seed=None):
    dev = MHATokenToKVPool(size=TOKENS, page_size=page, dtype=dtype, head_num=HEADS,
                           head_dim=DIM, layer_num=LAYERS, device="cpu",
                           enable_memory_saver=False, start_layer=0, end_layer=LAYERS,
                           enable_alt_stream=False)
    info = dev.get_device_pool_infos()[0].buffer_info
    cap = dev.size if dev.host_capacity_tokens is None else dev.host_capacity_tokens
    host = MHATokenToKVPoolHost(info, 2.0, 0, page, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=cap, start_layer=dev.start_layer,
                                end_layer=dev.end_layer,
                                write_back_staging=dev.hicache_write_back_staging)
    fill(host, seed)
    return host


def mla_pool(layout, seed=None):
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    dev = MLATokenToKVPool(size=TOKENS, page_size=PAGE, dtype=torch.bfloat16, kv_lora_rank=16,
                           qk_rope_head_dim=8, layer_num=LAYERS, device="cpu",
                           enable_memory_saver=False, start_layer=0, end_layer=LAYERS)
    cap = dev.size if dev.host_capacity_tokens is None else dev.host_capacity_tokens
    host = MLATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, layout,
                                pin_memory=False, device="cpu", device_capacity_tokens=cap,
                                start_layer=dev.start_layer, end_layer=dev.end_layer,
                                target_layer_num=dev.layer_num,
                                override_kv_cache_dim=dev.kv_cache_dim)
    fill(host, seed)
    return host


def fill(host, seed=None):
    raw = host.kv_buffer.view(torch.int16)
    if seed is None:
        raw.fill_(-5)
    else:
        g = torch.Generator().manual_seed(seed)
        raw.copy_(torch.randint(-2**15, 2**15 - 1, raw.shape, generator=g, dtype=torch.int16))


def backend(host, ucm_cfg, *, tp=(0, 1), mla=False, model="smol", extra=None):
    extra_config = {"backend_name": "ucm", "module_path": "ucm.integration.sglang",
                    "class_name": "UCMStorage", "interface_v1": 1}
    if ucm_cfg is not None:
        extra_config["ucm"] = ucm_cfg
    extra_config.update(extra or {})
    cfg = HiCacheStorageConfig(tp_rank=tp[0], tp_size=tp[1], pp_rank=0, pp_size=1,
                               attn_cp_rank=0, attn_cp_size=1, is_mla_model=mla,
                               enable_storage_metrics=True,
                               is_page_first_layout=host.layout == "page_first",
                               model_name=model, extra_config=extra_config)
    b = StorageBackendFactory.create_backend("dynamic", cfg, host)
    b.register_mem_pool_host(host)               # (as HiCache's cache controller does)
    return b


def posix_cfg(root, pipeline="memory|posix"):
    return {"store": {"pipeline": pipeline, "posix": {"roots": [str(root)]}}}


def keys(n, tag=None):
    tag = tag or secrets.token_hex(4)
    import hashlib

    out, prev = [], b""
    for i in range(n):                           # chained like SGLang's page hashes
        prev = hashlib.sha256(prev + f"{tag}:{i}".encode()).digest()
        out.append(prev.hex())
    return out


def indices(host, pages):
    """SGLang's token indices of host pages (page_size per page)."""
    return torch.cat([torch.arange(p * host.page_size, (p + 1) * host.page_size)
                      for p in pages]).to(torch.int64)


def page(host, p):
    return host.get_data_page(p * host.page_size, flat=True).view(torch.int16).clone()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_v1_round_trip_into_other_pages_of_a_new_backend(layout, tmp_path):
    src = host_pool(layout, seed=1)
    b = backend(src, posix_cfg(tmp_path))
    ks = keys(5)
    assert b.batch_set_v1(ks, indices(src, [3, 1, 7, 2, 5])) == [True] * 5
    assert b.batch_exists(ks) == 5 and b.batch_exists(keys(2)) == 0
    b.close()
    dst = host_pool(layout)                                   # a restarted server
    b2 = backend(dst, posix_cfg(tmp_path))
    assert b2.batch_exists(ks) == 5
    got = b2.batch_get_v1(ks + keys(1), indices(dst, [0, 8, 4, 9, 6, 10]))
    assert got == [True] * 5 + [False]
    for s, d in zip([3, 1, 7, 2, 5], [0, 8, 4, 9, 6]):
        assert torch.equal(page(dst, d), page(src, s))
    for d in (1, 2, 3, 5, 7, 10):                             # untouched, the miss included
        assert (page(dst, d) == -5).all()
    stats = b2.get_stats()
    assert stats.prefetch_pgs == [5] and len(stats.prefetch_bandwidth) == 1
    b2.close()


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_generic_and_zero_copy_paths_read_each_others_pages(layout, tmp_path):
    src = host_pool(layout, seed=2)
    b = backend(src, posix_cfg(tmp_path))
    ka, kb = keys(2), keys(2)
    # generic: flat pages as HiCache's _generic_page_set hands them
    assert b.batch_set(ka, [src.get_data_page(p * PAGE) for p in (1, 2)])
    assert b.batch_set_v1(kb, indices(src, [3, 4])) == [True, True]
    dst = host_pool(layout)
    b2 = backend(dst, posix_cfg(tmp_path))       # (one process: the same store, memory tier)
    assert b2.batch_get_v1(ka, indices(dst, [5, 6])) == [True, True]
    flat = [src.get_dummy_flat_data_page() for _ in kb]
    out = b2.batch_get(kb + keys(1), flat + [src.get_dummy_flat_data_page()])
    assert out[2] is None and all(o is not None for o in out[:2])
    for i, p in enumerate((5, 6)):
        assert torch.equal(page(dst, p), page(src, 1 + i))
    for i, p in enumerate((3, 4)):
        dst.set_from_flat_data_page(p * PAGE, out[i])
        assert torch.equal(page(dst, p), page(src, p))
    assert b.exists(ka[0]) and not b.exists(keys(1)[0])
    b.close()
    b2.close()


def test_leading_hits_stop_at_the_first_missing_page(tmp_path):
    host = host_pool("page_first", seed=3)
    b = backend(host, posix_cfg(tmp_path))
    ks = keys(4)
    b.batch_set_v1([ks[0], ks[1], ks[3]], indices(host, [0, 1, 3]))
    assert b.batch_exists(ks) == 2
    assert b.batch_exists(ks[:1] + ["not-a-key"] + ks[1:2]) == 1
    b.close()


def test_tp_ranks_write_their_own_shards_and_mla_writes_once(tmp_path):
    ks = keys(3)
    hosts = [host_pool("page_first", seed=10 + r) for r in range(2)]
    bs = [backend(h, posix_cfg(tmp_path), tp=(r, 2)) for r, h in enumerate(hosts)]
    for b, h in zip(bs, hosts):
        assert b.batch_set_v1(ks, indices(h, [0, 1, 2])) == [True] * 3
    for r in range(2):
        dst = host_pool("page_first")
        reader = backend(dst, posix_cfg(tmp_path), tp=(r, 2))
        assert reader.batch_get_v1(ks, indices(dst, [4, 5, 6])) == [True] * 3
        assert torch.equal(page(dst, 4), page(hosts[r], 0))   # its own shard, not the other's
        assert not torch.equal(page(dst, 4), page(hosts[1 - r], 0))
        reader.close()
    for b in bs:
        b.close()


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_mla_ranks_share_pages_and_only_the_writer_writes(layout, tmp_path):
    """SGLang's MLA host pool (one latent buffer): every TP rank holds the same KV, so the
    namespace has no rank; the non-writer rank stores nothing and reads the writer's pages."""
    mk = keys(2)
    mine, theirs = mla_pool(layout, seed=20), mla_pool(layout, seed=21)
    writer = backend(mine, posix_cfg(tmp_path), tp=(0, 2), mla=True)
    other = backend(theirs, posix_cfg(tmp_path), tp=(1, 2), mla=True)
    assert other.batch_set_v1(mk, indices(theirs, [0, 1])) == [True, True]
    assert other.batch_exists(mk) == 0                       # (it wrote nothing)
    assert writer.batch_set_v1(mk, indices(mine, [0, 1])) == [True, True]
    dst = mla_pool(layout)
    reader = backend(dst, posix_cfg(tmp_path), tp=(1, 2), mla=True)
    assert reader.batch_get_v1(mk, indices(dst, [2, 3])) == [True, True]
    assert torch.equal(page(dst, 2), page(mine, 0)) and torch.equal(page(dst, 3), page(mine, 1))
    flat = reader.batch_get(mk[:1], [dst.get_dummy_flat_data_page()])[0]
    assert torch.equal(flat.view(torch.int16), page(mine, 0))
    for b in (writer, other, reader):
        b.close()


def test_deployments_of_another_shape_never_share_pages(tmp_path):
    ks = keys(2)
    host = host_pool("page_first", seed=4)
    b = backend(host, posix_cfg(tmp_path))
    b.batch_set_v1(ks, indices(host, [0, 1]))
    others = [backend(host_pool("page_first"), posix_cfg(tmp_path), model="other"),
              backend(host_pool("layer_first"), posix_cfg(tmp_path)),
              backend(host_pool("page_first", page=8), posix_cfg(tmp_path)),
              backend(host_pool("page_first", dtype=torch.float16), posix_cfg(tmp_path)),
              backend(host_pool("page_first"), posix_cfg(tmp_path), tp=(0, 2))]
    for o in others:
        assert o.batch_exists(ks) == 0
        o.close()
    b.clear()                                               # a new generation: all misses
    assert b.batch_exists(ks) == 0
    b.close()


def test_a_corrupt_block_is_a_miss_and_leaves_the_host_page(tmp_path):
    from ucm.store import open_store

    host = host_pool("page_first", seed=5)
    b = backend(host, posix_cfg(tmp_path))
    ks = keys(2)
    b.batch_set_v1(ks, indices(host, [0, 1]))
    ids, _ = b._ids(ks)
    posix = open_store({"store": {"pipeline": "posix", "posix": {"roots": [str(tmp_path)]}}},
                       block_bytes=b.core.block_bytes, namespace=b.ns.digest())
    victim = posix.path_of(ids[1])
    posix.close()
    b.close()
    with open(victim, "r+b") as f:
        f.seek(4096 + 17)
        x = f.read(1)
        f.seek(4096 + 17)
        f.write(bytes([x[0] ^ 4]))
    dst = host_pool("page_first")
    b2 = backend(dst, posix_cfg(tmp_path))
    assert b2.batch_get_v1(ks, indices(dst, [2, 3])) == [True, False]
    assert torch.equal(page(dst, 2), page(host, 0)) and (page(dst, 3) == -5).all()
    b2.close()


def test_bad_input_is_an_error_at_construction_or_a_miss(tmp_path):
    host = host_pool("page_first", seed=6)
    with pytest.raises(ValueError, match="no 'ucm' key"):
        backend(host, None)
    with pytest.raises(ValueError, match="store.pipeline"):
        backend(host, {"store": {"pipeline": "nosuchtier"}})
    with pytest.raises(ValueError, match="model_name"):
        backend(host, posix_cfg(tmp_path), model=None)
    odd = host_pool("page_first")
    odd.layout = "page_unified"
    with pytest.raises(ValueError, match="page_unified"):
        backend(odd, posix_cfg(tmp_path))
    b = backend(host, posix_cfg(tmp_path))
    bad = ["zz" * 32, "abc", 17]
    assert b.batch_set_v1(bad, indices(host, [0, 1, 2])) == [False] * 3
    assert b.batch_exists(bad) == 0 and not b.batch_set(bad[:1], [host.get_data_page(0)])
    ks = keys(2)
    assert b.batch_set_v1(ks, indices(host, [0])) == [False, False]   # a page's indices short
    assert b.batch_set_v1(ks, torch.arange(1, 9)) == [False, False]   # not page aligned
    assert not b.batch_set(ks[:1], [torch.zeros(3, dtype=torch.bfloat16)])  # not a page
    b.close()


def distributed_tier(tier, tmp_path):
    """``(store config, stop)`` of a real server of a distributed tier on 127.0.0.1."""
    if tier == "redis":
        require_module("redis")
        srv = redis_server(tmp_path)
        return {"pipeline": "memory|redis", "redis": {"servers": [srv.url]}}, srv.stop
    require_module("mooncake.store")
    svc = MooncakeService(tmp_path, segment="64MB")
    return ({"pipeline": "memory|mooncake",
             "mooncake": {"masters": [svc.master], "metadata_server": svc.metadata_server}},
            svc.stop)


@pytest.mark.parametrize("tier", ["redis", "mooncake"])
def test_behind_it_a_distributed_pipeline(tier, tmp_path):
    store, stop = distributed_tier(tier, tmp_path)
    try:
        cfg = {"store": store}
        src = host_pool("page_first_direct", seed=7)
        b = backend(src, cfg)
        ks = keys(3)
        assert b.batch_set_v1(ks, indices(src, [0, 1, 2])) == [True] * 3
        b.close()
        dst = host_pool("page_first_direct")
        b2 = backend(dst, cfg)                        # fresh memory tier: from the server
        assert b2.batch_get_v1(ks, indices(dst, [5, 6, 7])) == [True] * 3
        assert torch.equal(page(dst, 6), page(src, 1))
        b2.close()
    finally:
        stop()


def test_random_operations_against_a_dictionary_model(tmp_path):
    """set (v1 or generic), get (v1 or generic), exists and leading hits in random order over a
    few keys, against a dict of what each key first stored (a stored page is never rewritten):
    a get returns exactly the model's page, a key the model lacks is a miss."""
    rng = np.random.default_rng(11)
    host = host_pool("layer_first", seed=8)
    b = backend(host, posix_cfg(tmp_path))
    pool_pages = host.kv_buffer.shape[2] // PAGE
    ks = keys(12)
    model = {}
    for step in range(120):
        op = rng.integers(0, 5)
        k = [ks[i] for i in rng.choice(len(ks), size=rng.integers(1, 4), replace=False)]
        pages = rng.choice(pool_pages, size=len(k), replace=False).tolist()
        if op == 0:                                   # new random bytes, then set through v1
            for p in pages:
                host.kv_buffer[:, :, p * PAGE:(p + 1) * PAGE].view(torch.int16).random_()
            assert all(b.batch_set_v1(k, indices(host, pages)))
            for key, p in zip(k, pages):
                model.setdefault(key, page(host, p))
        elif op == 1:                                 # the generic path's set
            assert b.batch_set(k, [host.get_data_page(p * PAGE) for p in pages])
            for key, p in zip(k, pages):
                model.setdefault(key, page(host, p))
        elif op == 2:
            got = b.batch_get_v1(k, indices(host, pages))
            for key, p, ok in zip(k, pages, got):
                assert ok == (key in model), step
                if ok:
                    assert torch.equal(page(host, p), model[key]), step
        elif op == 3:
            out = b.batch_get(k, [host.get_dummy_flat_data_page() for _ in k])
            for key, o in zip(k, out):
                assert (o is not None) == (key in model), step
                if o is not None:
                    assert torch.equal(o.view(torch.int16), model[key]), step
        else:
            want = next((i for i, key in enumerate(k) if key not in model), len(k))
            assert b.batch_exists(k) == want, step
    b.close()


def test_prefetch_and_backup_threads_at_once(tmp_path):
    """HiCache reads on its prefetch thread while its backup thread writes: both at once on one
    backend stay exact."""
    import threading

    host = host_pool("page_first", seed=9)
    b = backend(host, posix_cfg(tmp_path))
    old, new = keys(4), keys(4)
    b.batch_set_v1(old, indices(host, [0, 1, 2, 3]))
    want = [page(host, p) for p in range(8)]
    errors = []

    def reader():
        for _ in range(15):
            if b.batch_get_v1(old, indices(host, [10, 11, 12, 13])) != [True] * 4:
                errors.append("miss")

    def writer():
        for i in range(15):
            ks = keys(4, tag=f"w{i}")
            if b.batch_set_v1(ks, indices(host, [4, 5, 6, 7])) != [True] * 4:
                errors.append("set failed")

    threads = [threading.Thread(target=reader), threading.Thread(target=writer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i in range(4):
        assert torch.equal(page(host, 10 + i), want[i])
    assert b.batch_set_v1(new, indices(host, [4, 5, 6, 7])) == [True] * 4
    b.close()
