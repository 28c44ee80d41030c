"""One option table, three sources, loud failures.

Every tunable of ucm is one row of :data:`OPTIONS` (name, type, default, environment variable,
doc, constraint). A :class:`Config` is built from, in increasing precedence:

1. the defaults of the table,
2. a scenario preset (``preset: realtime_chat`` ...; see :data:`PRESETS`),
3. a YAML file (``Config.load(path)`` or the file named by ``UCM_CONFIG_FILE``),
4. ``UCM_*`` environment variables (``store.posix.roots`` → ``UCM_STORE_POSIX_ROOTS``),
5. an explicit dict (code, or vLLM's ``kv_connector_extra_config``).

Nested mappings are flattened with dots (``{"store": {"posix": {"fsync": True}}}`` is
``store.posix.fsync``). Unknown keys, wrong types and out-of-range values raise
:class:`ConfigError` (a ``ValueError``) naming the key, the source, the accepted values and, for
a typo, the closest valid key. An environment variable ``UCM_*`` that is neither an option nor
one of :data:`RESERVED_ENV` is an error when it is a near miss of one (``UCM_SPARSE_RATO``) and
only a warning otherwise (``UCM_HOME``, set for something else).
"""
from __future__ import annotations

import difflib
import logging
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from ucm.config_values import PARSERS as _PARSERS, BadValue as _Bad
from ucm.files import open_regular

log = logging.getLogger("ucm.config")


class ConfigError(ValueError):
    """A configuration value or name that ucm refuses (it names the key and what is accepted)."""


# Environment variables with the UCM_ prefix that are not config options.
RESERVED_ENV = {
    "UCM_CONFIG_FILE": "path of a YAML config file read by Config.load()",
    "UCM_BACKEND": "backend override (also the `backend` option)",
    "UCM_REQUIRE_NATIVE": "1: refuse to import without the native engine",
    "UCM_REQUIRE_SERVICES": "1: tests needing a service fail instead of skipping",
    "UCM_DISABLE_PATCHES": "1: ucm.integration.patch() patches nothing",
    "UCM_PLATFORM": "force platform detection to cuda, npu or cpu",
    "UCM_LOG_LEVEL": "logging level of the `ucm` logger (also adds a stderr handler)",
    "UCM_MODEL_CACHE": "folder of the converted SmolLM2 model (ucm.models)",
    "UCM_NATIVE_SIMD": "force the native checksum path: scalar or avx2 (tests)",
    "UCM_VLLM_PYTHON": "interpreter with vLLM for benchmarks/bench_foundation.py",
    "UCM_BACKGROUND_CPUS": "CPUs of ucm's background threads (ucm/threads.py): e.g. 3,5-7, or none",
    "UCM_JIT_CACHE": "where the compiled Numba kernels are cached (default ~/.cache/ucm/jit), or off",
    "UCM_PROGRESS": "0: no progress bars on stderr",
    "UCM_TEST_TRITON_INTERPRETER": "1: this test process runs the Triton interpreter cases (make test-gpu)",
    "UCM_MODEL_OPS": "tests: operations per store kind of the model-based store tests",
    "UCM_MODEL_SEED": "tests: the first seed of the model-based store tests",
}

# ---------------------------------------------------------------------------------------------
# the table

@dataclass(frozen=True)
class Option:
    name: str
    type: str
    default: Any
    doc: str
    choices: Optional[tuple] = None
    min: Optional[float] = None
    max: Optional[float] = None
    min_exclusive: bool = False
    check: Optional[Callable[[Any], Optional[str]]] = None  # returns an error text or None

    @property
    def env(self) -> str:
        return "UCM_" + self.name.upper().replace(".", "_")

    def accepted(self) -> str:
        if self.choices is not None:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        base = {"bool": "a boolean", "int": "an integer", "float": "a number", "str": "a string",
                "size": "a size in bytes", "list[str]": "a list of strings",
                "list[int]": "a list of integers"}[self.type]
        if self.min is not None or self.max is not None:
            lo = "-inf" if self.min is None else f"{self.min:g}"
            hi = "inf" if self.max is None else f"{self.max:g}"
            base += f" in {'(' if self.min_exclusive else '['}{lo}, {hi}]"
        return base

    def parse(self, raw, source: str, text: bool = False):
        def fail(what):
            return ConfigError(f"config key {self.name!r} ({source}): expected {what}, got {raw!r}")

        try:
            value = _PARSERS[self.type](raw, text)
        except _Bad as exc:
            raise fail(str(exc)) from None
        if self.choices is not None and value not in self.choices:
            raise fail(self.accepted())
        if self.min is not None and (value < self.min or (self.min_exclusive and value == self.min)):
            raise fail(self.accepted())
        if self.max is not None and value > self.max:
            raise fail(self.accepted())
        if self.check is not None:
            problem = self.check(value)
            if problem:
                raise fail(problem)
        return value


