"""Trace replay: hit rate of the real store code on a request trace, per policy and capacity.

A trace is JSON lines, one request each (the format of the Mooncake conversation trace, see
``benchmarks/data/README.md``)::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

``hash_ids`` are the ids of the prompt's blocks of ``block_tokens`` tokens (the last one may be
partial), chained as prefix hashes are. Replay drives a real :class:`~ucm.store.memory.MemoryStore`
(and, with ``tiers="memory|posix"``, a real :class:`~ucm.store.pipeline.PipelineStore` over a
posix tier in a temporary directory) in metadata-only mode: every block is one 8-byte shard, so
the index, eviction, admission and promotion logic run exactly as in service while no KV bytes
exist. Each request does what the connector does: ``lookup_prefix``, ``load`` of the hits, then
``dump`` + ``commit`` of the rest. Bytes are reported for the modelled block size
(``kv_bytes_per_token × block_tokens``).

Reference curves: LRU is a policy of the store; the offline optimum is Belady's MIN over the
same accesses (it evicts the block used furthest in the future; a block never used again first).
"""
from __future__ import annotations

import gzip
import heapq
import json
import math
import os
import tempfile
import zlib
from dataclasses import asdict, dataclass, field
from typing import Iterable, Optional, Sequence

import numpy as np

from ucm.files import open_regular
from ucm.store.policy import ADMISSIONS, POLICIES


class TraceError(ValueError):
    """A malformed trace line (``line`` is 1-based)."""

    def __init__(self, line: int, why: str):
        super().__init__(f"trace line {line}: {why}")
        self.line, self.why = line, why


@dataclass
class Request:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: list


@dataclass
class Trace:
    requests: list
    skipped: list = field(default_factory=list)  # (line, why) of the lines left out
    block_tokens: int = 512

    @property
    def distinct_blocks(self) -> int:
        return len({h for r in self.requests for h in r.hash_ids})

    @property
    def blocks(self) -> int:
        return sum(len(r.hash_ids) for r in self.requests)


def _check_request(obj, line: int, block_tokens: int = 512) -> Request:
    if not isinstance(obj, dict):
        raise TraceError(line, f"expected a JSON object, got {type(obj).__name__}")
    for key in ("timestamp", "input_length", "hash_ids"):
        if key not in obj:
            raise TraceError(line, f"missing key {key!r}")
    ts, n_in, ids = obj["timestamp"], obj["input_length"], obj["hash_ids"]
    n_out = obj.get("output_length", 0)
    try:  # (an int past the floats, 1e400, is no finite time either)
        ts_f = math.nan if isinstance(ts, bool) or not isinstance(ts, (int, float)) else float(ts)
    except OverflowError:
        ts_f = math.inf
    if not math.isfinite(ts_f) or ts_f < 0:
        raise TraceError(line, f"timestamp must be a finite number >= 0, got {ts!r}")
    for name, v in (("input_length", n_in), ("output_length", n_out)):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**63:
            raise TraceError(line, f"{name} must be an int in [0, 2**63), got {v!r}")
    if not isinstance(ids, list) or not ids:
        raise TraceError(line, "hash_ids must be a non-empty list of ints")
    if any(isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < 2**64 for h in ids):
        raise TraceError(line, "hash_ids must be ints in [0, 2**64)")
    if len(set(ids)) != len(ids):
        raise TraceError(line, "hash_ids repeats an id (a chain of prefix hashes cannot)")
    if n_in and n_in <= block_tokens * (len(ids) - 1):
        # more blocks than the prompt has tokens: the token-weighted figures would count
        # tokens the request never had (a trace hashed at another block size, most likely)
        raise TraceError(line, f"input_length {n_in} is too short for {len(ids)} hash_ids of "
                               f"{block_tokens} tokens (at most {-(-n_in // block_tokens)}): "
                               f"is block_tokens right?")
    return Request(float(ts), n_in, n_out, list(ids))


