"""Worker processes for the multi-process store tests (run as ``python tests/store_worker.py``).

Block ids and contents are derived from integers, so every process knows what any block must
contain. Modes:

* ``writer ROOT SEED [BUDGET]``: dump + commit random batches forever (killed by the parent);
* ``mixed ROOT SEED ROUNDS BUDGET``: dump/commit and load overlapping blocks, check every loaded
  byte, print one JSON line of counts.
"""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ucm.store import BlockGeometry  # noqa: E402
from ucm.store.posix import PosixStore  # noqa: E402

BLOCK, SHARD = 256 << 10, 64 << 10
NAMESPACE = bytes(range(16))
POOL = 200


def block_id(k: int) -> np.ndarray:
    return np.array([[0x9E3779B97F4A7C15 * (k + 1) % 2**64, k]], dtype=np.uint64)


def ids_of(keys) -> np.ndarray:
    return np.concatenate([block_id(int(k)) for k in keys])


def content(keys, nbytes=BLOCK) -> np.ndarray:
    out = np.empty((len(keys), nbytes), dtype=np.uint8)
    for i, k in enumerate(keys):
        out[i] = np.random.default_rng(int(k)).integers(0, 256, nbytes, dtype=np.uint8)
    return out


def store(root, budget=1 << 30):
    return PosixStore(BlockGeometry(BLOCK, SHARD), [root], NAMESPACE, capacity_bytes=budget,
                      io_threads=2)


def writer(root, seed, budget=1 << 30):
    s = store(root, budget)
    rng = np.random.default_rng(seed)
    print("ready", flush=True)
    while True:
        keys = rng.choice(POOL, size=int(rng.integers(1, 6)), replace=False)
        if rng.random() < 0.5:  # whole blocks
            r = s.wait(s.dump(ids_of(keys), 0, content(keys)))
        else:  # layer by layer
            data = content(keys)
            for layer in range(BLOCK // SHARD):
                off = layer * SHARD
                r = s.wait(s.dump(ids_of(keys), off, data[:, off:off + SHARD]))
        s.commit(ids_of(keys), r.ok)


def mixed(root, seed, rounds, budget):
    s = store(root, budget)
    rng = np.random.default_rng(seed)
    counts = {"dumped": 0, "loaded": 0, "missed": 0, "bad_bytes": 0, "failed_other": 0}
    for _ in range(rounds):
        keys = rng.choice(60, size=4, replace=False)  # 60 shared keys, overlapping between workers
        r = s.wait(s.dump(ids_of(keys), 0, content(keys)))
        s.commit(ids_of(keys), r.ok)
        counts["dumped"] += int(r.ok.sum())
        keys = rng.choice(60, size=6, replace=False)
        dst = np.zeros((6, BLOCK), np.uint8)
        r = s.wait(s.load(ids_of(keys), 0, dst))
        expected = content(keys)
        for i in range(6):
            if r.ok[i]:
                counts["loaded"] += 1
                counts["bad_bytes"] += int(not np.array_equal(dst[i], expected[i]))
            elif r.errors[i] == "miss":
                counts["missed"] += 1
            else:
                counts["failed_other"] += 1
                print("failure:", r.errors[i], file=sys.stderr)
    counts["quarantined"] = s.stats()["posix"]["quarantined"]
    s.close()
    print(json.dumps(counts), flush=True)


if __name__ == "__main__":
    mode, root = sys.argv[1], sys.argv[2]
    if mode == "writer":
        writer(root, int(sys.argv[3]), *(int(a) for a in sys.argv[4:5]))
    else:
        mixed(root, int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