def _check_context(value: list) -> Optional[str]:
    if any(t < 0 for t in value):
        return "token ids must be >= 0"
    if len(value) > 4096:
        return f"at most 4096 tokens (got {len(value)}): each stored chunk is computed after them"
    return None


def _check_pipeline(value: str) -> Optional[str]:
    parts = value.split("|")
    ok = all(re.fullmatch(r"[A-Za-z_][\w]*|[A-Za-z_][\w.]*:[A-Za-z_]\w*", p.strip()) for p in parts)
    if not value.strip() or not ok:
        return "tier names joined by '|' (e.g. 'memory|posix', or 'package.module:Class')"
    names = [p.strip() for p in parts]
    if len(set(names)) != len(names):
        return "each tier once (a tier listed twice would hold every block twice)"
    return None


def _check_servers(value: list) -> Optional[str]:
    if not value or any(not v.strip() for v in value):
        return "at least one non-empty server address"
    if len(set(value)) != len(value):
        return "each server once"
    return None


def _check_mooncake_segment(value: int) -> Optional[str]:
    # Mooncake refuses a smaller segment at client setup ("Total size must be at least 16777216")
    return None if value == 0 or value >= 16 * 1024**2 else \
        "0 (lend no memory) or at least 16 MiB (Mooncake's smallest segment)"


def _check_hostname(value: str) -> Optional[str]:
    # Mooncake refuses an empty one at client setup (INVALID_PARAMS)
    return None if value.strip() else "a host name or address (e.g. 127.0.0.1)"


def _check_key_prefix(value: str) -> Optional[str]:
    if not re.fullmatch(r"[A-Za-z0-9_.\-/]{1,64}", value) or value.startswith("/"):
        return "1-64 characters of A-Z a-z 0-9 _ . - / (not starting with /)"
    return None


def _check_object_prefix(value: str) -> Optional[str]:
    # servers that map keys to paths refuse or fold '.', '..' and empty segments: two prefixes
    # could name one place
    why = _check_key_prefix(value)
    if why is None and any(seg in ("", ".", "..") for seg in value.split("/")):
        why = "segments between '/' that are not empty, '.' or '..'"
    return why


#: longest timeout an option takes (a year): threading and sockets overflow on values near 1e10 s
MAX_TIMEOUT_S = 365 * 86400.0


def _check_timeout(value: float) -> Optional[str]:
    return None if value <= MAX_TIMEOUT_S else \
        f"at most {MAX_TIMEOUT_S:g} seconds (a year; longer waits overflow the system's timers)"


def check_count(value, key: str, low: int = 1) -> int:
    """``value`` as an int >= ``low`` (tier constructors: no bool, no float, no string)."""
    if isinstance(value, bool) or not isinstance(value, int) and not _is_np_int(value) \
            or value < low:
        raise ValueError(f"{key} must be an int >= {low}, got {value!r}")
    return int(value)


def check_seconds(value, key: str) -> float:
    """``value`` as a number of seconds in (0, MAX_TIMEOUT_S] (tier constructors)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not _is_np_num(value):
        raise ValueError(f"{key} must be a number of seconds, got {value!r}")
    try:
        f = float(value)
    except OverflowError:
        f = math.inf
    if not (0 < f <= MAX_TIMEOUT_S):
        raise ValueError(f"{key} must be in (0, {MAX_TIMEOUT_S:g}] seconds, got {value!r}")
    return f


def check_flag(value, key: str) -> bool:
    """``value`` as a bool: only True or False (the string 'false' is not False)."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return bool(value)
    raise ValueError(f"{key} must be True or False, got {value!r}")


def _is_np_int(value) -> bool:
    return type(value).__module__ == "numpy" and hasattr(value, "dtype") and value.dtype.kind in "iu"


def _is_np_num(value) -> bool:
    return type(value).__module__ == "numpy" and hasattr(value, "dtype") and value.dtype.kind in "iuf"


def _check_hash_bits(value: int) -> Optional[str]:
    return None if value % 32 == 0 else "a multiple of 32 (>= 32)"


def _check_roots(value: list) -> Optional[str]:
    if not value:
        return "at least one directory"
    if any(not r.strip() for r in value):
        return "non-empty directory paths (an empty path would mean the working directory)"
    if len(set(value)) != len(value):
        return "each directory once"
    return None


