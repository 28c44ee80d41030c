"""Hostile input to ucm's SGLang HiCache backend, against SGLang 0.5.23's own host pool and the
backend loaded as a server loads it.

The contract (``ucm.integration.sglang``'s module doc): bad input gets a clear error naming the
argument (a ValueError for arguments that do not fit together, an error in the log and a miss
for one unusable page); storage faults read as misses; a page never holds another page's bytes;
after ``close()`` calls say the backend is closed.
"""
import hashlib
import logging
import os
import secrets
import shutil

import pytest
import torch

import sglang  # noqa: F401  (this stage fails, never skips, without SGLang)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

# SGLang's host pools and the backend as a server loads it: the backend tests' own helpers
from test_sglang_backend import PAGE, backend as _backend, host_pool as _host_pool  # noqa: E402
from test_sglang_backend import mla_pool as _mla_pool  # noqa: E402


def host_pool(layout="page_first", seed=None):
    return _host_pool(layout, seed=seed)


def mla_pool(layout="page_first"):
    return _mla_pool(layout)


def backend(host, root, pipeline="memory|posix", tp=(0, 1), mla=False):
    return _backend(host, {"store": {"pipeline": pipeline, "posix": {"roots": [str(root)]}}},
                    tp=tp, mla=mla)


def keys(n):
    tag, out, prev = secrets.token_hex(4), [], b""
    for i in range(n):                           # chained like SGLang's page hashes
        prev = hashlib.sha256(prev + f"{tag}:{i}".encode()).digest()
        out.append(prev.hex())
    return out


def indices(pages):
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages]).to(torch.int64)


def page(host, p):
    return host.get_data_page(p * PAGE, flat=True).view(torch.int16).clone()


def flat(t):
    return t.view(torch.int16)


@pytest.fixture
def ucm_log(caplog):
    """The backend's log records (its logger's own handler: a host may stop propagation)."""
    logger = logging.getLogger("ucm.integration.sglang")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.WARNING, logger="ucm.integration.sglang")
    yield caplog
    logger.removeHandler(caplog.handler)


@pytest.fixture
def stored(tmp_path):
    """``(backend, host, keys)``: keys[i] holds host page i (pages 0..3)."""
    host = host_pool(seed=1)
    b = backend(host, tmp_path)
    ks = keys(4)
    assert b.batch_set_v1(ks, indices(range(4))) == [True] * 4
    yield b, host, ks
    b.close()


# -- the generic interface's arguments -------------------------------------------------------

def test_batch_get_with_more_or_fewer_targets_than_keys_is_an_error_naming_them(stored):
    """Was: more targets than keys raised IndexError; fewer returned a shorter list (SGLang's
    _generic_page_get then indexes past its end)."""
    b, host, ks = stored
    dummies = [host.get_dummy_flat_data_page() for _ in range(3)]
    with pytest.raises(ValueError, match="target_locations has 3 entries for 2 keys"):
        b.batch_get(ks[:2], dummies)
    with pytest.raises(ValueError, match="target_locations has 1 entries for 2 keys"):
        b.batch_get(ks[:2], dummies[:1])
    with pytest.raises(ValueError, match="target_locations has 0 entries for 2 keys"):
        b.batch_get(ks[:2], [])
    assert all((d == 0).all() for d in dummies)          # nothing read before the error
    out = b.batch_get(ks[:2], dummies[:2])               # and the backend goes on
    assert torch.equal(flat(out[0]), page(host, 0)) and torch.equal(flat(out[1]), page(host, 1))


def test_batch_set_with_fewer_or_more_values_than_keys_is_an_error_naming_them(stored):
    """Was: a silent False, nothing in the log."""
    b, host, _ = stored
    ks = keys(2)
    with pytest.raises(ValueError, match="values has 1 entries for 2 keys"):
        b.batch_set(ks, [host.get_data_page(0)])
    with pytest.raises(ValueError, match="values has 3 entries for 2 keys"):
        b.batch_set(ks, [host.get_data_page(p * PAGE) for p in range(3)])
    assert b.batch_exists(ks) == 0


