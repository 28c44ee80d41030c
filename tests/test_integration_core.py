"""The engine-free core's synchronous page transfers (:meth:`WorkerCore.save_blocks`,
:meth:`~WorkerCore.load_blocks`, :meth:`~WorkerCore.leading_hits`, what SGLang's HiCache backend
stands on) over a real memory|posix store and a strided CPU layout: exact round trips into
other blocks, untouched destinations for misses and corrupt blocks, no rewrite of stored blocks,
and a fresh interpreter that shows the core imports no engine."""
import os
import subprocess
import sys

import numpy as np
import torch

import ucm
from ucm.integration.core import WorkerCore
from ucm.store import open_store

L, NB, PS, H, D = 3, 10, 4, 2, 8


def _pool(seed=None):
    """A page_first-like buffer [2, tokens, layers, heads, dim] cut into 2 views of pages."""
    buf = torch.empty(2, NB * PS, L, H, D, dtype=torch.bfloat16)
    if seed is None:
        buf.view(torch.int16).fill_(-3)
    else:
        g = torch.Generator().manual_seed(seed)
        buf.view(torch.int16).copy_(torch.randint(-2**15, 2**15 - 1, buf.shape, generator=g,
                                                  dtype=torch.int16))
    views = [b.unflatten(0, (NB, PS)) for b in buf.unbind(0)]
    return buf, ucm.KVLayout.from_views(views, [0, 0])


def _core(root, layout, ns=b"core-test-space!"):
    store = open_store({"store": {"pipeline": "memory|posix", "posix": {"roots": [str(root)]}}},
                       block_bytes=layout.block_bytes, shard_bytes=layout.block_bytes,
                       namespace=ns)
    return WorkerCore(layout, store, "cpu", shard_bytes=layout.block_bytes)


def _ids(n, salt=7):
    return np.array([[salt, 1000 + i] for i in range(n)], dtype=np.uint64)


def _page(buf, p):
    return buf[:, p * PS:(p + 1) * PS]


def test_save_then_load_moves_exact_pages_into_other_blocks(tmp_path):
    src, lay = _pool(seed=1)
    core = _core(tmp_path, lay)
    ids = _ids(4)
    assert core.save_blocks(ids, [5, 1, 7, 2]).all()
    assert core.leading_hits(ids) == 4 and core.leading_hits(_ids(3, salt=8)) == 0
    dst, lay2 = _pool()
    core2 = _core(tmp_path, lay2)                      # a new process's store over one folder
    ok = core2.load_blocks(np.concatenate([ids, _ids(1, salt=9)]), [0, 8, 3, 6, 9])
    assert ok.tolist() == [True, True, True, True, False]
    for s, d in zip([5, 1, 7, 2], [0, 8, 3, 6]):
        assert torch.equal(_page(dst, d).view(torch.int16), _page(src, s).view(torch.int16))
    for d in (1, 2, 4, 5, 7, 9):                       # untouched, the missed block included
        assert (_page(dst, d).view(torch.int16) == -3).all()
    t = core2.stats()
    assert t["ucm_load_blocks_total"] == 4 and t["ucm_load_failed_blocks_total"] == 1
    core.store.close()
    core2.store.close()


def test_stored_blocks_are_not_written_again_and_faults_are_false(tmp_path):
    src, lay = _pool(seed=2)
    core = _core(tmp_path, lay)
    ids = _ids(3)
    assert core.save_blocks(ids[:2], [0, 1]).all()
    other, _ = _pool(seed=3)
    src.copy_(other)                                   # same ids, other bytes: not rewritten
    assert core.save_blocks(ids, [0, 1, 2]).all()
    dst, lay2 = _pool()
    core2 = _core(tmp_path, lay2)
    core2.load_blocks(ids, [3, 4, 5])
    assert not torch.equal(_page(dst, 3).view(torch.int16), _page(src, 0).view(torch.int16))
    assert torch.equal(_page(dst, 5).view(torch.int16), _page(src, 2).view(torch.int16))
    core.store.close()                                 # a closed store: False, no exception
    assert not core.save_blocks(_ids(2, salt=11), [0, 1]).any()
    assert not core.load_blocks(ids, [0, 1, 2]).any()
    core2.store.close()


def test_a_corrupt_block_loads_as_a_miss_and_leaves_the_page(tmp_path):
    src, lay = _pool(seed=4)
    core = _core(tmp_path, lay)
    ids = _ids(2)
    core.save_blocks(ids, [0, 1])
    core.store.close()
    posix = open_store({"store": {"pipeline": "posix", "posix": {"roots": [str(tmp_path)]}}},
                       block_bytes=lay.block_bytes, namespace=b"core-test-space!")
    victim = posix.path_of(ids[1])
    posix.close()
    with open(victim, "r+b") as f:
        f.seek(4096 + 100)
        b = f.read(1)
        f.seek(4096 + 100)
        f.write(bytes([b[0] ^ 1]))
    dst, lay2 = _pool()
    core2 = _core(tmp_path, lay2)                      # (fresh memory tier: reads the file)
    assert core2.load_blocks(ids, [2, 3]).tolist() == [True, False]
    assert (_page(dst, 3).view(torch.int16) == -3).all()
    core2.store.close()


def test_the_core_imports_no_engine():
    code = ("import sys, ucm.integration.core; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('vllm', 'sglang')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(__file__))
