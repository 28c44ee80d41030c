"""KV transfer (gather_blocks / scatter_blocks), every registered implementation against the
reference (tests/equivalence.py) per element dtype and KV layout (the layouts of
tests/test_transfer.py: vLLM's GPU, CPU and generic stride orders, packed, padded, sliced and
mixed views); test_transfer.py checks the reference against an independent oracle.

Inputs: repeated blocks and -1 rows (left untouched) in a gather, -1 rows in a scatter, no
index at all, one index, the last layer alone into a column slice of wider rows. Staging rows and
caches start as a sentinel, so a stray or missing write differs from the reference."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ucm  # noqa: E402
from equivalence import compare, devices, implementation_params, runnable  # noqa: E402
from test_transfer import DTYPE_IDS, DTYPES, LAYOUTS, SENTINEL, Cache  # noqa: E402


class _Layout:
    """What the transfer verifiers read of a KVLayout: its device."""

    def __init__(self, device):
        self.device = torch.device(device)


def _sample(device):
    return (_Layout(device),)


GATHER = [5, -1, 0, 3, 5, 2]       # a repeated block, a skipped row
SCATTER = [5, -1, 0, 3, 2]         # distinct blocks
SHAPE = dict(B=6, N=4, H=2, D=8, L=2)


def _gather(cache, idx, layers=None, wide=0):
    """Staging rows (``wide`` sentinel bytes on either side of each row's slice) after a gather."""
    lay, dev = cache.layout, cache.bufs[0].device

    def run(backend):
        n = lay.row_bytes(layers)
        rows = torch.full((len(idx), n + 2 * wide), SENTINEL, dtype=torch.uint8, device=dev)
        ucm.gather_blocks(lay, torch.tensor(idx, dtype=torch.int64, device=dev),
                          rows[:, wide:wide + n], layers, backend=backend)
        return rows
    return run


def _scatter(layout_name, dtype, device, src, idx, layers=None):
    """A sentinel cache's backing bytes after scattering ``src`` into it."""
    def run(backend):
        target = Cache(layout_name, dtype, device, **SHAPE).fill(SENTINEL)
        ucm.scatter_blocks(target.layout, src, idx, layers, backend=backend)
        return [r.clone() for r in target.raw()]
    return run


@pytest.mark.parametrize("impl", implementation_params("gather_blocks", _sample, devices()))
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gather_scatter(impl, dtype, layout_name, monkeypatch):
    backend, device = runnable("gather_blocks", impl, monkeypatch)
    gen = torch.Generator().manual_seed(7)
    cache = Cache(layout_name, dtype, device, **SHAPE).fill_random(gen)
    before = cache.snapshot()
    for idx in (GATHER, [], [SHAPE["B"] - 1]):
        compare("gather_blocks", _gather(cache, idx), backend, torch.uint8)
    last = SHAPE["L"] - 1                  # one layer, into a column slice of wider rows
    compare("gather_blocks", _gather(cache, GATHER, [last], wide=5), backend, torch.uint8)
    assert cache.equals(before), "a gather wrote into the cache"

    rows = torch.randint(0, 256, (len(SCATTER), cache.layout.block_bytes), generator=gen,
                         dtype=torch.uint8).to(device)
    for idx in (SCATTER, [-1, -1]):
        src = rows[: len(idx)]
        compare("scatter_blocks", _scatter(layout_name, dtype, device, src, np.array(idx)),
                backend, torch.uint8)
    shard = rows[:, :cache.layout.shard_bytes(last)]
    compare("scatter_blocks", _scatter(layout_name, dtype, device, shard, SCATTER, [last]),
            backend, torch.uint8)
    compare("scatter_blocks", _scatter(layout_name, dtype, device, rows[:0], []), backend,
            torch.uint8)