def load_trace(path: str, on_error: str = "stop", block_tokens: int = 512,
               limit: Optional[int] = None) -> Trace:
    """Read a JSON-lines trace (gzip or plain, told by its first bytes). ``on_error``: ``"stop"`` raises
    :class:`TraceError` at the first malformed line; ``"skip"`` leaves it out and records
    ``(line, why)`` in ``trace.skipped``. Requests are replayed in timestamp order."""
    if on_error not in ("stop", "skip"):
        raise ValueError(f"on_error: expected 'stop' or 'skip', got {on_error!r}")
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
        raise ValueError(f"block_tokens must be an int >= 1, got {block_tokens!r}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be an int >= 1 or None, got {limit!r}")
    try:  # gzip by its magic bytes (a .gz name alone can lie, and so can a plain one)
        raw = open_regular(path)                # (not a FIFO or a device: no hang)
        try:
            is_gz = raw.read(2) == b"\x1f\x8b"
            raw.seek(0)
        except OSError:
            raw.close()
            raise
        f = gzip.GzipFile(fileobj=raw, mode="rb") if is_gz else raw
    except OSError as exc:
        raise ValueError(f"trace {str(path)!r}: cannot read it ({exc.strerror or exc})") from None
    reqs, skipped = [], []
    n = 0
    with raw, f:
        while True:
            try:
                raw = f.readline()
            except (OSError, EOFError, zlib.error) as exc:
                why = f"{path}: the gzip stream is damaged or cut short ({exc})"
                if on_error == "stop":
                    raise TraceError(n + 1, why) from None
                skipped.append((n + 1, why))   # nothing after it can be read
                break
            if not raw:
                break
            n += 1
            try:
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise TraceError(n, f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at "
                                        f"column {exc.start + 1})") from None
                if not text.strip():
                    continue
                try:
                    obj = json.loads(text)
                except json.JSONDecodeError as exc:
                    raise TraceError(n, f"not JSON ({exc.msg})") from None
                reqs.append(_check_request(obj, n, block_tokens))
            except TraceError as exc:
                if on_error == "stop":
                    raise
                skipped.append((exc.line, exc.why))
            if limit is not None and len(reqs) >= limit:
                break
    if not reqs:
        raise TraceError(0, f"{path}: no valid request")
    reqs.sort(key=lambda r: r.timestamp_ms)
    return Trace(reqs, skipped, block_tokens)


# ---------------------------------------------------------------------------------------------
# ids and capacities

