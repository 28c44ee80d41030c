"""A pipeline of tiers, fastest first (``"memory|posix"``, any order and length).

* lookup: tier by tier, asking a tier only about the blocks the tiers above missed;
* load: each block from the first tier that has it; blocks found below the first tier are
  promoted upward (copied into and committed in the faster tiers) once loaded whole, before the
  load reports done (the caller may reuse its buffer right after);
* dump: write-through to every tier (a block succeeds if at least one tier stored it), or
  write-back: only the first tier, with lower tiers written in the background after commit;
* commit: in every tier; stats: each tier's counters plus the pipeline's hits per tier.

Write admission (``store.admission="second_hit"``, :mod:`ucm.store.policy`): the tiers below the first
store a block only once it proved useful: the second time it is dumped, or when a load reads it
from the first tier (then it is written down in the background). A refused block is simply not
in that tier; the first tier still holds it.
"""
from __future__ import annotations

import logging
import threading
from ucm import threads
from typing import Sequence

import numpy as np

from ucm.ids import as_ids
from ucm.store.base import BlockBuffers, KVStore, Task, TaskResult, combine, subset_buffers as _subset
from ucm.store.policy import ADMISSIONS, SecondHitAdmission

log = logging.getLogger("ucm.store.pipeline")


class PipelineStore(KVStore):
    name = "pipeline"

    def __init__(self, tiers: Sequence[KVStore], write_back: bool = False, admission: str = "all",
                 admission_window: int = 1 << 16):
        tiers = list(tiers)
        if admission not in ADMISSIONS:
            raise ValueError(f"store.admission: {admission!r}: expected one of "
                             f"{', '.join(ADMISSIONS)}")
        if not tiers:
            raise ValueError("store.pipeline: at least one tier")
        geo = tiers[0].geometry
        for t in tiers[1:]:
            if t.geometry != geo:
                raise ValueError(f"store.pipeline: tier {t.name!r} has geometry {t.geometry}, "
                                 f"{tiers[0].name!r} has {geo}")
            if t.namespace != tiers[0].namespace:
                raise ValueError(f"store.pipeline: tier {t.name!r} serves another namespace than "
                                 f"{tiers[0].name!r}")
        if len({id(t) for t in tiers}) != len(tiers):
            raise ValueError("store.pipeline: the same tier object is listed twice")
        super().__init__(geo, max(t.wait_timeout_s for t in tiers), tiers[0].namespace)
        self.tiers = tiers
        self.write_back = bool(write_back) and len(tiers) > 1
        self._hits = np.zeros(len(tiers), dtype=np.int64)
        self._lookups = 0
        self._lock = threading.Lock()
        self._bg = threads.pool(2, "ucm-pipeline")
        self._inflight: set = set()
        self._admission = SecondHitAdmission(admission_window) \
            if admission == "second_hit" and len(tiers) > 1 else None
        self._decided: dict = {}  # key -> admitted, for blocks between dump and commit

    @property
    def process_local(self) -> bool:
        return all(t.process_local for t in self.tiers)

    def generation(self) -> int:
        return max(t.generation() for t in self.tiers)

    def set_generation(self, value: int) -> int:
        """Every tier at one generation (the highest any of them had, at least ``value``)."""
        target = max(int(value), self.generation())
        return min(t.set_generation(target) for t in self.tiers)

    def _where(self, ids: np.ndarray, count: bool = True) -> np.ndarray:
        """Index of the first tier holding each block, or -1 (``count``: in the hit rates)."""
        where = np.full(len(ids), -1, dtype=np.int64)
        todo = np.arange(len(ids))
        for k, tier in enumerate(self.tiers):
            if not len(todo):
                break
            found = np.asarray(tier.lookup(ids[todo]), dtype=bool)
            where[todo[found]] = k
            todo = todo[~found]
        if count:
            with self._lock:
                self._lookups += len(ids)
                for k in range(len(self.tiers)):
                    self._hits[k] += int((where == k).sum())
        return where

    def lookup(self, block_ids) -> list[bool]:
        return (self._where(as_ids(block_ids, "block_ids")) >= 0).tolist()

    def lookup_prefix(self, block_ids) -> int:
        ids = as_ids(block_ids, "block_ids")
        n = 0
        for tier in self.tiers:  # a block may sit in any tier: extend the run tier by tier
            while n < len(ids):
                step = tier.lookup_prefix(ids[n:])
                if step == 0:
                    break
                n += step
            if n == len(ids):
                break
        # blocks interleaved between tiers: finish with an exact per-block check
        while n < len(ids) and any(t.lookup(ids[n:n + 1])[0] for t in self.tiers):
            n += 1
        return n

    # -- load -----------------------------------------------------------------------------------
    def _load(self, ids, offset, bufs: BlockBuffers, shards) -> Task:
        where = self._where(ids)
        parts, order = [], []
        for k, tier in enumerate(self.tiers):
            rows = np.flatnonzero(where == k)
            if len(rows):
                parts.append(tier._load(ids[rows], offset, _subset(bufs, rows), shards))
                order.append(rows)
        missing = np.flatnonzero(where < 0)
        task = Task("load", ids)
        task.add_part()
        task.finish_part([], {int(i): "miss" for i in missing})
        full = offset == 0 and len(shards) == self.geometry.n_shards
        for k_part, (sub, rows) in enumerate(zip(parts, order)):
            task.add_part()
            tier_k = int(where[rows[0]])

            def done(child, rows=rows, tier_k=tier_k):
                r = child.wait(0)
                if full and tier_k > 0 and r.ok.any():
                    # Promote before the load reports done: the caller owns dst afterwards and
                    # may overwrite it (a later copy of it could store the wrong bytes).
                    good = rows[r.ok]
                    self._promote(ids[good], _subset(bufs, good), tier_k)
                if tier_k == 0 and self._admission is not None and r.ok.any():
                    # queued before the load reports done, so a flush() after it waits for it
                    self._background(self._write_down, ids[rows[r.ok]])
                task.finish_part(rows[r.ok], {int(rows[i]): e for i, e in r.errors.items()}, r.nbytes)
            sub.on_done(done)
        return task.seal()

    def _promote(self, ids, bufs: BlockBuffers, below: int) -> None:
        for tier in self.tiers[:below]:
            try:
                t = tier._dump(ids, 0, bufs, range(self.geometry.n_shards))
                r = tier.wait(t)
                tier.commit(ids, r.ok)
                self._stats.add(promotions=int(r.ok.sum()))
            except Exception as exc:  # promotion is an optimisation: never fail a load for it
                log.warning("ucm pipeline: promotion into %s failed: %r", tier.name, exc)

    def borrow(self, block_ids):
        """The first tier's zero-copy view (blocks only in lower tiers come back as -1)."""
        out = self.tiers[0].borrow(block_ids)
        if out is not None:
            held = int((out.rows >= 0).sum())
            with self._lock:
                self._lookups += len(out.rows)
                self._hits[0] += held
        return out

    def prefetch(self, block_ids) -> None:
        """Promote blocks that only lower tiers hold into the first tier, in the background."""
        ids = as_ids(block_ids, "block_ids")
        where = self._where(ids, count=False)  # a hint, not a request: not in the hit rates
        lower = np.flatnonzero(where > 0)
        if not len(lower):
            return
        self._background(self._prefetch, ids[lower])

    def _prefetch(self, ids) -> None:
        """Read the blocks from the tier that holds them; a whole-block load promotes them."""
        host = np.empty((len(ids), self.geometry.block_bytes), dtype=np.uint8)
        self.wait(self.load(ids, 0, host))

    # -- dump / commit --------------------------------------------------------------------------
    def _admitted(self, ids) -> np.ndarray:
        """Rows the lower tiers may store; one decision per block from its first dump until
        its commit (a layer-wise save dumps each block once per layer)."""
        if self._admission is None:
            return np.arange(len(ids))
        keys = [ids[i].tobytes() for i in range(len(ids))]
        with self._lock:
            new = [k for k in keys if k not in self._decided]
            for k, ok in zip(new, self._admission.admit(new)):
                self._decided[k] = ok
            if len(self._decided) > 4 * self._admission.window:  # commits that never came
                self._decided.clear()
            return np.asarray([i for i, k in enumerate(keys) if self._decided.get(k, True)],
                              dtype=np.int64)

    def _dump(self, ids, offset, bufs: BlockBuffers, shards) -> Task:
        targets = self.tiers[:1] if self.write_back else self.tiers
        rows = [np.arange(len(ids))] + [self._admitted(ids)] * (len(targets) - 1)
        subs = [t._dump(ids[r], offset, _subset(bufs, r), shards) for t, r in zip(targets, rows)]
        task = Task("dump", ids)
        task.add_part()

        def finish(_):
            results = []
            for sub, r in zip(subs, rows):  # back to the caller's rows (refused rows: not ok)
                res = sub.wait(0)
                ok_full = np.zeros(len(ids), dtype=bool)
                ok_full[r[res.ok]] = True
                results.append(TaskResult(ok_full, {int(r[i]): e for i, e in res.errors.items()},
                                          res.nbytes, res.seconds))
            ok = np.zeros(len(ids), dtype=bool)
            for r in results:
                ok |= r.ok
            errors = {}
            for i in np.flatnonzero(~ok):
                errors[int(i)] = "; ".join(f"{t.name}: {r.errors.get(int(i), '?')}"
                                           for t, r in zip(targets, results))
            for t, r in zip(targets, results):
                if r.errors and ok.any():
                    log.info("ucm pipeline: %s failed %d of %d blocks another tier stored",
                             t.name, int((~r.ok & ok).sum()), len(ids))
            task.finish_part(np.flatnonzero(ok), errors, max((r.nbytes for r in results), default=0))
        task.pending = lambda: ", ".join(t.name for t, sub in zip(targets, subs) if not sub.done())
        combine("dump", subs).on_done(finish)
        return task.seal()

    def commit(self, block_ids, success_flags) -> None:
        ids, flags = self._flags(block_ids, success_flags)
        targets = self.tiers[:1] if self.write_back else self.tiers
        for t in targets:
            t.commit(ids, flags)
        if self._admission is not None:
            with self._lock:
                for i in range(len(ids)):
                    self._decided.pop(ids[i].tobytes(), None)
        if self.write_back and flags.any():
            self._background(self._write_back, ids[flags])

    def _write_back(self, ids) -> None:
        if self._admission is not None:
            with self._lock:
                ids = ids[np.asarray(self._admission.admit([ids[i].tobytes() for i in range(len(ids))]),
                                     dtype=bool)]
            if not len(ids):
                return
        host = np.empty((len(ids), self.geometry.block_bytes), dtype=np.uint8)
        r = self.tiers[0].wait(self.tiers[0].load(ids, 0, host))
        good = np.flatnonzero(r.ok)
        if not len(good):
            return
        for tier in self.tiers[1:]:
            res = tier.wait(tier.dump(ids[good], 0, host[good]))
            tier.commit(ids[good], res.ok)

    def _write_down(self, ids) -> None:
        """Blocks read from the first tier proved useful: written to the lower tiers that do
        not hold them yet."""
        held = np.zeros(len(ids), dtype=bool)
        for tier in self.tiers[1:]:
            held |= np.asarray(tier.lookup(ids), dtype=bool)
        missing = ids[~held]
        if len(missing):
            with self._lock:
                self._admission.note([missing[i].tobytes() for i in range(len(missing))])
            self._write_back(missing)

    def _background(self, fn, *args) -> None:
        fut = self._bg.submit(fn, *args)
        with self._lock:
            self._inflight.add(fut)
        fut.add_done_callback(self._forget)

    def _forget(self, fut) -> None:
        with self._lock:
            self._inflight.discard(fut)

    def prepare(self) -> None:
        for t in self.tiers:
            t.prepare()

    def flush(self) -> None:
        """Wait until the background promotions and write-backs queued so far are done."""
        with self._lock:
            pending = list(self._inflight)
        for fut in pending:
            fut.result()

    def stats(self) -> dict:
        out = {}
        for t in self.tiers:
            out.update(t.stats())
        with self._lock:
            lookups = self._lookups
            hits = self._hits.tolist()
        out["pipeline"] = {
            **self._stats.snapshot(),
            "tiers": [t.name for t in self.tiers],
            "lookups": lookups,
            "hits_by_tier": dict(zip((t.name for t in self.tiers), hits)),
            "hit_rate_by_tier": {t.name: (h / lookups if lookups else 0.0)
                                 for t, h in zip(self.tiers, hits)},
            "hit_rate": sum(hits) / lookups if lookups else 0.0,
        }
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._bg.shutdown(wait=True)
        for t in self.tiers:
            t.close()
        super().close()
