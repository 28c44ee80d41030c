"""ucm's metrics: one catalogue of series (:data:`SERIES`), a :class:`Recorder` the components
write to, and the sinks that publish what it holds.

Every series is defined once here, with its Prometheus name, type, help text and labels; the
same names reach an operator whichever way ucm runs:

* inside vLLM, the connector drains its recorders into vLLM's KV-connector stats each step
  (``get_kv_connector_stats``), and vLLM's ``/metrics`` shows them through
  :class:`PrometheusSink` built by the connector's ``build_prom_metrics``;
* in any other process that uses a store, :func:`serve` exposes a
  :class:`PrometheusSink` on its own HTTP port, fed by :class:`StoreCollector`;
* the connector's JSON-lines stats file (``connector.stats_file``) receives the same series'
  totals each step (:class:`JsonLinesSink`).

A *payload* (what :meth:`Recorder.drain` returns and the sinks take) is a JSON-safe dict
``{series name: {label key: value}}``: counters hold the increase since the last drain, gauges
the last value set, histograms the list of observed values (each is replayed into the
Prometheus histogram, so buckets are exact). The label key is ``""`` without labels, else
``"name=value,..."`` in the series' label order. Payloads cross vLLM's process boundaries
(pickle and msgpack), hence no tuples.
"""
from __future__ import annotations

import dataclasses
import json
import math
import numbers
import re
import threading
import time
from typing import Iterable, Optional

#: Upper bounds (seconds) of the latency histograms' buckets: a loopback memory hit is tens of
#: microseconds per batch, a remote tier or a cold disk up to seconds.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                   0.5, 1.0, 2.5, 5.0, 10.0)

#: At most this many observations of one histogram series are kept between drains (the rest
#: are counted in ``ucm_metrics_dropped_observations_total``).
MAX_OBSERVATIONS = 4096


@dataclasses.dataclass(frozen=True)
class Series:
    name: str
    kind: str            # "counter" | "gauge" | "histogram"
    help: str
    labels: tuple = ()
    buckets: tuple = ()

    def key(self, labels: dict) -> str:
        if set(labels) != set(self.labels):
            raise ValueError(f"metric {self.name}: labels {sorted(labels)}, expected "
                             f"{list(self.labels)}")
        return ",".join(f"{k}={_escape_label(self.name, k, labels[k])}" for k in self.labels)

    def label_values(self, key: str) -> list:
        if not self.labels:
            return []
        values = dict(part.split("=", 1) for part in key.split(","))
        return [_unescape_label(values[k]) for k in self.labels]


# a label key is "name=value,...": a value's own "%", "," and "=" are written %25, %2C, %3D
_ESCAPES = {"%": "%25", ",": "%2C", "=": "%3D"}
_UNESCAPES = {v: k for k, v in _ESCAPES.items()}


def _escape_label(metric: str, label: str, value) -> str:
    value = str(value)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"metric {metric}: label {label}={value!r} is not valid UTF-8 text "
                         f"(Prometheus' text format could not be written)") from None
    return re.sub(r"[%,=]", lambda m: _ESCAPES[m.group(0)], value)


def _unescape_label(value: str) -> str:
    return re.sub(r"%(?:25|2C|3D)", lambda m: _UNESCAPES[m.group(0)], value)


def _number(name: str, value, counter: bool = False):
    """``value`` checked for series ``name``: a finite real number (a counter's: not negative);
    ValueError naming the series otherwise."""
    if isinstance(value, (str, bytes)) or not isinstance(value, numbers.Real):
        try:
            if isinstance(value, (str, bytes)):
                raise TypeError
            value = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"metric {name}: value {value!r} is not a number") from None
    if not math.isfinite(value):
        raise ValueError(f"metric {name}: value {value!r} is not a finite number")
    if counter and value < 0:
        raise ValueError(f"metric {name}: a counter only increases; value {value!r} < 0")
    return value


_TIER = ("tier",)