OPTIONS: tuple[Option, ...] = (
    Option("backend", "str", "auto", "Implementation choice for every op: auto, reference, fast "
           "or one implementation (numba, native, triton).",
           choices=("auto", "reference", "fast", "numba", "native", "triton")),
    Option("tenant_salt", "str", "", "Secret salt mixed into the namespace: tenants with different "
           "salts never share blocks."),
    # sparse attention
    Option("sparse_method", "str", "none", "Sparse attention method for long-context decode.",
           choices=("none", "esa", "gsa", "kvstar", "quest", "mass", "adaptive")),
    Option("sparse_ratio", "float", 0.3, "Fraction of KV blocks attended to during sparse decode.",
           min=0.0, max=1.0, min_exclusive=True),
    Option("min_blocks", "int", 16, "Requests with fewer blocks than this stay dense.", min=1),
    Option("init_window", "int", 1, "Leading blocks always kept by sparse attention.", min=0),
    Option("local_window", "int", 2, "Trailing blocks always kept by sparse attention.", min=0),
    Option("retrieval_stride", "int", 4, "Decode steps between two block re-selections (ESA). "
           "4: SmolLM2's perplexity +0.0/+0.7/+3.3/+4.0% at ratios 0.7/0.5/0.3/0.2 and the "
           "H200 speed-ups 1.25-3.5x; 8 is faster and loses 1.4-16% (benchmarks/RESULTS.md, "
           "'Sparse attention Pareto table').", min=1),
    Option("adaptive_mass", "float", 0.95, "Attention mass the adaptive method keeps.", min=0.0,
           max=1.0, min_exclusive=True),
    Option("sparse_dense_layers", "int", 0, "The first this many layers always attend densely "
           "(every sparse method).", min=0),
    Option("sparse_repr_group", "int", 2, "Tokens per sub-block summary of ESA/KVStar/Quest "
           "(a block scores as its best sub-block; a divisor of the block size); 0 or >= the "
           "block size = one summary per block. 2 halves ESA's KL to dense against 4 at ratio "
           "0.2 for twice the table bytes (int8 means on a GPU: 1/8 of the K/V bytes).", min=0),
    Option("sparse_repr_dtype", "str", "auto", "dtype of the mean-key summary tables (ESA, "
           "KVStar, adaptive): 'int8' keeps int8 rows with one float32 scale per row (half the "
           "bytes of bfloat16 for scoring to read; measured to cost no accuracy); 'bfloat16' or "
           "'float32' as named; 'auto' = int8 for a bfloat16 cache on a GPU, else the cache's "
           "precision (bfloat16 for bfloat16, float32 otherwise). Quest's min/max bounds and "
           "GSA's hash codes keep their own dtypes.",
           choices=("auto", "int8", "bfloat16", "float32")),
    Option("sparse_per_kv_head", "bool", False, "Each KV head selects its own blocks (quest, "
           "mass): one block table per KV head, attended by ucm.sparse.ops."
           "paged_decode_attention (inside vLLM-CPU too, in place of vLLM's kernel for those "
           "rows)."),
    Option("sparse_hash_bits", "int", 128, "Bits of GSA's block hash codes (a multiple of 32).",
           min=32, check=_check_hash_bits),
    Option("kvstar_channels", "int", 32, "Channels of each query head KVStar scores with (those "
           "of the largest absolute query values); at most the model's head_dim.", min=1),
    Option("kvstar_votes", "int", 4, "Recent decode queries that vote for KVStar's blocks.",
           min=1),
    # host buffers and capacity
    Option("buffer_number", "int", 2048, "Slots of the pinned host buffer pool (memory tier), one "
           "KV block each.", min=1),
    Option("cache_capacity", "size", 64 * 1024**3, "Byte budget of the posix tier over its "
           "roots (int or '64GiB'). Left at its default, the budget is also at most half the "
           "free space of the first root when the store opens (logged once).", min=0),
    Option("store.memory.capacity", "size", 0, "Byte size of the memory tier's pinned pool "
           "(int or '8GiB'; rounded down to whole blocks, at least one); 0 = buffer_number "
           "blocks.", min=0),
    Option("store.memory.policy", "str", "lru", "Which committed block the memory tier evicts "
           "when it needs a slot: 'lru', 'arc' (recency and frequency, adaptive) or 'prefix' "
           "(ucm's: chains trimmed from the tip, re-read blocks protected when sampled shadow "
           "caches show it pays; see ucm/store/policy.py and `ucm replay`).",
           choices=("lru", "arc", "prefix")),
    Option("store.admission", "str", "all", "Which blocks the tiers below the first store: "
           "'all', or 'second_hit' (a block dumped a second time, or read from the first tier; "
           "saves slow-tier writes on blocks that are never read again).",
           choices=("all", "second_hit")),
    # compression (ucm/compress.py, the store stage in ucm/store/codec.py)
    Option("compression.enabled", "bool", False, "Encode KV blocks before storing them (every "
           "tier of the pipeline holds the encoded blocks; a store configured with another codec "
           "sees none of them)."),
    Option("compression.method", "str", "quantize", "'quantize' (INT8 or INT4), 'sparse' (the "
           "salient tokens exact, the others INT4) or 'learned' (per-layer low-rank projection).",
           choices=("quantize", "sparse", "learned")),
    Option("compression.bits", "int", 8, "Bits per value of 'quantize' (8: symmetric, values per "
           "token and head; 4: asymmetric, values in groups of compression.group channels).",
           choices=(4, 8)),
    Option("compression.group", "int", 64, "INT4 group size along the head dimension (must "
           "divide it).", choices=(32, 64)),
    Option("compression.key_mode", "str", "auto", "Keys of 'quantize' and 'sparse': 'channel' "
           "(one scale per channel over the block's tokens, as KIVI; INT8 also keeps token 0's "
           "key and value exact), 'token' (like the values) or 'auto' (INT4 and sparse: channel; "
           "INT8: channel in blocks of 128 tokens or more, else token).",
           choices=("auto", "channel", "token")),
    Option("compression.salient", "float", 0.0078125, "'sparse': fraction of each block's tokens "
           "kept exact, at least one (token 0, where a sequence's attention sink sits, then "
           "those whose keys have the largest magnitude; the default keeps token 0 alone in "
           "blocks of up to 128 tokens).", min=0.0, max=0.5,
           min_exclusive=True),
    Option("compression.compression_ratio", "float", 0.25, "'learned': kept rank / head "
           "dimension (stored bytes per value: this ratio of bfloat16).", min=0.0, max=1.0,
           min_exclusive=True),
    Option("compression.projection", "str", "", "'learned': file of the fitted projection "
           "(ucm.compress.fit_projection(...).save(path)); its digest is part of the namespace."),
    Option("compression.key_rounding", "str", "", "Keys quantized per channel (INT8, INT4, "
           "sparse): file of a key rounding fitted on calibration queries "
           "(ucm.compress.fit_key_rounding(...).save(path)); the encoder then picks the keys' "
           "codes for a small attention-logit error instead of rounding each to nearest. Blocks "
           "decode the same way with or without it."),
    # store
    Option("store.pipeline", "str", "memory|posix", "Tiers from fastest to slowest, joined by '|'; "
           "a name from the factory or 'package.module:Class'.", check=_check_pipeline),
    Option("store.write_back", "bool", False, "Write lower tiers in the background (write-back) "
           "instead of before commit (write-through)."),
    Option("store.io_threads", "int", 4, "Threads moving data between tiers.", min=1, max=256),
    Option("store.wait_timeout_s", "float", 30.0, "Longest wait() on one task, seconds.", min=0.0,
           min_exclusive=True, check=_check_timeout),
    Option("store.posix.roots", "list[str]", ["~/.cache/ucm/kv"], "Directories of the posix tier "
           "(local disk, NFS, any shared mount); blocks spread across them.", check=_check_roots),
    Option("store.posix.o_direct", "bool", False, "Bypass the page cache (O_DIRECT)."),
    Option("store.posix.fsync", "bool", False, "fsync each block file before publishing it."),
    Option("store.posix.read_only", "bool", False, "Open the roots only to read (a consumer of a "
           "shared directory it may not write): no dumps, no lock, no quarantine, no access-time "
           "updates; the roots must already be ucm roots."),
    Option("store.posix.group", "str", "", "Group that shares the roots (name or gid): "
           "directories 2770 and files 0640 owned by it; empty = private to this user "
           "(directories 0700, files 0600)."),
    # distributed tiers (ucm/store/remote.py): every one of them
    Option("store.remote.timeout_s", "float", 0.2, "Distributed tiers: longest wait for a "
           "server to connect or to answer a request without values (lookups, commit markers) "
           "before it counts as down and the blocks it holds as misses; a request that moves "
           "values may also take their size at 32 MiB/s.", min=0.0, min_exclusive=True,
           check=_check_timeout),
    Option("store.remote.backoff_s", "float", 1.0, "Distributed tiers: how long a server that "
           "failed is left alone before the tier tries it again (doubling on each further "
           "failure, up to 30 s); no engine restart is needed when it comes back.", min=0.0),
    Option("store.remote.staging", "size", 256 * 1024**2, "Distributed tiers: host memory for "
           "blocks on their way to or from the servers (rounded down to whole values, at least "
           "4); a dump that finds it full fails (the block is not stored).", min=1),
    Option("store.remote.batch_bytes", "size", 16 * 1024**2, "Distributed tiers: bytes of one "
           "batched request to one server (pipelined GET/SET, one batch_get/batch_put).", min=1),
    # redis tier
    Option("store.redis.servers", "list[str]", ["redis://127.0.0.1:6379/0"], "Redis servers "
           "(redis:// or rediss:// for TLS; user and password may be in the URL); blocks spread "
           "over independent servers by rendezvous hashing. With store.redis.cluster: seed "
           "nodes of one Redis Cluster.", check=_check_servers),
    Option("store.redis.servers_file", "str", "", "A file listing the servers, one per line, "
           "re-read when it changes (servers join or leave without an engine restart); "
           "overrides store.redis.servers when set."),
    Option("store.redis.cluster", "bool", False, "The servers are nodes of one Redis Cluster."),
    Option("store.redis.username", "str", "", "ACL user (when not in the URL)."),
    Option("store.redis.password", "str", "", "Password (when not in the URL); better from "
           "UCM_STORE_REDIS_PASSWORD than from a file."),
    Option("store.redis.tls_ca_file", "str", "", "CA bundle that verifies rediss:// servers "
           "(empty: the system's)."),
    Option("store.redis.tls_cert_file", "str", "", "Client certificate for rediss:// (mutual "
           "TLS)."),
    Option("store.redis.tls_key_file", "str", "", "Key of the client certificate."),
    Option("store.redis.ttl_s", "int", 0, "Expire stored blocks after this many seconds "
           "(0: never; capacity is the server's maxmemory with maxmemory-policy allkeys-lru).",
           min=0),
    Option("store.redis.key_prefix", "str", "ucm", "First part of every key "
           "(prefix:{namespace:id}:v|m).", check=_check_key_prefix),
    # mooncake tier
    Option("store.mooncake.masters", "list[str]", ["127.0.0.1:50051"], "mooncake_master "
           "addresses (host:port), each one independent Mooncake Store; blocks spread over them "
           "by rendezvous hashing.", check=_check_servers),
    Option("store.mooncake.servers_file", "str", "", "A file listing the masters, one per line, "
           "re-read when it changes; overrides store.mooncake.masters when set."),
    Option("store.mooncake.metadata_server", "str", "http://127.0.0.1:8080/metadata",
           "Transfer-engine metadata server (the master's built-in HTTP server, etcd://..., or "
           "P2PHANDSHAKE)."),
    Option("store.mooncake.protocol", "str", "tcp", "Transfer protocol.", choices=("tcp", "rdma")),
    Option("store.mooncake.device_name", "str", "", "RDMA devices (protocol rdma)."),
    Option("store.mooncake.local_hostname", "str", "127.0.0.1", "Address this client is "
           "reached at by the storage nodes.", check=_check_hostname),
    Option("store.mooncake.global_segment_size", "size", 0, "Memory this process lends to the "
           "store (0: none; storage nodes are separate mooncake_client processes).", min=0,
           check=_check_mooncake_segment),
    Option("store.mooncake.replicas", "int", 1, "Replicas of each value.", min=1),
    # s3 tier
    Option("store.s3.bucket", "str", "", "Bucket of the s3 tier (must exist)."),
    Option("store.s3.prefix", "str", "ucm", "Key prefix inside the bucket.",
           check=_check_object_prefix),
    Option("store.s3.endpoint_url", "str", "", "S3-compatible endpoint (empty: AWS); "
           "credentials and region come from the usual AWS chain (environment, ~/.aws, "
           "instance role)."),
    Option("store.s3.region", "str", "", "Region (empty: the AWS chain's)."),
    Option("store.s3.multipart_bytes", "size", 8 * 1024**2, "Values larger than this are "
           "uploaded in parts of this size.", min=5 * 1024**2),
    Option("store.s3.max_attempts", "int", 5, "Attempts per request, with exponential backoff "
           "on throttling and server errors.", min=1, max=20),
    # engine connector
    Option("connector.layerwise", "bool", False, "Load and save KV layer by layer (vLLM's "
           "wait_for_layer_load / save_kv_layer) instead of once per step."),
    Option("connector.save_generated", "bool", True, "Also store blocks filled by generated "
           "tokens (multi-turn chats reuse them), not only prompt blocks."),
    Option("connector.model_id", "str", "", "Model identity in the namespace (default: the "
           "engine's model name); engines with equal ids and settings share blocks."),
    Option("connector.stats_file", "str", "", "Append per-step connector statistics (JSON "
           "lines) to this file."),
    Option("connector.async_save", "bool", True, "Save blocks on a background thread (gather, "
           "store, commit) so the step does not wait; vLLM keeps a finished request's blocks "
           "until its saves are done. Off: the step returns after its blocks are stored."),
    Option("connector.save_during_forward", "bool", True, "With async_save: copy a step's new "
           "blocks out layer by layer as vLLM finishes each layer (its save_kv_layer hook), on "
           "the background thread, while the forward computes the next layers; the step's last "
           "job commits them. A prompt's save then runs beside its own prefill instead of "
           "through the first decode steps (where it costs memory bandwidth). Used once vLLM was "
           "seen calling that hook for every layer of a step; else the whole save starts at the "
           "end of the step. CPU engines (GPU engines always save at the end of the step)."),
    Option("connector.prefetch", "bool", True, "When a request joins vLLM's waiting queue, look "
           "its blocks up and have the workers move those that only slower tiers hold (posix, "
           "distributed) into the memory tier while it waits (the store's prefetch)."),
    Option("connector.partial_tail", "bool", True, "Also store a prompt's partial last block "
           "under an id of its exact tokens, so a repeated prompt computes only its last token."),
    Option("connector.overlap_load", "bool", True, "Copy loaded blocks into the paged cache "
           "layer by layer on a background thread while the forward runs; each layer's attention "
           "waits for its own layer only (vLLM's wait_for_layer_load). Used once the engine was "
           "seen to call that hook for every layer, and only with a CPU the engine does not "
           "compute on (same-engine A/B on the 2-core VM: 1-3% faster; across engines the "
           "noise is larger). Off: the whole copy ends before the forward."),
    Option("connector.engine_poll_us", "float", 100.0, "CPU engines: while the worker computes a "
           "step, vLLM's engine core checks for its result every this many microseconds, "
           "sleeping in between, instead of spinning with sched_yield on the CPU where ucm's "
           "overlapped copy runs (same-engine A/B, warm 4,000-token prompt: 0.87-0.90x TTFT). "
           "Costs about one poll period per step (~0.1 ms; 0.2% of a 50 ms step, more for "
           "short steps). 0: vLLM's spin. GPU engines are never changed.", min=0.0),
    # Blend: non-prefix reuse of chunk KV
    Option("blend.enabled", "bool", True, "Blend: a request that marks its prompt as chunks "
           "(kv_transfer_params {'ucm_blend': ...}, or blend.separator) reuses each stored "
           "chunk's KV wherever the chunk sits, recomputing a fraction of its tokens "
           "(docs/blend.md)."),
    Option("blend.recompute_ratio", "float", 0.15, "Fraction of a blended region's stored "
           "tokens recomputed: those the prompt after the chunks attends to most (without one, "
           "those whose stored KV deviates most from a full prefill's at the check layer).",
           min=0, max=1),
    Option("blend.check_layer", "int", 1, "Blend's lookahead counts the attention of the "
           "layers above this one; without a lookahead, the layer where the deviation is "
           "measured (the layers up to it are then computed for every token).", min=0),
    Option("blend.separator", "list[int]", [], "Token ids that separate chunks in every prompt "
           "(the text before the first and after the last separator is not a chunk); empty: "
           "only requests that mark chunks blend."),
    Option("blend.store_chunks", "bool", True, "A chunk the store lacks is stored (as "
           "blend.chunk_source says), so the next prompt holding it blends it."),
    Option("blend.chunk_source", "str", "context", "Where a stored chunk's KV comes from: "
           "'context', the rows the prompt that first carries the chunk computed in its own "
           "prefill (keys rotated to start after blend.sink; nothing computed again; a "
           "chunk's tokens then hold KV that attended to text like the rest of a prompt, "
           "which lowers the error a Blend leaves, docs/blend.md); 'alone', the chunk computed "
           "again on its own after blend.sink and blend.context, so its stored KV does not "
           "depend on which prompt carried it first (reproducible across cache histories). "
           "Part of the chunk ids: changing it is a clean miss.", choices=("context", "alone")),
    Option("blend.sink", "str", "bos", "What a chunk computed alone follows: 'bos', the model's "
           "BOS token (its KV dropped), so the chunk's first token does not turn into an "
           "attention sink whose stored KV the recompute must repair (no BOS in the model's "
           "config: as 'none'); 'none', nothing: the chunk begins the sequence and a request "
           "that begins with it stores it too. With blend.chunk_source 'context', where the "
           "stored keys' positions start (after the sink). Part of the chunk ids: changing it "
           "is a clean miss for chunks stored before.", choices=("bos", "none")),
    Option("blend.context", "list[int]", [], "Token ids a chunk computed alone "
           "(blend.chunk_source 'alone') follows, after blend.sink (their KV dropped): text of "
           "the kind that precedes chunks in your prompts (a RAG system prompt, a passage like "
           "the documents), so a chunk's first tokens are stored as they are inside a prompt "
           "rather than at its start. Part of the chunk ids "
           "(changing it is a clean miss); every id must be in the model's vocabulary.",
           check=_check_context),
    Option("connector.load_failure", "str", "recompute", "What vLLM does with blocks that fail to "
           "load: 'recompute' them (ucm sets vLLM's kv_load_failure_policy) or leave vLLM's own "
           "setting ('engine'; vLLM's default fails the request).", choices=("recompute", "engine")),
)

