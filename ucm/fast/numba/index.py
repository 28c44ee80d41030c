"""Numba block index: array-backed open addressing + an intrusive LRU list, one jitted call per
batch (``nogil``). Same contract as :mod:`ucm.reference.index`.

Layout (all arrays allocated once, at construction):

* ``table int64[T]``: entry number or -1; ``T`` a power of two >= 2 * capacity, so a probe
  always ends at an empty slot. Linear probing; deletion shifts later members of the cluster back
  (no tombstones, so probe lengths do not degrade under churn).
* ``keys uint64[C, 2]``, ``vals int64[C]``: the entries; ``prv/nxt int64[C]``: LRU list links
  (the free list reuses ``nxt``).
* ``meta int64[4]``: oldest entry, newest entry, size, head of the free list.
"""
from __future__ import annotations

import numpy as np

from ucm.fast.numba._jit import njit

_OLD, _NEW, _SIZE, _FREE = 0, 1, 2, 3
_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)
_S29 = np.uint64(29)
_S35 = np.uint64(35)


@njit(inline="always")
def _home(k0, k1, mask):
    h = k0 ^ ((k1 << _S29) | (k1 >> _S35))
    h ^= h >> _S33
    h *= _M1
    h ^= h >> _S33
    h *= _M2
    h ^= h >> _S33
    return np.int64(h & np.uint64(mask))


@njit(inline="always")
def _find(table, keys, k0, k1):
    """(table position, entry): the entry's slot, or (first empty slot, -1)."""
    mask = table.shape[0] - 1
    pos = _home(k0, k1, mask)
    while True:
        e = table[pos]
        if e < 0:
            return pos, -1
        if keys[e, 0] == k0 and keys[e, 1] == k1:
            return pos, e
        pos = (pos + 1) & mask


@njit(inline="always")
def _unlink(meta, prv, nxt, e):
    p = prv[e]
    n = nxt[e]
    if p >= 0:
        nxt[p] = n
    else:
        meta[_OLD] = n
    if n >= 0:
        prv[n] = p
    else:
        meta[_NEW] = p


@njit(inline="always")
def _append(meta, prv, nxt, e):
    last = meta[_NEW]
    prv[e] = last
    nxt[e] = -1
    if last >= 0:
        nxt[last] = e
    else:
        meta[_OLD] = e
    meta[_NEW] = e


@njit(inline="always")
def _delete(table, keys, meta, prv, nxt, e):
    """Remove entry ``e``: table slot (backward-shift), LRU links, back to the free list."""
    mask = table.shape[0] - 1
    pos = _home(keys[e, 0], keys[e, 1], mask)
    while table[pos] != e:
        pos = (pos + 1) & mask
    hole = pos
    table[hole] = -1
    j = hole
    while True:
        j = (j + 1) & mask
        f = table[j]
        if f < 0:
            break
        h = _home(keys[f, 0], keys[f, 1], mask)
        # f may move into the hole unless its home lies cyclically in (hole, j].
        if hole <= j:
            stays = (hole < h) and (h <= j)
        else:
            stays = (h > hole) or (h <= j)
        if not stays:
            table[hole] = f
            table[j] = -1
            hole = j
    _unlink(meta, prv, nxt, e)
    nxt[e] = meta[_FREE]
    meta[_FREE] = e
    meta[_SIZE] -= 1


@njit(nogil=True)
def _insert(table, keys, vals, meta, prv, nxt, ids, values, new, ev_ids, ev_vals):
    cap = keys.shape[0]
    n_ev = 0
    for i in range(ids.shape[0]):
        k0 = ids[i, 0]
        k1 = ids[i, 1]
        pos, e = _find(table, keys, k0, k1)
        if e >= 0:
            vals[e] = values[i]
            _unlink(meta, prv, nxt, e)
            _append(meta, prv, nxt, e)
            new[i] = 0
            continue
        if meta[_SIZE] >= cap:
            victim = meta[_OLD]
            ev_ids[n_ev, 0] = keys[victim, 0]
            ev_ids[n_ev, 1] = keys[victim, 1]
            ev_vals[n_ev] = vals[victim]
            n_ev += 1
            _delete(table, keys, meta, prv, nxt, victim)
            pos, e = _find(table, keys, k0, k1)  # the shift may have moved the empty slot
        e = meta[_FREE]
        meta[_FREE] = nxt[e]
        keys[e, 0] = k0
        keys[e, 1] = k1
        vals[e] = values[i]
        table[pos] = e
        _append(meta, prv, nxt, e)
        meta[_SIZE] += 1
        new[i] = 1
    return n_ev


@njit(nogil=True)
def _lookup(table, keys, vals, ids, out):
    for i in range(ids.shape[0]):
        _, e = _find(table, keys, ids[i, 0], ids[i, 1])
        out[i] = vals[e] if e >= 0 else -1