def test_batch_set_takes_values_given_as_one_tensor_of_pages(stored, tmp_path):
    """Was: RuntimeError 'Boolean value of Tensor with more than one value is ambiguous'. A
    tensor is its pages along the first dimension (as iterating it gives them)."""
    b, host, _ = stored
    ks = keys(2)
    both = torch.stack([host.get_data_page(4 * PAGE), host.get_data_page(5 * PAGE)])
    assert b.batch_set(ks, both)
    dst = host_pool()
    b2 = backend(dst, tmp_path)
    assert b2.batch_get_v1(ks, indices([0, 1])) == [True, True]
    assert torch.equal(page(dst, 0), page(host, 4)) and torch.equal(page(dst, 1), page(host, 5))
    b2.close()
    # one flat page for one key is a tensor of page elements, not of pages
    with pytest.raises(ValueError, match=r"values has \d+ entries for 1 keys"):
        b.batch_set(keys(1), host.get_data_page(0))
    with pytest.raises(ValueError, match="values is a 0-d tensor"):
        b.batch_set(keys(1), torch.tensor(1.0))


def test_batch_get_fills_targets_given_as_one_tensor_of_pages(stored):
    """Was: RuntimeError 'Boolean value of Tensor ... ambiguous'."""
    b, host, ks = stored
    targets = torch.stack([host.get_dummy_flat_data_page() for _ in range(3)])
    out = b.batch_get([ks[2], keys(1)[0], ks[0]], targets)
    assert out[1] is None
    assert torch.equal(flat(out[0]), page(host, 2)) and torch.equal(flat(targets[2]), page(host, 0))
    with pytest.raises(ValueError, match="target_locations has 3 entries for 2 keys"):
        b.batch_get(ks[:2], targets)


def test_keys_that_are_not_a_list_are_an_error_naming_keys(stored):
    """Was: a str of keys read as one key per character (a silent miss of 64 'pages'), None a
    TypeError from deep inside."""
    b, host, ks = stored
    for bad in (ks[0], None, 17, ks[0].encode()):
        with pytest.raises(ValueError, match="keys must be a list"):
            b.batch_exists(bad)
        with pytest.raises(ValueError, match="keys must be a list"):
            b.batch_get(bad, [host.get_dummy_flat_data_page()])
        with pytest.raises(ValueError, match="keys must be a list"):
            b.batch_set(bad, [host.get_data_page(0)])
        with pytest.raises(ValueError, match="keys must be a list"):
            b.batch_get_v1(bad, indices([5]))
        with pytest.raises(ValueError, match="keys must be a list"):
            b.batch_set_v1(bad, indices([5]))
    assert b.batch_exists(tuple(ks)) == 4                # any sequence of keys


def test_a_target_or_value_of_another_dtype_is_refused_not_reinterpreted(stored, ucm_log):
    """Was: a float16 target of a page's byte size came back filled with the bfloat16 page's
    bytes (SGLang's set_from_flat_data_page then converts those 'float16' values into the
    pool: another page's contents), and a float16 value was stored as a bfloat16 page."""
    b, host, ks = stored
    n = host.get_dummy_flat_data_page().numel()
    half = torch.zeros(n, dtype=torch.float16)
    assert b.batch_get(ks[:1], [half]) == [None]
    assert (half == 0).all()
    assert "target_locations[0] has dtype torch.float16" in ucm_log.text
    k = keys(1)
    assert not b.batch_set(k, [torch.ones(n, dtype=torch.float16)])
    assert "values[0] has dtype torch.float16" in ucm_log.text
    assert b.batch_exists(k) == 0
    wide = torch.zeros(n, dtype=torch.float32)             # twice the bytes: the size says so
    assert b.batch_get(ks[:1], [wide]) == [None]
    assert "target_locations[0] has dtype torch.float32" in ucm_log.text


