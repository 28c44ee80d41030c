"""Store tiers with CUDA buffers (run on a GPU machine; skipped where torch sees no GPU)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from ucm.store import BlockGeometry  # noqa: E402
from ucm.store.memory import MemoryStore  # noqa: E402
from ucm.store.pipeline import PipelineStore  # noqa: E402
from ucm.store.posix import PosixStore  # noqa: E402

BLOCK, SHARD = 256 << 10, 64 << 10


def ids_of(n, tag=1):
    return np.stack([np.arange(n, dtype=np.uint64) + np.uint64(1), np.full(n, tag, np.uint64)], axis=1)


@pytest.fixture(params=["memory", "posix", "memory|posix"])
def store(request, tmp_path):
    geo = BlockGeometry(BLOCK, SHARD)
    if request.param == "memory":
        s = MemoryStore(geo, buffer_number=64)
    elif request.param == "posix":
        s = PosixStore(geo, [str(tmp_path)], bytes(16), capacity_bytes=1 << 30)
    else:
        s = PipelineStore([MemoryStore(geo, buffer_number=8), PosixStore(geo, [str(tmp_path)], bytes(16),
                                                                         capacity_bytes=1 << 30)])
    yield s
    s.close()


def test_cuda_round_trip_whole_and_shards(store):
    n = 20
    ids = ids_of(n)
    src = torch.randint(0, 256, (n, BLOCK), dtype=torch.uint8, device="cuda")
    r = store.wait(store.dump(ids, 0, src))  # issued right after the producing kernel
    assert r.all_ok
    store.commit(ids, r.ok)
    dst = torch.zeros_like(src)
    assert store.wait(store.load(ids, 0, dst)).all_ok
    assert torch.equal(dst, src)
    part = torch.zeros((n, SHARD), dtype=torch.uint8, device="cuda")
    assert store.wait(store.load(ids, 2 * SHARD, part)).all_ok
    assert torch.equal(part, src[:, 2 * SHARD:3 * SHARD])


def test_cuda_strided_rows_and_bf16(store):
    n = 6
    ids = ids_of(n, tag=2)
    big = torch.randn((n, BLOCK // 2 + 64), dtype=torch.bfloat16, device="cuda")
    src = big[:, :BLOCK // 2]  # rows contiguous, row stride larger than the row
    assert store.wait(store.dump(ids, 0, src)).all_ok
    store.commit(ids, True)
    out = torch.zeros((n, BLOCK // 2 + 64), dtype=torch.bfloat16, device="cuda")
    assert store.wait(store.load(ids, 0, out[:, :BLOCK // 2])).all_ok
    assert torch.equal(out[:, :BLOCK // 2], src) and not out[:, BLOCK // 2:].any()


def test_memory_tier_is_pinned():
    s = MemoryStore(BlockGeometry(BLOCK, SHARD), buffer_number=4)
    assert not s.stats()["memory"]["allocated"]  # lazily allocated
    s.prepare()
    assert s.stats()["memory"]["pinned"]
    s.close()
