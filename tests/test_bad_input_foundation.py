"""Hostile input to the foundation ops (transfer, layout, hashing, index, byte movers, ids,
buffers): every case here once slipped past validation, wrote or read outside the memory it was
given, let two implementations disagree, or raised something other than a clear ValueError."""
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ucm  # noqa: E402
from ucm import ops  # noqa: E402
from ucm.fast import native  # noqa: E402
from ucm.buffers import BufferPool  # noqa: E402
from ucm.layout import KVLayout  # noqa: E402
from ucm.transfer import layer_scatter  # noqa: E402

from conftest import impls_of  # noqa: E402

NATIVE_OK = native.status()[0]
TRANSFER = ["reference", pytest.param("native", marks=pytest.mark.skipif(
    not NATIVE_OK, reason="native engine not built"))]


def _layout(num_blocks=6):
    kv = torch.arange(2 * num_blocks * 4 * 2 * 8, dtype=torch.float32).reshape(2, num_blocks, 4, 2, 8)
    return kv, KVLayout.from_views(list(kv.unbind(0)), layer_of_view=[0, 1])


# ---------------------------------------------------------------------------------------------
# gather / scatter

@pytest.mark.parametrize("backend", TRANSFER)
@pytest.mark.parametrize("index", [np.array([2**64 - 1], dtype=np.uint64), [2**64 - 1],
                                   np.array([2**63], dtype=np.uint64)],
                         ids=["np-uint64-max", "list-2**64-1", "np-uint64-2**63"])
def test_unsigned_index_beyond_int64_is_out_of_range_not_a_skip(backend, index):
    """2**64 - 1 used to wrap to -1 in the int64 cast: the row was silently skipped."""
    kv, lay = _layout()
    staging = torch.full((1, lay.block_bytes), 0x5A, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"block_indices: index \d+ out of range \[0, 6\)"):
        ucm.gather_blocks(lay, index, staging, backend=backend)
    with pytest.raises(ValueError, match=r"block_indices: index \d+ out of range"):
        ucm.scatter_blocks(lay, staging, index, backend=backend)
    assert (staging == 0x5A).all()


@pytest.mark.parametrize("backend", TRANSFER)
@pytest.mark.parametrize("op", ["gather", "scatter"])
def test_staging_that_aliases_the_cache_is_rejected(backend, op):
    """Staging rows carved from the cache itself: the reference (copy through an index gather)
    and the native engine (in-place memcpy, in order) produced different caches."""
    buf = (torch.arange(4 * 64, dtype=torch.int32) % 251).to(torch.uint8).reshape(4, 64)
    before = buf.clone()
    lay = KVLayout.from_views([buf])
    staging = buf[1:3]
    with pytest.raises(ValueError, match=r"staging: shares memory with the KV cache \(views\[0\]\)"):
        if op == "gather":
            ucm.gather_blocks(lay, [0, 1], staging, backend=backend)
        else:
            ucm.scatter_blocks(lay, staging, [2, 3], backend=backend)
    assert torch.equal(buf, before)


@pytest.mark.parametrize("backend", TRANSFER)
def test_staging_beside_the_cache_in_one_allocation_is_fine(backend):
    """The alias check must not reject a staging buffer that only shares the allocation."""
    raw = torch.zeros(2, 6, 64, dtype=torch.uint8)
    raw[0] = (torch.arange(6 * 64) % 251).to(torch.uint8).reshape(6, 64)
    lay = KVLayout.from_views([raw[0]])
    staging = raw[1, :2]
    ucm.gather_blocks(lay, [4, 1], staging, backend=backend)
    assert torch.equal(staging, raw[0, [4, 1]])


@pytest.mark.parametrize("backend", TRANSFER)
@pytest.mark.parametrize("k", [-1, 2, True])
def test_layer_scatter_rejects_a_bad_layer_on_every_implementation(backend, k):
    """The native prepared scatter indexed a Python list: -1 scattered the last layer, True
    layer 1, 2 raised IndexError; the reference raises ValueError for all three."""
    kv, lay = _layout()
    before = kv.clone()
    staging = torch.full((2, lay.block_bytes), 0x11, dtype=torch.uint8)
    run = layer_scatter(lay, staging, [0, 1], backend=backend)
    with pytest.raises(ValueError, match=r"layer: expected a layer id in \[0, 2\)"):
        run(k)
    assert torch.equal(kv, before)


# ---------------------------------------------------------------------------------------------
# KVLayout