def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: trace ids (small ints) become uniform 64-bit words, as real block
    ids (hashes) are; the ``prefix`` policy samples ids by their bits."""
    x = (x + np.uint64(0x9E3779B97F4A7C15)) & np.uint64(0xFFFFFFFFFFFFFFFF)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def block_ids(hash_ids: Sequence[int]) -> np.ndarray:
    """Store ids (``uint64 [n, 2]``) for trace ids."""
    h = np.asarray(hash_ids, dtype=np.uint64)
    with np.errstate(over="ignore"):
        return np.stack([_mix64(h), _mix64(h ^ np.uint64(0x5555555555555555))], axis=1)


def resolve_capacity(cap, distinct: int) -> int:
    """A capacity in blocks: a float in (0, 1] is a fraction of the trace's distinct blocks,
    an int >= 1 a block count (more than the distinct blocks holds them all: clamped)."""
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not math.isfinite(cap) or cap <= 0:
        raise ValueError(f"capacity {cap!r}: expected a fraction in (0, 1] of the trace's distinct "
                         f"blocks or a block count >= 1")
    if isinstance(cap, float):
        if cap > 1:
            raise ValueError(f"capacity {cap!r}: a fraction must be at most 1 (an int is a block count)")
        return max(1, int(cap * distinct))
    return min(int(cap), distinct)


# ---------------------------------------------------------------------------------------------
# replay

@dataclass
class Costs:
    """Per-block load time of each tier and per-token prefill time, seconds."""
    load_s: dict = field(default_factory=lambda: {"memory": 2e-4, "posix": 2e-3})
    prefill_s_per_token: float = 1e-4


@dataclass
class ReplayResult:
    policy: str
    capacity_blocks: int
    capacity_fraction: float
    tiers: str
    hit_rate: float              # prefix hits / prompt blocks
    token_hit_rate: float        # prefix-hit tokens / prompt tokens
    hits_per_tier: dict
    bytes_read: dict
    bytes_written: dict
    evictions: dict
    prefill_saved_s: float       # recompute time avoided minus load time spent
    prefill_total_s: float       # recompute time of every prompt token
    load_s: float = 0.0          # load time on the critical path
    admission: str = "all"
    prefetch: bool = False
    prefetched_blocks: int = 0   # promoted ahead of use
    mean_queue_s: float = 0.0    # mean wait for an engine

    def row(self) -> dict:
        return asdict(self)


def _token_counts(req: Request, block_tokens: int) -> np.ndarray:
    n = len(req.hash_ids)
    toks = np.full(n, block_tokens, dtype=np.int64)
    toks[-1] = max(1, req.input_length - block_tokens * (n - 1)) if req.input_length else block_tokens
    return np.minimum(toks, block_tokens)


def _check_costs(costs: Optional[Costs]) -> None:
    """Times are finite and >= 0 (a negative or NaN one would make every figure from it wrong)."""
    if costs is None:
        return
    items = [(f"load_s[{k!r}]", v) for k, v in dict(costs.load_s).items()]
    items.append(("prefill_s_per_token", costs.prefill_s_per_token))
    for name, v in items:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"costs: {name} must be a finite number of seconds >= 0, got {v!r}")


def replay(trace: Trace, capacity, policy: str = "lru", tiers: str = "memory",
           lower_capacity=None, admission: str = "all", costs: Optional[Costs] = None,
           kv_bytes_per_token: int = 131072, prefetch: bool = False, engines: int = 4,
           progress: bool = False) -> ReplayResult:
    """Replay ``trace`` through the real store at one capacity (blocks or a fraction, see
    :func:`resolve_capacity`) of the first tier; ``tiers="memory|posix"`` adds a posix tier of
    ``lower_capacity`` (default: 4× the memory tier) with the ``admission`` rule.

    Timing model (for the load time on the critical path and the queueing it causes): requests
    arrive at their timestamps and wait for the first free of ``engines`` engines; an engine
    spends the loads of the prefix hits (per tier, ``costs.load_s``) plus the prefill of the
    other tokens on it. With ``prefetch``, an arriving request's blocks that only the posix tier
    holds are promoted by the store's own ``prefetch`` on one background stream; if that
    finishes before an engine takes the request, they load at memory cost."""
    if isinstance(engines, bool) or not isinstance(engines, int) or engines < 1:
        raise ValueError(f"engines must be an int >= 1, got {engines!r}")
    if not trace.requests:
        raise ValueError("replay: the trace has no request")
    if isinstance(kv_bytes_per_token, bool) or not isinstance(kv_bytes_per_token, int) \
            or kv_bytes_per_token < 1:
        raise ValueError(f"kv_bytes_per_token must be an int >= 1, got {kv_bytes_per_token!r}")
    _check_costs(costs)
    from ucm.store.base import BlockGeometry
    from ucm.store.memory import MemoryStore

    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r}: expected one of {', '.join(POLICIES)}")
    if tiers not in ("memory", "memory|posix"):
        raise ValueError(f"tiers {tiers!r}: expected 'memory' or 'memory|posix'")
    if admission not in ADMISSIONS:
        raise ValueError(f"admission {admission!r}: expected one of {', '.join(ADMISSIONS)}")
    costs = costs or Costs()
    distinct = trace.distinct_blocks
    cap = resolve_capacity(capacity, distinct)
    if tiers == "memory|posix":  # (checked before a store is made: a failure leaks none)
        try:
            low = resolve_capacity(lower_capacity if lower_capacity is not None else 4 * cap,
                                   distinct)
        except ValueError as exc:
            raise ValueError(f"lower_capacity: {exc}") from None
    geo = BlockGeometry(8, 8)
    mem = MemoryStore(geo, buffer_number=cap, io_threads=1, copy_threads=1, pin=False, policy=policy)
    store, tmp, names = mem, None, ["memory"]
    if tiers == "memory|posix":
        from ucm.store.pipeline import PipelineStore
        from ucm.store.posix import PosixStore

        tmp = tempfile.TemporaryDirectory(prefix="ucm-replay-")
        from ucm.store import format as fmt

        # the tier's own budget, in bytes of its block files: it collects least recently used
        # files (access time) when a dump would pass it
        posix = PosixStore(geo, roots=[tmp.name], io_threads=1,
                           capacity_bytes=low * (fmt.header_size(geo.n_shards) + geo.block_bytes))
        store = PipelineStore([mem, posix], admission=admission)
        names = ["memory", "posix"]
    block_bytes = kv_bytes_per_token * trace.block_tokens
    hits = tok_hits = blocks = toks = 0
    per_tier = {n: 0 for n in names}
    load_s = 0.0
    buf = np.zeros((max(len(r.hash_ids) for r in trace.requests), 8), dtype=np.uint8)
    from ucm.progress import track

    lower = store.tiers[1] if tiers != "memory" else None
    engines_free = [0.0] * engines  # when each engine is free next (a heap)
    lane_free = 0.0                 # when the prefetch stream is free next
    waited = critical_load = 0.0
    prefetched = 0

    def in_memory(rows_ids) -> np.ndarray:
        return np.asarray(mem.lookup(rows_ids), dtype=bool)

    try:
        for req in track(trace.requests, f"replay {policy} @{cap}", "req", quiet=not progress):
            arrival = req.timestamp_ms / 1000.0
            ids = block_ids(req.hash_ids)
            tcount = _token_counts(req, trace.block_tokens)
            ready_at = None
            if prefetch and lower is not None:
                # the request is queued: its blocks that only the lower tier holds move up now,
                # on one background stream, while it waits for an engine
                k0 = store.lookup_prefix(ids)
                up = int((~in_memory(ids[:k0])).sum()) if k0 else 0
                if up:
                    store.prefetch(ids[:k0])
                    store.flush()
                    lane_free = max(arrival, lane_free) + up * costs.load_s.get("posix", 0.0)
                    ready_at = lane_free
                    prefetched += up
            start = max(arrival, heapq.heappop(engines_free))
            k = store.lookup_prefix(ids)
            load = 0.0
            if k:
                mem_rows = in_memory(ids[:k])
                n_mem, n_low = int(mem_rows.sum()), int((~mem_rows).sum())
                if ready_at is not None and ready_at > start:
                    # promoted too late: the engine waited for the slower reads after all
                    n_low = min(up, k)
                    n_mem = k - n_low
                per_tier["memory"] += n_mem
                if lower is not None:
                    per_tier["posix"] += n_low
                load = n_mem * costs.load_s.get("memory", 0.0) + n_low * costs.load_s.get("posix", 0.0)
                r = store.wait(store.load(ids[:k], 0, buf[:k]))
                k = int(np.argmin(r.ok)) if not r.all_ok else k  # a failed load ends the prefix
            load_s += load
            critical_load += load
            waited += start - arrival
            service = load + int(tcount[k:].sum()) * costs.prefill_s_per_token
            heapq.heappush(engines_free, start + service)
            hits += k
            tok_hits += int(tcount[:k].sum())
            blocks += len(ids)
            toks += int(tcount.sum())
            rest = ids[k:]
            if len(rest):
                r = store.wait(store.dump(rest, 0, buf[:len(rest)]))
                store.commit(rest, r.ok)
            if lower is not None:
                store.flush()
        st = store.stats()
    finally:
        store.close()
        if tmp is not None:
            tmp.cleanup()
    read = {n: st.get(n, {}).get("load_blocks", 0) * block_bytes for n in names}
    written = {n: st.get(n, {}).get("dump_blocks", 0) * block_bytes for n in names}
    evictions = {n: st.get(n, {}).get("evictions", 0) for n in names}
    prefill_total = toks * costs.prefill_s_per_token
    return ReplayResult(policy, cap, cap / distinct, tiers, hits / blocks, tok_hits / toks,
                        per_tier, read, written, evictions,
                        tok_hits * costs.prefill_s_per_token - load_s, prefill_total, load_s,
                        admission, prefetch, prefetched, waited / len(trace.requests))


def measure_costs(block_bytes: int = 2 << 20, n_blocks: int = 32, rounds: int = 5,
                  prefill_s_per_token: float = 1e-4, root: Optional[str] = None) -> Costs:
    """Per-block load time of the memory and posix tiers on this machine, measured with real
    blocks of ``block_bytes`` (median of ``rounds`` batch loads of ``n_blocks``; the posix
    blocks are read back through the page cache, as a recently written block is)."""
    import time

    from ucm.store.base import BlockGeometry
    from ucm.store.memory import MemoryStore
    from ucm.store.posix import PosixStore

    geo = BlockGeometry(block_bytes, block_bytes)
    ids = block_ids(range(1, n_blocks + 1))
    src = np.random.default_rng(0).integers(0, 256, (n_blocks, block_bytes), dtype=np.uint8)
    dst = np.empty_like(src)
    out = {}
    with tempfile.TemporaryDirectory(prefix="ucm-costs-", dir=root) as tmp:
        for name, store in (("memory", MemoryStore(geo, n_blocks, pin=False)),
                            ("posix", PosixStore(geo, roots=[tmp], capacity_bytes=4 * n_blocks * (block_bytes + (1 << 20))))):
            try:
                store.commit(ids, store.wait(store.dump(ids, 0, src)).ok)
                times = []
                for _ in range(rounds):
                    t0 = time.perf_counter()
                    r = store.wait(store.load(ids, 0, dst))
                    times.append(time.perf_counter() - t0)
                    if not r.all_ok or not np.array_equal(dst, src):
                        raise RuntimeError(f"{name} tier: measured loads came back wrong")
                out[name] = float(np.median(times)) / n_blocks
            finally:
                store.close()
    return Costs(out, prefill_s_per_token)


def belady(trace: Trace, capacity) -> tuple:
    """Offline optimum (Belady's MIN) over the trace's block accesses at ``capacity``:
    ``(block hit rate, token hit rate)`` of prefix hits."""

    if not trace.requests:
        raise ValueError("belady: the trace has no request")
    cap = resolve_capacity(capacity, trace.distinct_blocks)
    seq = [h for r in trace.requests for h in r.hash_ids]
    nxt = np.empty(len(seq), dtype=np.int64)
    last: dict = {}
    never = len(seq) + 1
    for i in range(len(seq) - 1, -1, -1):
        nxt[i] = last.get(seq[i], never)
        last[seq[i]] = i
    cached: dict = {}
    heap: list = []
    pos = hits = tok_hits = toks = 0
    for req in trace.requests:
        tcount = _token_counts(req, trace.block_tokens)
        k = 0
        for h in req.hash_ids:
            if h not in cached:
                break
            k += 1
        hits += k
        tok_hits += int(tcount[:k].sum())
        toks += int(tcount.sum())
        for h in req.hash_ids:
            n = int(nxt[pos])
            pos += 1
            cached[h] = n
            heapq.heappush(heap, (-n, h))
            while len(cached) > cap:
                neg, victim = heapq.heappop(heap)
                if cached.get(victim) == -neg:
                    del cached[victim]
    return hits / len(seq), tok_hits / toks


def sweep(trace: Trace, capacities: Iterable, policies: Sequence[str] = POLICIES,
          with_optimum: bool = True, progress: bool = False, prefetch: bool = False, **kw) -> list:
    """Rows (dicts) of :func:`replay` for every policy and capacity (with ``prefetch``: each
    without and with it), plus ``optimum`` rows."""
    from ucm.progress import bar

    capacities = list(capacities)
    rows = []
    with bar(len(capacities) * (len(policies) + with_optimum), "replay", "run",
             quiet=not progress) as pb:
        for cap in capacities:
            for pol in policies:
                for pf in ((False, True) if prefetch else (False,)):
                    rows.append(replay(trace, cap, pol, prefetch=pf, **kw).row())
                pb.update(1)
            if with_optimum:
                blocks = resolve_capacity(cap, trace.distinct_blocks)
                hr, thr = belady(trace, cap)
                rows.append({"policy": "optimum", "capacity_blocks": blocks,
                             "capacity_fraction": blocks / trace.distinct_blocks,
                             "hit_rate": hr, "token_hit_rate": thr})
                pb.update(1)
    return rows


def plot(rows: list, path: str, title: str = "prefix hit rate against capacity") -> None:
    """Hit rate against capacity (fraction of distinct blocks, log scale), a line per policy,
    with LRU and the offline optimum as reference curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = {"optimum": dict(color="black", linestyle="--"), "lru": dict(color="gray")}
    for pol in dict.fromkeys(r["policy"] for r in rows):
        pts = sorted((r["capacity_fraction"], r["hit_rate"]) for r in rows if r["policy"] == pol)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=pol,
                **styles.get(pol, {}))
    ax.set_xscale("log")
    ax.set_xlabel("capacity (fraction of the trace's distinct blocks)")
    ax.set_ylabel("prefix hit rate (blocks)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def synthetic_trace(kind: str = "agentic", n_requests: int = 6000, seed: int = 0,
                    block_tokens: int = 512) -> Trace:
    """A second workload, unlike the chat trace: ``agentic`` has a few dozen applications, each
    with a long system prompt (4-24 blocks, Zipf-popular), whose agent sessions run several
    steps a few seconds apart, each step extending the session's context with tool output;
    a quarter of the requests are one-off prompts (a fresh document after a short shared
    preamble), which a cache should not let push the system prompts out."""
    if kind != "agentic":
        raise ValueError(f"synthetic trace {kind!r}: expected 'agentic'")
    for name, v in (("n_requests", n_requests), ("block_tokens", block_tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"synthetic trace: {name} must be an int >= 1, got {v!r}")
    rng = np.random.default_rng(seed)
    next_id = iter(range(1, 1 << 62))
    apps = [[next(next_id) for _ in range(int(rng.integers(4, 25)))] for _ in range(40)]
    popularity = 1.0 / np.arange(1, len(apps) + 1) ** 1.1
    popularity /= popularity.sum()
    preamble = [next(next_id)]
    reqs, sessions, t = [], [], 0.0
    while len(reqs) < n_requests:
        t += float(rng.exponential(150.0))  # ms between arrivals
        live = [s for s in sessions if s["due"] <= t and s["steps"] > 0]
        if live and rng.random() < 0.6:
            s = live[int(rng.integers(len(live)))]
            s["ctx"] = s["ctx"] + [next(next_id) for _ in range(int(rng.integers(1, 4)))]
            s["steps"] -= 1
            s["due"] = t + float(rng.exponential(4000.0))
            ids = s["ctx"]
        elif rng.random() < 0.33:
            ids = preamble + [next(next_id) for _ in range(int(rng.integers(4, 40)))]
        else:
            app = apps[int(rng.choice(len(apps), p=popularity))]
            ids = app + [next(next_id) for _ in range(int(rng.integers(1, 4)))]
            sessions.append({"ctx": ids, "steps": int(rng.integers(0, 8)),
                             "due": t + float(rng.exponential(4000.0))})
            sessions = [s for s in sessions if s["steps"] > 0][-500:]
        n_in = block_tokens * (len(ids) - 1) + int(rng.integers(1, block_tokens + 1))
        reqs.append(Request(t, n_in, int(rng.integers(16, 512)), list(ids)))
    return Trace(reqs, [], block_tokens)


def write_trace(trace: Trace, path: str) -> None:
    """Write ``trace`` in the JSON-lines format :func:`load_trace` reads."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        for r in trace.requests:
            f.write(json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                                "output_length": r.output_length, "hash_ids": r.hash_ids}) + "\n")