SERIES = {s.name: s for s in (
    # scheduler: what lookups found
    Series("ucm_lookups_total", "counter", "Requests whose prompt ucm looked up in its store."),
    Series("ucm_lookup_hit_blocks_total", "counter",
           "Full prompt blocks found in the store (loaded instead of computed)."),
    Series("ucm_lookup_miss_blocks_total", "counter",
           "Full prompt blocks looked up and not found (computed by the engine, then saved)."),
    Series("ucm_lookup_hit_tokens_total", "counter",
           "Prompt tokens served from the store instead of computed."),
    Series("ucm_lookup_miss_tokens_total", "counter",
           "Prompt tokens the engine computed after a lookup (beyond its own prefix cache)."),
    # worker: transfers between the engine's KV cache and the store
    Series("ucm_load_blocks_total", "counter",
           "Full blocks loaded into the engine's KV cache (prompt tails: load_tail_blocks)."),
    Series("ucm_load_bytes_total", "counter", "Bytes loaded into the engine's KV cache."),
    Series("ucm_load_failed_blocks_total", "counter",
           "Blocks whose load failed; the engine recomputed them."),
    Series("ucm_save_blocks_total", "counter",
           "Full blocks saved from the engine's KV cache (prompt tails: save_tail_blocks)."),
    Series("ucm_save_bytes_total", "counter", "Bytes saved from the engine's KV cache."),
    Series("ucm_save_failed_blocks_total", "counter",
           "Blocks whose save failed (not stored; a later request computes them)."),
    Series("ucm_load_seconds", "histogram",
           "Time of one load batch: from the store's read to the blocks in the KV cache.",
           buckets=LATENCY_BUCKETS),
    Series("ucm_save_seconds", "histogram",
           "Time of one save batch: from the gather out of the KV cache to the commit.",
           buckets=LATENCY_BUCKETS),
    # worker: where the transfer time goes (for tuning; cumulative seconds)
    Series("ucm_load_tail_blocks_total", "counter",
           "Partial last blocks of prompts loaded (not counted in ucm_load_blocks_total)."),
    Series("ucm_save_tail_blocks_total", "counter",
           "Partial last blocks of prompts saved (not counted in ucm_save_blocks_total)."),
    Series("ucm_load_store_seconds_total", "counter",
           "Seconds spent reading loads out of the store (part of ucm_load_seconds)."),
    Series("ucm_load_scatter_seconds_total", "counter",
           "Seconds spent copying loaded blocks into the KV cache (part of ucm_load_seconds)."),
    Series("ucm_load_scatter_wait_seconds_total", "counter",
           "Seconds a layer's attention waited for its loaded blocks to be copied in."),
    Series("ucm_save_gather_seconds_total", "counter",
           "Seconds spent copying saved blocks out of the KV cache (part of ucm_save_seconds)."),
    Series("ucm_save_waits_total", "counter",
           "Steps that waited for an earlier save before reusing its KV cache blocks."),
    Series("ucm_save_wait_seconds_total", "counter", "Seconds those steps waited."),
    Series("ucm_saves_during_forward_total", "counter",
           "Saves started layer by layer during the forward instead of after it."),
    Series("ucm_steps_total", "counter", "Engine steps the worker took part in."),
    Series("ucm_forward_seconds_total", "counter",
           "Seconds from the start of a step's loads to its saves (the forward with its loads)."),
    Series("ucm_prefetch_hint_blocks_total", "counter",
           "Blocks of queued requests the scheduler asked the workers to prefetch (the store "
           "moves those that only slower tiers hold into memory)."),
    Series("ucm_blend_requests_total", "counter",
           "Requests whose chunk region was blended from stored chunk KV (docs/blend.md)."),
    Series("ucm_blend_failed_requests_total", "counter",
           "Blend requests that could not be blended (the engine computed the region)."),
    Series("ucm_blend_tokens_total", "counter", "Tokens of blended regions."),
    Series("ucm_blend_stored_tokens_total", "counter",
           "Tokens of blended regions whose KV came from stored chunks."),
    Series("ucm_blend_recomputed_tokens_total", "counter",
           "Tokens of blended regions recomputed (selected or not stored)."),
    Series("ucm_blend_load_blocks_total", "counter", "Chunk blocks loaded for Blend."),
    Series("ucm_blend_load_failed_blocks_total", "counter",
           "Chunk blocks whose load failed (their tokens were recomputed)."),
    Series("ucm_blend_seconds", "histogram",
           "Time of one request's Blend: chunk loads, rotation and the selective recompute.",
           buckets=LATENCY_BUCKETS),
    Series("ucm_blend_chunk_saves_total", "counter",
           "Chunks stored for later Blend requests (blend.chunk_source: taken from the "
           "prompt's rows, or computed on their own)."),
    Series("ucm_blend_chunk_save_blocks_total", "counter", "Blocks of chunks stored for Blend."),
    Series("ucm_blend_chunk_save_failed_total", "counter", "Chunks that could not be stored."),
    Series("ucm_blend_chunk_save_seconds_total", "counter",
           "Seconds spent preparing (gathering and rotating, or computing) and storing chunks."),
    Series("ucm_resumed_requests_total", "counter",
           "Preempted requests resumed with their blocks loaded again."),
    Series("ucm_resumed_load_blocks_total", "counter", "Blocks loaded for resumed requests."),
    Series("ucm_borrowed_load_blocks_total", "counter",
           "Loaded blocks copied from a save still in flight instead of read from the store."),
    Series("ucm_overlapped_load_blocks_total", "counter",
           "Loaded blocks copied into the KV cache layer by layer during the forward."),
    Series("ucm_background_cpus", "gauge",
           "CPUs the worker's background transfers are pinned to (0: not pinned)."),
    # store: per tier
    Series("ucm_tier_hit_blocks_total", "counter", "Blocks a tier's lookups found.", _TIER),
    Series("ucm_tier_load_bytes_total", "counter", "Bytes read from a tier.", _TIER),
    Series("ucm_tier_save_bytes_total", "counter", "Bytes written to a tier.", _TIER),
    Series("ucm_tier_failed_operations_total", "counter",
           "Failed reads and writes of a tier (each became a miss or a failed save).", _TIER),
    Series("ucm_tier_evicted_blocks_total", "counter",
           "Blocks a tier evicted to make room.", _TIER),
    Series("ucm_tier_used_bytes", "gauge", "Bytes of committed blocks a tier holds "
           "(tiers that keep no count, such as shared file systems, do not report it).", _TIER),
    Series("ucm_tier_capacity_bytes", "gauge", "Bytes a tier may hold.", _TIER),
    # sparse attention
    Series("ucm_sparse_steps_total", "counter",
           "Decode steps in which sparse attention chose the blocks to attend."),
    Series("ucm_sparse_attended_blocks_total", "counter",
           "KV blocks sparse attention attended (over layers, heads' groups and sequences)."),
    Series("ucm_sparse_candidate_blocks_total", "counter",
           "KV blocks sparse attention could have attended (the dense count)."),
    Series("ucm_sparse_kept_block_ratio", "gauge",
           "Attended / candidate blocks over the last interval."),
    Series("ucm_metrics_dropped_observations_total", "counter",
           "Histogram observations dropped between two drains (more than MAX_OBSERVATIONS)."),
)}