OPTION_BY_NAME: dict[str, Option] = {o.name: o for o in OPTIONS}

PRESETS: dict[str, dict[str, Any]] = {
    # interactive multi-turn chat: the last turns stay in memory, saves never wait for disk,
    # sparse selections follow the conversation closely
    "realtime_chat": {"buffer_number": 4096, "store.write_back": True,
                      "connector.save_generated": True, "retrieval_stride": 2},
    # offline batches: throughput first (sparser decode, more I/O threads); outputs are rarely
    # prompts again, so generated blocks are not stored
    "batch": {"sparse_ratio": 0.2, "buffer_number": 4096, "store.io_threads": 8,
              "connector.save_generated": False},
    # accuracy first: denser sparse decode, longer requests stay dense, the first layers dense
    "high_quality": {"sparse_ratio": 0.5, "min_blocks": 32, "local_window": 4,
                     "sparse_dense_layers": 2},
    # small hosts: a small pinned pool, a small disk budget, int8 block summaries
    "low_memory": {"buffer_number": 512, "cache_capacity": 8 * 1024**3, "sparse_repr_dtype": "int8"},
}


# ---------------------------------------------------------------------------------------------
# loading

def _suggest(key: str, candidates) -> str:
    close = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _flatten(d: Mapping, source: str, prefix: str = "") -> dict:
    if not isinstance(d, Mapping):
        raise ConfigError(f"config ({source}): expected a mapping, got {type(d).__name__}")
    out = {}
    for key, value in d.items():
        if not isinstance(key, str):
            raise ConfigError(f"config ({source}): keys must be strings, got {key!r}")
        full = prefix + key
        if isinstance(value, Mapping) and full not in OPTION_BY_NAME:
            flat = _flatten(value, source, full + ".")
        else:
            flat = {full: value}
        for k, v in flat.items():
            if k in out:  # 'store.pipeline' and store: {pipeline: ...} in one source
                raise ConfigError(f"config key {k!r} ({source}): given twice (as a dotted key "
                                  f"and nested), with {out[k]!r} and {v!r}; give it once")
            out[k] = v
    return out