def test_a_non_contiguous_target_is_a_miss_that_says_why(stored, ucm_log):
    """Was: 'target_locations[0] holds 384 bytes, a page 384' (the size was right)."""
    b, host, ks = stored
    n = host.get_dummy_flat_data_page().numel()
    strided = torch.zeros(2 * n, dtype=torch.bfloat16)[::2]
    assert b.batch_get(ks[:1], [strided]) == [None]
    assert "target_locations[0] is not contiguous" in ucm_log.text
    assert "holds" not in ucm_log.text
    assert b.batch_get(ks[:1], [torch.zeros(3, dtype=torch.bfloat16)]) == [None]
    assert "target_locations[0] holds 6 bytes" in ucm_log.text


def test_targets_sharing_memory_never_return_another_pages_bytes(stored, ucm_log):
    """Was: two keys read into one tensor returned it for both, holding the second page: the
    first key got another page's bytes."""
    b, host, ks = stored
    t = host.get_dummy_flat_data_page()
    out = b.batch_get(ks[:2], [t, t])
    assert out[0] is t and out[1] is None
    assert torch.equal(flat(t), page(host, 0))
    assert "target_locations[1] shares memory" in ucm_log.text
    # overlapping views of one buffer (half a page apart), and the later one first
    n = t.numel()
    buf = torch.zeros(3 * n, dtype=torch.bfloat16)
    a, c, d = buf[n // 2:n // 2 + n], buf[:n], buf[2 * n:]
    out = b.batch_get(ks[1:4], [a, c, d])
    assert out[0] is a and out[1] is None and out[2] is d
    assert torch.equal(flat(a), page(host, 1)) and torch.equal(flat(d), page(host, 3))


def test_the_mla_rank_that_does_not_write_still_refuses_arguments_that_do_not_fit(tmp_path):
    """Was: the non-writer rank returned True (or a True per character of a str of keys)
    before looking at its arguments, so a caller's bug showed on one rank only."""
    host = mla_pool()
    b = backend(host, tmp_path, tp=(1, 2), mla=True)
    ks = keys(2)
    with pytest.raises(ValueError, match="values has 1 entries for 2 keys"):
        b.batch_set(ks, [host.get_data_page(0)])
    with pytest.raises(ValueError, match="keys must be a list"):
        b.batch_set_v1(ks[0], indices([0]))
    assert b.batch_set(ks, [host.get_data_page(p * PAGE) for p in (0, 1)])   # (not written)
    assert b.batch_set_v1(ks, indices([0, 1])) == [True, True]
    assert b.batch_exists(ks) == 0
    b.close()


# -- the zero-copy interface's host indices ----------------------------------------------------

@pytest.mark.parametrize("bad, why", [
    (None, "expected a 1-D tensor of token indices, got NoneType"),
    (5, "expected a 1-D tensor of token indices, got int"),
    (indices([5]).view(2, 2), "expected a 1-D tensor of token indices, got Tensor of shape [2, 2]"),
    (indices([5]).float(), "token indices of dtype float32, not integers"),
    (torch.ones(4, dtype=torch.bool), "token indices of dtype bool, not integers"),
    (indices([5])[:3], "3 token indices for 1 pages of 4 tokens"),
    (torch.arange(-4, 0), "not whole pages of 4 tokens"),
    (torch.arange(1, 5), "not whole pages of 4 tokens"),
    (indices([1000]), "page 1000 beyond the host pool's"),
])
def test_bad_host_indices_are_a_miss_and_a_log_line_naming_them(stored, ucm_log, bad, why):
    """Was: None or an int raised TypeError (from the log call itself); every other case logged
    '4 host indices for 1 pages of 4 tokens (or not whole pages ...)', true of float indices
    and pages beyond the pool alike."""
    b, host, ks = stored
    before = host.kv_buffer.view(torch.int16).clone()
    assert b.batch_get_v1(ks[:1], bad) == [False]
    assert b.batch_set_v1(keys(1), bad) == [False]
    assert f"host_indices: {why}" in ucm_log.text
    assert torch.equal(host.kv_buffer.view(torch.int16), before)


def test_host_indices_as_a_list_or_of_a_narrow_int_dtype_are_pages(stored, tmp_path):
    b, host, ks = stored
    dst = host_pool()
    b2 = backend(dst, tmp_path)
    assert b2.batch_get_v1(ks[:1], indices([6]).tolist()) == [True]
    assert b2.batch_get_v1(ks[1:2], indices([7]).to(torch.int32)) == [True]
    assert torch.equal(page(dst, 6), page(host, 0)) and torch.equal(page(dst, 7), page(host, 1))
    b2.close()


# -- keys --------------------------------------------------------------------------------------

def test_batch_exists_counts_the_leading_hits_of_mixed_hits_and_misses(stored):
    b, host, ks = stored
    miss = keys(1)[0]
    assert b.batch_exists(ks) == 4
    assert b.batch_exists([ks[0], ks[1], miss, ks[2]]) == 2
    assert b.batch_exists([miss] + ks) == 0
    assert b.batch_exists([ks[0], "", ks[1]]) == 1          # an empty key: a miss
    assert b.batch_exists([ks[0].upper()]) == 1             # one hash, either case
    for bad in ("", None, 17, bytes.fromhex(ks[0]), ks[0] + "\n", ks[0][:-1]):
        assert b.batch_exists([bad]) == 0 and not b.exists(bad)
    assert b.batch_exists([]) == 0
    assert [b.exists(k) for k in ks + [miss]] == [True] * 4 + [False]


def test_keys_that_are_not_page_hashes_store_nothing_and_read_nothing(stored):
    b, host, ks = stored
    bad = ["", None, 17, ks[0] + "00"]
    assert b.batch_set_v1(bad, indices([4, 5, 6, 7])) == [False] * 4
    assert not b.batch_set(bad, [host.get_data_page(p * PAGE) for p in (4, 5, 6, 7)])
    dummies = [host.get_dummy_flat_data_page() for _ in bad]
    assert b.batch_get(bad, dummies) == [None] * 4 and all((d == 0).all() for d in dummies)
    before = host.kv_buffer.view(torch.int16).clone()
    assert b.batch_get_v1(bad, indices([4, 5, 6, 7])) == [False] * 4
    assert torch.equal(host.kv_buffer.view(torch.int16), before)


def test_a_key_repeated_within_one_batch_stores_one_page_and_reads_it_everywhere(tmp_path):
    host = host_pool(seed=2)
    b = backend(host, tmp_path)
    k, k2 = keys(2)
    assert b.batch_set_v1([k, k], indices([0, 1])) == [True, True]
    assert b.batch_set([k2, k2], [host.get_data_page(2 * PAGE), host.get_data_page(3 * PAGE)])
    dst = host_pool()
    b2 = backend(dst, tmp_path)
    assert b2.batch_get_v1([k, k], indices([4, 5])) == [True, True]
    assert torch.equal(page(dst, 4), page(host, 0)) and torch.equal(page(dst, 5), page(host, 0))
    out = b2.batch_get([k2, k2], [host.get_dummy_flat_data_page() for _ in range(2)])
    assert all(torch.equal(flat(o), page(host, 2)) for o in out)
    assert b2.batch_exists([k, k, k2]) == 3
    # one host page named twice in a get would hold one of two pages: refused, nothing read
    before = dst.kv_buffer.view(torch.int16).clone()
    assert b2.batch_get_v1([k, k2], indices([6, 6])) == [False, False]
    assert torch.equal(dst.kv_buffer.view(torch.int16), before)
    b.close()
    b2.close()


def test_the_same_key_set_twice_keeps_the_first_page(stored, tmp_path):
    b, host, ks = stored
    assert b.batch_set_v1(ks[:1], indices([5])) == [True]                 # already stored
    assert b.batch_set(ks[1:2], [host.get_data_page(6 * PAGE)])
    dst = host_pool()
    b2 = backend(dst, tmp_path)
    assert b2.batch_get_v1(ks[:2], indices([0, 1])) == [True, True]
    assert torch.equal(page(dst, 0), page(host, 0)) and torch.equal(page(dst, 1), page(host, 1))
    b2.close()


def test_extra_info_of_any_type_is_ignored(stored, tmp_path):
    b, host, ks = stored
    dst = host_pool()
    b2 = backend(dst, tmp_path)
    for junk in (None, "junk", 42, {"prefix_keys": 17}, object()):
        assert b2.batch_exists(ks, junk) == 4
        assert b2.batch_get_v1(ks[:1], indices([7]), extra_info=junk) == [True]
        assert b2.batch_set_v1(keys(1), indices([7]), junk) == [True]
    assert torch.equal(page(dst, 7), page(host, 0))
    b2.close()


# -- faults and the end of the backend -------------------------------------------------------

def test_storage_faults_read_as_misses_and_failed_stores(tmp_path, ucm_log):
    """A real fault: the only tier's directory replaced by a file under a running backend."""
    root = tmp_path / "root"
    root.mkdir()
    host = host_pool(seed=3)
    b = backend(host, root, pipeline="posix")
    ks = keys(3)
    assert b.batch_set_v1(ks[:1], indices([0])) == [True]
    shutil.rmtree(root)
    root.write_bytes(b"")
    before = host.kv_buffer.view(torch.int16).clone()
    assert b.batch_set_v1(ks[1:2], indices([1])) == [False]
    assert not b.batch_set(ks[2:], [host.get_data_page(2 * PAGE)])
    assert b.batch_exists(ks) == 0
    assert b.batch_get(ks, [host.get_dummy_flat_data_page() for _ in ks]) == [None] * 3
    assert b.batch_get_v1(ks, indices([4, 5, 6])) == [False] * 3
    assert torch.equal(host.kv_buffer.view(torch.int16), before)
    b.close()
    os.remove(root)


def test_calls_after_close_say_the_backend_is_closed(tmp_path):
    """Was: 'no host pool registered yet (register_mem_pool_host)' after close, and registering
    a pool again silently reopened the store."""
    host = host_pool(seed=4)
    b = backend(host, tmp_path)
    ks = keys(1)
    assert b.batch_set_v1(ks, indices([0])) == [True]
    b.close()
    b.close()                                              # a second close does nothing
    calls = [lambda: b.batch_exists(ks), lambda: b.exists(ks[0]),
             lambda: b.batch_get(ks, [host.get_dummy_flat_data_page()]),
             lambda: b.get(ks[0], host.get_dummy_flat_data_page()),
             lambda: b.batch_set(ks, [host.get_data_page(0)]),
             lambda: b.set(ks[0], host.get_data_page(0)),
             lambda: b.batch_get_v1(ks, indices([1])), lambda: b.batch_set_v1(ks, indices([1])),
             b.clear, b.ucm_stats, lambda: b.register_mem_pool_host(host)]
    for call in calls:
        with pytest.raises(RuntimeError, match="closed"):
            call()
    assert b.get_stats().backup_pgs == [1]                 # what was recorded before close
    assert b.core is None


def test_calls_before_a_host_pool_is_registered_say_so(tmp_path):
    host = host_pool()
    extra = {"ucm": {"store": {"pipeline": "memory"}}}
    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0,
                               attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
                               is_page_first_layout=True, model_name="smol", extra_config=extra)
    from ucm.integration.sglang import UCMStorage

    b = UCMStorage(cfg)
    with pytest.raises(RuntimeError, match="no host pool registered"):
        b.batch_exists(keys(1))
    b.close()
    with pytest.raises(RuntimeError, match="closed"):
        b.register_mem_pool_host(host)