def series(name: str) -> Series:
    try:
        return SERIES[name]
    except KeyError:
        raise ValueError(f"unknown metric {name!r} (see ucm.metrics.SERIES)") from None


class Recorder:
    """Thread-safe accumulation of one component's series until the next :meth:`drain`, and
    of its totals since it was made (:meth:`totals`: what the stats file and ``stats()`` show)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._data: dict = {}
        self._totals: dict = {}

    def inc(self, name: str, value: float = 1, **labels) -> None:
        s = series(name)
        if s.kind != "counter":
            raise ValueError(f"metric {name} is a {s.kind}, not a counter")
        value = _number(name, value, counter=True)
        if value:
            key = s.key(labels)
            with self._lock:
                for data in (self._data, self._totals):
                    d = data.setdefault(name, {})
                    d[key] = d.get(key, 0) + value

    def set(self, name: str, value: float, **labels) -> None:
        s = series(name)
        if s.kind != "gauge":
            raise ValueError(f"metric {name} is a {s.kind}, not a gauge")
        value = _number(name, value)
        key = s.key(labels)
        with self._lock:
            self._data.setdefault(name, {})[key] = value
            self._totals.setdefault(name, {})[key] = value

    def observe(self, name: str, value: float, **labels) -> None:
        s = series(name)
        if s.kind != "histogram":
            raise ValueError(f"metric {name} is a {s.kind}, not a histogram")
        value = float(_number(name, value))
        key = s.key(labels)
        with self._lock:
            count_sum = self._totals.setdefault(name, {}).setdefault(key, [0, 0.0])
            count_sum[0] += 1
            count_sum[1] += float(value)
            obs = self._data.setdefault(name, {}).setdefault(key, [])
            if len(obs) < MAX_OBSERVATIONS:
                obs.append(float(value))
                return
        self.inc("ucm_metrics_dropped_observations_total")

    def drain(self) -> dict:
        """The payload since the last drain (see the module's docstring); empties the recorder."""
        with self._lock:
            data, self._data = self._data, {}
        return data

    def add(self, payload: dict) -> None:
        """Record another component's drained payload as if recorded here: all of it, or (a
        value that is not a number, a negative counter step: ValueError) none of it."""
        steps = []
        for name, values in payload.items():
            kind = series(name).kind
            for key, v in values.items():
                labels = dict(zip(SERIES[name].labels, SERIES[name].label_values(key)))
                if kind == "histogram":
                    for x in v:
                        _number(name, x)
                        steps.append((self.observe, name, x, labels))
                else:
                    _number(name, v, counter=kind == "counter")
                    steps.append((self.inc if kind == "counter" else self.set, name, v, labels))
        for record, name, v, labels in steps:
            record(name, v, **labels)

    def totals(self) -> dict:
        """Everything recorded since this recorder was made, flat (``{"name{labels}": number}``,
        histograms as ``name_count`` and ``name_sum`` as Prometheus exposes them); series never
        recorded read 0 for counters. Not affected by :meth:`drain`."""
        with self._lock:
            # histograms' [count, sum] are copied here: observe() updates them in place
            snap = {name: {k: list(v) if isinstance(v, list) else v for k, v in values.items()}
                    for name, values in self._totals.items()}
        out = {}
        for s in SERIES.values():   # what never happened reads 0
            if not s.labels and s.name not in snap:
                if s.kind == "counter":
                    out[s.name] = 0
                elif s.kind == "histogram":
                    out[s.name + "_count"], out[s.name + "_sum"] = 0, 0.0
        for name, values in snap.items():
            for key, v in values.items():
                _put_flat(out, name, key, *((v[0], v[1]) if isinstance(v, list) else (v,)))
        return out

    def get(self, name: str, **labels) -> float:
        """One series' total (a histogram's sum), 0 when never recorded."""
        s = series(name)
        with self._lock:
            v = self._totals.get(name, {}).get(s.key(labels), 0)
        return v[1] if isinstance(v, list) else v


def _label(name: str, key: str) -> str:
    return f"{name}{{{key}}}" if key else name


def _put_flat(out: dict, name: str, key: str, value, total=None) -> None:
    """One series' value under its flat name; a histogram (``total`` given: ``value`` is its
    count) as ``name_count`` and ``name_sum``."""
    if total is None:
        out[_label(name, key)] = value
    else:
        out[_label(name + "_count", key)] = value
        out[_label(name + "_sum", key)] = total


def merge(into: dict, other: dict) -> dict:
    """Add payload ``other`` to ``into`` (counters add, gauges take ``other``'s value,
    histograms concatenate, at most MAX_OBSERVATIONS kept: the rest are counted in
    ``ucm_metrics_dropped_observations_total``); returns ``into``."""
    dropped = 0
    for name, values in other.items():
        kind = series(name).kind
        mine = into.setdefault(name, {})
        for key, v in values.items():
            if kind == "counter":
                mine[key] = mine.get(key, 0) + v
            elif kind == "gauge":
                mine[key] = v
            else:
                obs = mine.get(key, []) + list(v)
                dropped += max(0, len(obs) - MAX_OBSERVATIONS)
                mine[key] = obs[:MAX_OBSERVATIONS]
    if dropped:
        d = into.setdefault("ucm_metrics_dropped_observations_total", {})
        d[""] = d.get("", 0) + dropped
    return into


def flat(payload: dict) -> dict:
    """A payload as ``{"name{labels}": number}`` (histograms as ``name_count`` and ``name_sum``,
    as :meth:`Recorder.totals` writes them): for logs."""
    out = {}
    for name, values in payload.items():
        for key, v in values.items():
            _put_flat(out, name, key, *((len(v), sum(v)) if isinstance(v, list) else (v,)))
    return out


class StoreCollector:
    """Turns a store's cumulative :meth:`stats` into payload increments per tier (call
    :meth:`collect` now and then; the first call reports everything since the store opened)."""

    _COUNTERS = (("ucm_tier_hit_blocks_total", ("hits",)),
                 ("ucm_tier_load_bytes_total", ("load_bytes",)),
                 ("ucm_tier_save_bytes_total", ("dump_bytes",)),
                 ("ucm_tier_failed_operations_total",
                  ("load_failures", "dump_failures", "io_errors", "unavailable")),
                 ("ucm_tier_evicted_blocks_total", ("evictions",)))

    def __init__(self, store):
        self.store = store
        self._last: dict = {}

    def collect(self, recorder: Recorder) -> None:
        stats = self.store.stats()
        tiers = {k: v for k, v in stats.items() if isinstance(v, dict) and k != "pipeline"}
        if not tiers and isinstance(stats, dict) and "hits" in stats:
            tiers = {getattr(self.store, "name", "store"): stats}
        for tier, st in tiers.items():
            if not isinstance(st, dict):
                continue
            last = self._last.setdefault(tier, {})
            for name, fields in self._COUNTERS:
                now = sum(int(st.get(f, 0) or 0) for f in fields)
                delta = now - last.get(name, 0)
                last[name] = now
                if delta > 0:
                    recorder.inc(name, delta, tier=tier)
            for name, field in (("ucm_tier_used_bytes", "used_bytes"),
                                ("ucm_tier_capacity_bytes", "capacity_bytes")):
                if st.get(field) is not None:
                    recorder.set(name, st[field], tier=tier)


# ---------------------------------------------------------------------------------------------
# sinks

class PrometheusSink:
    """Applies payloads to ``prometheus_client`` metrics, one per series, named as in
    :data:`SERIES`. ``registry``: where they are registered (a new one by default; ignored when
    ``metric_types`` is given); ``labelnames`` / ``labelvalues``: labels put before each series'
    own (vLLM's ``model_name`` and ``engine``, say); ``metric_types``: the classes to build them
    with, as vLLM's ``build_prom_metrics`` passes (``{Counter: cls, Gauge: cls, Histogram:
    cls}``)."""

    def __init__(self, registry=None, labelnames: Iterable[str] = (), metric_types=None):
        import prometheus_client as pc

        self.labelnames = list(labelnames)
        if metric_types is None:
            self.registry = registry if registry is not None else pc.CollectorRegistry()
            types = {"counter": pc.Counter, "gauge": pc.Gauge, "histogram": pc.Histogram}
            extra = {"registry": self.registry}
        else:
            self.registry = None
            types = {"counter": metric_types[pc.Counter], "gauge": metric_types[pc.Gauge],
                     "histogram": metric_types[pc.Histogram]}
            extra = {}
        self.metrics = {}
        for s in SERIES.values():
            kw = dict(extra)
            if s.kind == "histogram":
                kw["buckets"] = list(s.buckets)
            if s.kind == "gauge" and metric_types is not None:
                kw["multiprocess_mode"] = "mostrecent"
            # prometheus_client appends _total to counters itself
            name = s.name[:-len("_total")] if s.kind == "counter" else s.name
            self.metrics[s.name] = types[s.kind](name=name, documentation=s.help,
                                                 labelnames=self.labelnames + list(s.labels), **kw)

    def apply(self, payload: dict, labelvalues: Iterable = ()) -> None:
        pre = [str(v) for v in labelvalues]
        for name, values in payload.items():
            s = SERIES.get(name)
            if s is None:        # a payload of a newer ucm: skip what this one cannot name
                continue
            metric = self.metrics[name]
            for key, v in values.items():
                child = metric.labels(*pre, *s.label_values(key)) if pre or s.labels else metric
                if s.kind == "counter":
                    child.inc(v)
                elif s.kind == "gauge":
                    child.set(v)
                else:
                    for x in v:
                        child.observe(x)


class JsonLinesSink:
    """Appends ``{"t": time, **extra, **values}`` lines to a file (kept open; a write that fails
    is dropped: statistics never stop the engine). The connector's ``connector.stats_file``
    writes its recorder's :meth:`Recorder.totals` here each step."""

    def __init__(self, path: str):
        self.path = path
        self._fh = None
        self._lock = threading.Lock()

    def write(self, values: dict, **extra) -> None:
        line = json.dumps({"t": time.time(), **extra, **values}, default=str)
        with self._lock:
            try:
                if self._fh is None:
                    self._fh = open(self.path, "a", buffering=1)
                self._fh.write(line + "\n")
            except (OSError, ValueError):
                pass

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None


class Exporter:
    """What :func:`serve` returns: call :meth:`update` (or let its thread do it every
    ``interval`` seconds) to publish the recorders' and stores' news; :meth:`close` stops it."""

    def __init__(self, sink: PrometheusSink, server, thread):
        self.sink = sink
        self.recorders: list = []
        self.collectors: list = []
        self._server, self._thread = server, thread
        self._stop = threading.Event()
        self._lock = threading.Lock()

    def watch_store(self, store) -> None:
        self.collectors.append(StoreCollector(store))

    def watch(self, recorder: Recorder) -> None:
        self.recorders.append(recorder)

    def update(self) -> None:
        with self._lock:
            payload: dict = {}
            for c in self.collectors:
                r = Recorder()
                c.collect(r)
                merge(payload, r.drain())
            for r in self.recorders:
                merge(payload, r.drain())
            self.sink.apply(payload)

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.update()
            except Exception:   # a store closed under us: the next round retries
                pass

    def close(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


def serve(port: int, store=None, *, addr: str = "127.0.0.1", interval: float = 5.0) -> Exporter:
    """Expose ucm's series over HTTP (``/metrics``, Prometheus text format) for a process that
    uses a store directly: ``exporter = ucm.metrics.serve(9400, store)``. A port in use raises
    ``OSError`` naming it."""
    import prometheus_client as pc

    sink = PrometheusSink()
    try:
        server, thread = pc.start_http_server(port, addr=addr, registry=sink.registry)
    except OSError as exc:
        raise OSError(exc.errno, f"ucm.metrics.serve: cannot listen on {addr}:{port} "
                                 f"({exc.strerror or exc}); is another exporter using the "
                                 f"port?") from None
    ex = Exporter(sink, server, thread)
    if store is not None:
        ex.watch_store(store)
    t = threading.Thread(target=ex._run, args=(interval,), name="ucm-metrics", daemon=True)
    t.start()
    return ex


def markdown() -> str:
    """The series as a Markdown table (docs/observability.md holds it; a test keeps it current)."""
    rows = ["| series | type | labels | meaning |", "|---|---|---|---|"]
    for s in SERIES.values():
        labels = ", ".join(s.labels) or "—"
        rows.append(f"| `{s.name}` | {s.kind} | {labels} | {s.help} |")
    return "\n".join(rows) + "\n"