@njit(nogil=True)
def _lookup_prefix(table, keys, ids):
    for i in range(ids.shape[0]):
        _, e = _find(table, keys, ids[i, 0], ids[i, 1])
        if e < 0:
            return i
    return ids.shape[0]


@njit(nogil=True)
def _touch(table, keys, meta, prv, nxt, ids, found):
    for i in range(ids.shape[0]):
        _, e = _find(table, keys, ids[i, 0], ids[i, 1])
        if e >= 0:
            _unlink(meta, prv, nxt, e)
            _append(meta, prv, nxt, e)
            found[i] = 1
        else:
            found[i] = 0


@njit(nogil=True)
def _remove(table, keys, vals, meta, prv, nxt, ids, out):
    for i in range(ids.shape[0]):
        _, e = _find(table, keys, ids[i, 0], ids[i, 1])
        if e >= 0:
            out[i] = vals[e]
            _delete(table, keys, meta, prv, nxt, e)
        else:
            out[i] = -1


@njit(nogil=True)
def _evict(table, keys, vals, meta, prv, nxt, target, ev_ids, ev_vals):
    n = 0
    while meta[_SIZE] > target:
        victim = meta[_OLD]
        ev_ids[n, 0] = keys[victim, 0]
        ev_ids[n, 1] = keys[victim, 1]
        ev_vals[n] = vals[victim]
        n += 1
        _delete(table, keys, meta, prv, nxt, victim)
    return n


@njit(nogil=True)
def _entries(keys, vals, meta, nxt, out_ids, out_vals):
    e = meta[_OLD]
    n = 0
    while e >= 0:
        out_ids[n, 0] = keys[e, 0]
        out_ids[n, 1] = keys[e, 1]
        out_vals[n] = vals[e]
        n += 1
        e = nxt[e]
    return n


class BlockIndex:
    """Same contract as :class:`ucm.reference.index.BlockIndex`."""

    def __init__(self, capacity: int):
        self.capacity = cap = int(capacity)
        tsize = self._table_size(cap)
        self._table = np.full(tsize, -1, dtype=np.int64)
        self._keys = np.zeros((cap, 2), dtype=np.uint64)
        self._vals = np.zeros(cap, dtype=np.int64)
        self._prv = np.full(cap, -1, dtype=np.int64)
        self._nxt = np.arange(1, cap + 1, dtype=np.int64)
        self._nxt[-1] = -1
        self._meta = np.array([-1, -1, 0, 0], dtype=np.int64)

    @staticmethod
    def _table_size(capacity: int) -> int:
        """Slots of the open-addressing table: a power of two, at least twice the capacity."""
        return max(16, 1 << (2 * capacity - 1).bit_length())

    @classmethod
    def table_bytes(cls, capacity: int) -> int:
        """Bytes the index allocates for ``capacity`` entries: the table's int64 slots, and per
        entry its 16-byte id, value and two list links."""
        return 8 * cls._table_size(capacity) + 40 * capacity

    def __len__(self) -> int:
        return int(self._meta[_SIZE])

    def insert(self, ids, values):
        n = len(ids)
        new = np.zeros(n, dtype=np.uint8)
        ev_ids = np.empty((n, 2), dtype=np.uint64)
        ev_vals = np.empty(n, dtype=np.int64)
        m = _insert(self._table, self._keys, self._vals, self._meta, self._prv, self._nxt,
                    ids, values, new, ev_ids, ev_vals)
        return new, ev_ids[:m].copy(), ev_vals[:m].copy()

    def lookup(self, ids):
        out = np.empty(len(ids), dtype=np.int64)
        _lookup(self._table, self._keys, self._vals, ids, out)
        return out

    def lookup_prefix(self, ids) -> int:
        return int(_lookup_prefix(self._table, self._keys, ids))

    def touch(self, ids):
        found = np.empty(len(ids), dtype=np.uint8)
        _touch(self._table, self._keys, self._meta, self._prv, self._nxt, ids, found)
        return found

    def remove(self, ids):
        out = np.empty(len(ids), dtype=np.int64)
        _remove(self._table, self._keys, self._vals, self._meta, self._prv, self._nxt, ids, out)
        return out

    def evict(self, target: int):
        m = max(len(self) - int(target), 0)
        ev_ids = np.empty((m, 2), dtype=np.uint64)
        ev_vals = np.empty(m, dtype=np.int64)
        _evict(self._table, self._keys, self._vals, self._meta, self._prv, self._nxt,
               np.int64(target), ev_ids, ev_vals)
        return ev_ids, ev_vals

    def entries(self):
        n = len(self)
        out_ids = np.empty((n, 2), dtype=np.uint64)
        out_vals = np.empty(n, dtype=np.int64)
        _entries(self._keys, self._vals, self._meta, self._nxt, out_ids, out_vals)
        return out_ids, out_vals