def _unknown(key: str, source: str) -> ConfigError:
    valid = ["preset"] + sorted(OPTION_BY_NAME)
    return ConfigError(f"unknown config key {key!r} ({source}){_suggest(key, valid)} "
                      f"Valid keys: {', '.join(valid)}")


def _check_preset(name, source: str) -> str:
    if not isinstance(name, str) or name not in PRESETS:
        raise ConfigError(f"config key 'preset' ({source}): expected one of {sorted(PRESETS)}, "
                         f"got {name!r}{_suggest(str(name), PRESETS)}")
    return name


def _env_settings(env: Mapping[str, str]) -> dict:
    out = {}
    by_env = {o.env: o for o in OPTIONS}
    for var, raw in env.items():
        if not var.startswith("UCM_") or var in RESERVED_ENV:
            continue
        if var == "UCM_PRESET":
            out["preset"] = raw
            continue
        opt = by_env.get(var)
        if opt is None:
            known = list(by_env) + ["UCM_PRESET"] + list(RESERVED_ENV)
            hint = _suggest(var, known)
            text = (f"unknown environment variable {var}{hint} (config variables: "
                    f"{', '.join(sorted(by_env))}; other UCM_ variables: {', '.join(sorted(RESERVED_ENV))})")
            if difflib.get_close_matches(var, known, n=1, cutoff=0.85):
                raise ConfigError(text)  # a near miss of a real name: meant to configure ucm
            _warn_once(var, "ucm: ignoring " + text)
            continue
        out[opt.name] = opt.parse(raw, f"env {var}", text=True)
    return out