def test_select_accepts_zero_d_tensor_and_array_like_an_int():
    _, lay = _layout()
    assert lay.select(1) == (1,)
    assert lay.select(torch.tensor(1)) == (1,)       # used to be "expected ... got 1"
    assert lay.select(np.array(1)) == (1,)           # used to be TypeError (0-d iteration)
    assert lay.row_bytes(np.array(0)) == lay.shard_bytes(0)
    with pytest.raises(ValueError, match="layers"):
        lay.select(np.array(True))


@pytest.mark.parametrize("view", [-1, 2, True, 1.0])
def test_view_accessors_validate_the_view_number(view):
    """view_runs(-1) / block_stride(-1) answered for the last view; 2 raised IndexError."""
    _, lay = _layout()
    with pytest.raises(ValueError, match=r"view: expected a view number in \[0, 2\)"):
        lay.view_runs(view)
    with pytest.raises(ValueError, match=r"view: expected a view number in \[0, 2\)"):
        lay.block_stride(view)


def test_huge_layer_id_is_a_short_error_naming_the_entry():
    """layer_of_view=[2**20] built set(range(2**20 + 1)) and listed every missing id in the
    message (a few megabytes); a larger id exhausts memory."""
    with pytest.raises(ValueError, match=r"layer_of_view: .*missing \[1, 2\]$") as err:
        KVLayout.from_views([torch.zeros(3, 4), torch.zeros(3, 4)], [0, 2**20])
    assert len(str(err.value)) < 300


# ---------------------------------------------------------------------------------------------
# byte movers

@pytest.mark.parametrize("backend", impls_of("copy_segments"))
def test_copy_ranges_offsets_that_wrap_around_do_not_escape_the_buffers(backend):
    """dst_offsets + lengths summed in uint64: 2**64 - 8 + 8 wrapped to 0 and passed the bounds
    check, then wrote 8 bytes before dst (and read before src)."""
    outer = np.zeros(64, np.uint8)
    dst = outer[16:32]
    with pytest.raises(ValueError, match="dst_offsets"):
        ucm.copy_ranges(np.full(16, 7, np.uint8), [0], dst, [2**64 - 8], [8], backend=backend)
    assert not outer.any()
    src_outer = np.arange(64, dtype=np.uint8)
    out = np.zeros(16, np.uint8)
    with pytest.raises(ValueError, match="src_offsets"):
        ucm.copy_ranges(src_outer[16:32], [2**64 - 8], out, [0], [8], backend=backend)
    with pytest.raises(ValueError, match="src_offsets"):
        ucm.copy_ranges(src_outer[16:32], [1], out, [0], [2**64 - 1], backend=backend)
    assert not out.any()


@pytest.mark.parametrize("backend", impls_of("copy_segments"))
@pytest.mark.parametrize("src", [[1, 2, 3], "abc", np.array([1, "a"], dtype=object), 5],
                         ids=["list", "str", "object-array", "int"])
def test_copy_ranges_non_buffer_is_a_value_error(backend, src):
    with pytest.raises(ValueError, match="src"):
        ucm.copy_ranges(src, [0], np.zeros(4, np.uint8), [0], [1], backend=backend)


@pytest.mark.parametrize("backend", impls_of("copy_segments"))
def test_huge_thread_count_is_a_hint_on_every_implementation(backend):
    """n_threads=2**40: the reference copied, the native engine raised OverflowError."""
    src, dst = np.arange(16, dtype=np.uint8), np.zeros(16, np.uint8)
    ucm.copy_ranges(src, [0], dst, [0], [16], n_threads=2**40, backend=backend)
    assert np.array_equal(src, dst)


@pytest.mark.parametrize("backend", impls_of("io_batch"))
def test_io_batch_huge_thread_count(backend):
    assert ops.io_batch(ops.new_io_ops(0), n_threads=2**40, backend=backend) == 0


@pytest.mark.parametrize("backend", impls_of("alloc_aligned"))
@pytest.mark.parametrize("args, name", [((2**64,), "nbytes"), ((8, 2**64), "alignment"),
                                        ((8, 2**40), "alignment")])
def test_alloc_aligned_absurd_sizes_are_value_errors(backend, args, name):
    """Native: OverflowError / MemoryError after trying; reference: numpy's message."""
    with pytest.raises(ValueError, match=name):
        ucm.alloc_aligned(*args, backend=backend)


