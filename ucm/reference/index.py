"""Reference block index: a dict in LRU order (``OrderedDict``), one Python step per id.

Maps a 128-bit block id (``uint64 [2]``) to a non-negative ``int64`` value (a slot, a size ...)
and keeps least-recently-used order. Contract shared with ``ucm.fast.numba.index.BlockIndex``
(same method names, arguments and return types; inputs are validated by ``ucm.ops``):

* ``insert(ids, values) -> (new uint8[n], evicted_ids uint64[m, 2], evicted_values int64[m])``:
  ids are processed in order; an existing id gets the new value and becomes most recent
  (``new=0``); a new id (``new=1``) first evicts the least recent entry when the index is full.
* ``lookup(ids) -> int64[n]``: value or -1; does not change the LRU order.
* ``lookup_prefix(ids) -> int``: number of leading ids present; no LRU change.
* ``touch(ids) -> uint8[n]``: found flags; found ids become most recent, in order.
* ``remove(ids) -> int64[n]``: removed value or -1.
* ``evict(target) -> (ids uint64[m, 2], values int64[m])``: drop least-recent entries until at
  most ``target`` remain, oldest first.
* ``entries() -> (ids, values)`` oldest first; ``len(index)``; ``capacity``.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np


def _keys(ids: np.ndarray):
    return [(a, b) for a, b in ids.tolist()]


def _pack(pairs: list) -> tuple[np.ndarray, np.ndarray]:
    ids = np.array([k for k, _ in pairs], dtype=np.uint64).reshape(-1, 2)
    vals = np.array([v for _, v in pairs], dtype=np.int64)
    return ids, vals


class BlockIndex:
    def __init__(self, capacity: int):
        self.capacity = int(capacity)
        self._d: OrderedDict = OrderedDict()

    def __len__(self) -> int:
        return len(self._d)

    def insert(self, ids, values):
        new = np.zeros(len(ids), dtype=np.uint8)
        evicted = []
        for i, (key, value) in enumerate(zip(_keys(ids), values.tolist())):
            if key in self._d:
                self._d[key] = value
                self._d.move_to_end(key)
                continue
            if len(self._d) >= self.capacity:
                evicted.append(self._d.popitem(last=False))
            self._d[key] = value
            new[i] = 1
        return (new, *_pack(evicted))

    def lookup(self, ids):
        return np.array([self._d.get(k, -1) for k in _keys(ids)], dtype=np.int64)

    def lookup_prefix(self, ids) -> int:
        n = 0
        for key in _keys(ids):
            if key not in self._d:
                break
            n += 1
        return n

    def touch(self, ids):
        found = np.zeros(len(ids), dtype=np.uint8)
        for i, key in enumerate(_keys(ids)):
            if key in self._d:
                self._d.move_to_end(key)
                found[i] = 1
        return found

    def remove(self, ids):
        return np.array([self._d.pop(k, -1) for k in _keys(ids)], dtype=np.int64)

    def evict(self, target: int):
        evicted = []
        while len(self._d) > target:
            evicted.append(self._d.popitem(last=False))
        return _pack(evicted)

    def entries(self):
        return _pack(list(self._d.items()))