_warned: set = set()


def _warn_once(key: str, text: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning("%s", text)


def _read_yaml(path: str) -> dict:
    import yaml

    try:
        with open_regular(os.path.expanduser(path), "r", encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ConfigError(f"config file {path!r} cannot be read: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path!r} is not valid YAML: {exc}") from None
    return {} if data is None else data


class Config:
    """Validated, immutable settings. ``cfg["store.pipeline"]``, ``cfg.sparse_ratio``,
    ``cfg.compression.bits``; ``cfg.source(key)`` says where a value came from."""

    __slots__ = ("_values", "_sources", "preset")

    def __init__(self, values: Optional[Mapping] = None, *, preset: Optional[str] = None,
                 env: Optional[Mapping[str, str]] = None, file: Optional[str] = None):
        """Build from the table defaults, ``preset``, YAML ``file``, ``env`` (pass
        ``os.environ`` to read the process environment; default: none) and ``values``."""
        layers = []  # (source name, flat dict), lowest precedence first
        if file is not None:
            layers.append((f"file {file}", _flatten(_read_yaml(file), f"file {file}")))
        if env is not None:
            layers.append(("env", _env_settings(env)))
        if values is not None:
            layers.append(("dict", _flatten(values, "dict")))

        chosen_preset, preset_source = preset, "argument"
        for source, flat in layers:
            if "preset" in flat:
                chosen_preset, preset_source = flat["preset"], source
        if chosen_preset is not None:
            chosen_preset = _check_preset(chosen_preset, preset_source)

        vals = {o.name: o.default for o in OPTIONS}
        srcs = {o.name: "default" for o in OPTIONS}
        if chosen_preset:
            for key, value in PRESETS[chosen_preset].items():
                vals[key], srcs[key] = value, f"preset {chosen_preset}"
        for source, flat in layers:
            for key, raw in flat.items():
                if key == "preset":
                    continue
                opt = OPTION_BY_NAME.get(key)
                if opt is None:
                    raise _unknown(key, source)
                vals[key] = raw if source == "env" else opt.parse(raw, source)
                srcs[key] = source
        object.__setattr__(self, "_values", vals)
        object.__setattr__(self, "_sources", srcs)
        object.__setattr__(self, "preset", chosen_preset)
        self._cross_check()

    @classmethod
    def load(cls, source=None, *, preset: Optional[str] = None, env: Optional[Mapping] = None,
             overrides: Optional[Mapping] = None) -> "Config":
        """The usual entry point: ``source`` is a YAML path, a dict or None (then
        ``UCM_CONFIG_FILE`` if set); the process environment applies; ``overrides`` win."""
        env = os.environ if env is None else env
        file = None
        values = dict(overrides or {})
        if isinstance(source, (str, os.PathLike)):
            file = os.fspath(source)
        elif isinstance(source, Mapping):
            values = {**_flatten(source, "dict"), **_flatten(values, "dict")}
        elif source is not None:
            raise ConfigError(f"Config.load: source must be a YAML path, a dict or None, got "
                             f"{type(source).__name__}")
        if file is None and env.get("UCM_CONFIG_FILE"):
            file = env["UCM_CONFIG_FILE"]
        return cls(values or None, preset=preset, env=env, file=file)

    def _cross_check(self) -> None:
        if self["compression.enabled"] and self["compression.method"] == "learned" \
                and not self["compression.projection"]:
            raise ConfigError("config key 'compression.projection': compression.method 'learned' "
                              "needs the file of a fitted projection")
        if self["init_window"] + self["local_window"] > self["min_blocks"]:
            raise ConfigError(
                f"config keys 'init_window' ({self['init_window']}) + 'local_window' "
                f"({self['local_window']}) must not exceed 'min_blocks' ({self['min_blocks']}): "
                f"requests shorter than min_blocks stay dense")

    # access ---------------------------------------------------------------------------------
    def __getitem__(self, key: str):
        if not isinstance(key, str):
            raise ConfigError(f"config keys are strings such as 'store.pipeline', got {key!r}")
        try:
            return self._values[key]
        except KeyError:
            raise _unknown(key, "lookup") from None

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        if name in self._values:
            return self._values[name]
        prefix = name + "."
        if any(k.startswith(prefix) for k in self._values):
            return _Section(self, prefix)
        raise AttributeError(f"Config has no option {name!r}{_suggest(name, self._values)}")

    def __setattr__(self, name, value):
        raise AttributeError("Config is immutable; use cfg.replace(...)")

    def __eq__(self, other) -> bool:
        return isinstance(other, Config) and self._values == other._values

    def __repr__(self) -> str:
        changed = {k: v for k, v in self._values.items() if self._sources[k] != "default"}
        return f"Config({changed!r})"

    def get(self, key: str, default=None):
        return self._values.get(key, default)

    def source(self, key: str) -> str:
        self[key]
        return self._sources[key]

    def to_dict(self) -> dict:
        return dict(self._values)

    def replace(self, **changes) -> "Config":
        """A new Config with some values changed (dotted keys as ``**{"store.pipeline": ...}``)."""
        explicit = {k: v for k, v in self._values.items() if self._sources[k] != "default"
                    and not self._sources[k].startswith("preset")}
        explicit.update(changes)
        return Config(explicit, preset=self.preset)


class _Section:
    def __init__(self, cfg: Config, prefix: str):
        self._cfg, self._prefix = cfg, prefix

    def __getattr__(self, name: str):
        return getattr(self._cfg, self._prefix + name) if not name.startswith("_") else \
            object.__getattribute__(self, name)

    def __repr__(self) -> str:
        return repr({k: v for k, v in self._cfg.to_dict().items() if k.startswith(self._prefix)})


def options_markdown() -> str:
    """The option table as Markdown (README.md embeds this; a test keeps them equal)."""
    rows = ["| option | env | type | default | accepted | meaning |", "|---|---|---|---|---|---|"]
    for o in OPTIONS:
        rows.append(f"| `{o.name}` | `{o.env}` | {o.type} | `{o.default!r}` | {o.accepted()} | {o.doc} |")
    return "\n".join(rows)