@pytest.mark.parametrize("backend", impls_of("checksum"))
@pytest.mark.parametrize("fn", [
    lambda b: ops.checksum(np.zeros(16, np.uint8), 2**64, backend=b),
    lambda b: ops.checksum_units(np.zeros(16, np.uint8), 8, 2**64, backend=b),
    lambda b: ops.copy_checksum_units(np.zeros(16, np.uint8), np.zeros(16, np.uint8), 8, 2**64, backend=b),
], ids=["checksum", "checksum_units", "copy_checksum_units"])
def test_word0_beyond_uint64_is_a_value_error(backend, fn):
    with pytest.raises(ValueError, match="word0"):
        fn(backend)


@pytest.mark.parametrize("backend", impls_of("open_beneath"))
@pytest.mark.parametrize("which", ["dirfd", "flags", "mode"])
def test_open_beneath_ints_beyond_c_int(backend, which, tmp_path):
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        args = {"dirfd": fd, "flags": os.O_RDONLY, "mode": 0o600}
        args[which] = 2**40
        with pytest.raises(ValueError, match=which):
            ops.open_beneath(args["dirfd"], ["x"], args["flags"], args["mode"], backend=backend)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# hashing and ids

NS = ucm.Namespace("m", "bfloat16", 4)


@pytest.mark.parametrize("backend", impls_of("hash_blocks"))
@pytest.mark.parametrize("block_size", [2**63, 2**70])
def test_block_size_longer_than_any_prompt(backend, block_size):
    """numba: TypingError for a block size beyond uint64 (the reference returns no blocks)."""
    assert ucm.hash_blocks([1, 2, 3], bytes(16), block_size, backend=backend).shape == (0, 2)


@pytest.mark.parametrize("backend", impls_of("hash_blocks"))
def test_negative_parent_or_namespace_words_are_rejected(backend):
    """[-1, 0] was taken as [2**64 - 1, 0], while ids elsewhere (as_ids) reject negatives."""
    with pytest.raises(ValueError, match="parent.*negative"):
        ucm.hash_blocks([1, 2, 3, 4], NS, parent=[-1, 0], backend=backend)
    with pytest.raises(ValueError, match="namespace.*negative"):
        ucm.hash_blocks([1, 2, 3, 4], np.array([0, -5]), 4, backend=backend)


def test_namespace_with_a_numpy_block_size_has_the_same_digest():
    """np.int64 passed validation, then json.dumps failed in digest() (TypeError)."""
    ns = ucm.Namespace("m", "bfloat16", np.int64(16))
    assert ns.digest() == ucm.Namespace("m", "bfloat16", 16).digest()
    assert type(ns.block_size) is int
    assert ucm.hash_blocks(range(16), ns).shape == (1, 2)


@pytest.mark.parametrize("kw", [{"tp_size": True}, {"tp_rank": False}])
def test_namespace_rejects_bool_tp_fields(kw):
    """tp_size=True was accepted and hashed as JSON true: a namespace different from tp_size=1."""
    with pytest.raises(ValueError, match="tp_"):
        ucm.Namespace("m", "bfloat16", 16, **kw)


@pytest.mark.parametrize("backend", impls_of("block_index"))
@pytest.mark.parametrize("target", [2**63, 2**64, np.uint64(2**63)])
def test_evict_to_a_target_beyond_int64(backend, target):
    """numba: OverflowError in np.int64(target); the reference evicts nothing."""
    idx = ucm.BlockIndex(4, backend=backend)
    idx.insert(np.array([[1, 2], [3, 4]], np.uint64), [5, 6])
    ids, vals = idx.evict(target)
    assert ids.shape == (0, 2) and vals.shape == (0,) and len(idx) == 2


@pytest.mark.parametrize("capacity", [2**40, 2**62, 2**63 - 1])
def test_an_index_too_large_to_allocate_names_the_capacity(capacity):
    """numba preallocates its tables: 2**62 raised numpy's "Maximum allowed dimension exceeded",
    naming neither the argument nor the size."""
    with pytest.raises(ValueError, match=r"capacity: .* bytes"):
        ucm.BlockIndex(capacity, backend="fast")


# ---------------------------------------------------------------------------------------------
# buffers

def test_buffer_given_back_twice_is_not_handed_to_two_takers():
    pool = BufferPool(lambda n: torch.empty(n, dtype=torch.uint8), min_bytes=16)
    buf = pool.take(16)
    pool.give(buf)
    pool.give(buf)
    a, b = pool.take(16), pool.take(16)
    assert a is not b
