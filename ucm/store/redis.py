"""``redis`` tier: blocks on Redis servers or one Redis Cluster (redis-py; hiredis parses
replies when installed).

Keys are ``<prefix>:{<namespace>:<id>}:v`` (value: block header + payload) and ``...:m``
(commit marker): the braces are Redis Cluster's hash tag, so both keys of a block live on the
same node. Requests are pipelined, one pipeline per server (or per cluster node) and batch.
Capacity is the server's: set ``maxmemory`` and ``maxmemory-policy allkeys-lru`` (the least
recently read blocks go first; under ``noeviction`` a full server refuses saves, which fail and
are not stored). ``store.redis.ttl_s`` expires blocks by age on top of that.

Failures: a server that refuses the connection, times out or refuses the credentials makes the
tier leave it alone for a backoff (``ucm.store.remote``); in a cluster, only the keys of the node
that failed are lost, the other nodes keep serving theirs. Timeouts: ``store.remote.timeout_s``
for requests without values; requests that move a batch of values also get the batch's size at
``ucm.store.backends.SLOW_SERVER_BYTES_PER_S`` (a busy server is not a dead one).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Optional, Sequence
from urllib.parse import urlsplit

from ucm.config import ConfigError
from ucm.store.backends import Backend, Unavailable, data_timeout
from ucm.store.base import BlockGeometry
from ucm.store.remote import RemoteStore, remote_options

log = logging.getLogger("ucm.store.redis")

SCHEMES = ("redis", "rediss", "unix")
#: Redis's default proto-max-bulk-len
MAX_VALUE_BYTES = 512 * 1024**2
SMALL_VALUE = 64 * 1024  # a put of values up to this size is a control request (markers)


def _redis():
    try:
        import redis
    except ImportError as exc:
        raise ConfigError("config key 'store.pipeline': the redis tier needs redis-py "
                          "(pip install redis hiredis)") from exc
    return redis


def _unavailable_errors():
    from redis import exceptions as e

    return (e.ConnectionError, e.TimeoutError, e.AuthenticationError,
            e.AuthenticationWrongNumberOfArgsError, OSError)


def redacted(url: str) -> str:
    """The URL without its password (for logs and statistics)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return parts._replace(netloc=f"{user}:***@{netloc}" if user else f":***@{netloc}").geturl()


class RedisBackend(Backend):
    """One standalone server, or one cluster (``cluster=True``, ``url`` a seed node)."""

    max_value_bytes = MAX_VALUE_BYTES

    def __init__(self, url: str, *, cluster: bool = False, username: str = "", password: str = "",
                 timeout_s: float = 0.2, ttl_s: int = 0, tls_ca_file: str = "",
                 tls_cert_file: str = "", tls_key_file: str = "", backoff_s: float = 1.0,
                 batch_bytes: int = 16 << 20):
        redis = _redis()
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.name = redacted(url)
        self.cluster = cluster
        self._ttl_ms = int(ttl_s) * 1000 or None
        self._backoff_s = backoff_s
        self._errors = _unavailable_errors()
        kw = dict(socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0),
                  health_check_interval=0)
        if username:
            kw["username"] = username
        if password:
            kw["password"] = password
        if url.startswith("rediss://"):
            kw.update(ssl_ca_certs=tls_ca_file or None, ssl_certfile=tls_cert_file or None,
                      ssl_keyfile=tls_key_file or None)

        def client(read_timeout):
            if cluster:
                from redis.cluster import RedisCluster

                return RedisCluster.from_url(url, require_full_coverage=False, reinitialize_steps=1,
                                             socket_timeout=read_timeout, **kw)
            return redis.Redis.from_url(url, socket_timeout=read_timeout, **kw)

        # Two clients: requests without values (EXISTS, markers, DEL) wait timeout_s; those that
        # move a batch of values also the batch's size at the slowest expected rate
        try:
            self.client = client(timeout_s)
            self.data = client(data_timeout(timeout_s, batch_bytes))
        except self._errors as exc:
            raise Unavailable(f"{self.name}: {exc}") from exc
        self._node_down: dict = {}    # cluster node name -> monotonic time it may be tried again
        self._refresh_lock = threading.Lock()
        self._refreshed = 0.0

    # -- routing --------------------------------------------------------------------------------
    def _groups(self, keys: Sequence[str], client) -> list:
        """``[(client, name, [key index])]``: the whole batch on a standalone server; per node
        (by hash slot) in a cluster."""
        if not self.cluster:
            return [(client, self.name, list(range(len(keys))))]
        groups: dict = {}
        nm = client.nodes_manager
        for i, k in enumerate(keys):
            node = nm.get_node_from_slot(client.keyslot(k))
            groups.setdefault(node.name, (node, []))[1].append(i)
        out = []
        for name, (node, idx) in groups.items():
            if node.redis_connection is None:
                nm.create_redis_connections([node])
            out.append((node.redis_connection, name, idx))
        return out

    def _run(self, keys: Sequence[str], add, data: bool = False) -> list:
        """One pipeline per group; ``add(pipe, i)`` queues the command of key ``i``. Returns per
        key the reply, or the exception of its group. Raises Unavailable when every group's
        server failed (a cluster node failing alone only fails its own keys)."""
        out: list = [None] * len(keys)
        failed = 0
        groups = self._groups(keys, self.data if data else self.client) if keys else []
        for client, name, idx in groups:
            if self._node_down.get(name, 0) > time.monotonic():
                err = Unavailable(f"{name} down")
            else:
                pipe = client.pipeline(transaction=False)
                for i in idx:
                    add(pipe, i)
                try:
                    replies = pipe.execute(raise_on_error=False)
                    err = None
                except self._errors as exc:
                    err = Unavailable(f"{name}: {exc}")
            if err is not None:
                failed += 1
                if self.cluster:
                    self._node_down[name] = time.monotonic() + self._backoff_s
                    self._refresh()
                for i in idx:
                    out[i] = err
                continue
            self._node_down.pop(name, None)
            for i, r in zip(idx, replies):
                out[i] = r
        if groups and failed == len(groups):
            raise next(r for r in out if isinstance(r, Unavailable))
        if self.cluster and any(_moved(r) for r in out):
            self._refresh()
        return out

    def _refresh(self) -> None:
        """Re-read the cluster's slot map (at most once per backoff period)."""
        with self._refresh_lock:
            if time.monotonic() - self._refreshed < self._backoff_s:
                return
            self._refreshed = time.monotonic()
        try:
            self.client.nodes_manager.initialize()
            self.data.nodes_manager.initialize()
        except Exception as exc:  # the map stays as it was; the next failure tries again
            log.info("ucm redis: cluster slot map not refreshed: %r", exc)

    # -- Backend --------------------------------------------------------------------------------
    def put(self, keys, values) -> list[Optional[str]]:
        ttl = self._ttl_ms
        data = any(len(v) > SMALL_VALUE for v in values)
        replies = self._run(keys, lambda p, i: p.set(keys[i], values[i], px=ttl), data)
        return [None if r is True else f"{r}" for r in replies]

    def get(self, keys, rows) -> list:
        replies = _tampered_as_empty(self._run(keys, lambda p, i: p.get(keys[i]), True))
        _raise_first_error(replies)
        return replies  # a cluster node that failed alone: its keys carry the Unavailable

    def get_committed(self, keys, markers, rows) -> list:
        """One pipeline: EXISTS marker, GET value, per block (both keys on one node)."""
        n = len(keys)
        both = [k for pair in zip(markers, keys) for k in pair]
        replies = _tampered_as_empty(self._run(
            both, lambda p, j: p.exists(both[j]) if j % 2 == 0 else p.get(both[j]), True))
        _raise_first_error(replies)
        out = []
        for i in range(n):
            marker, value = replies[2 * i], replies[2 * i + 1]
            out.append(marker if isinstance(marker, Exception) else value if marker else None)
        return out

    def exists(self, keys) -> list[bool]:
        replies = self._run(keys, lambda p, i: p.exists(keys[i]))
        _raise_first_error(replies)
        return [not isinstance(r, Exception) and bool(r) for r in replies]

    def delete(self, keys) -> None:
        self._run(keys, lambda p, i: p.delete(keys[i]))

    def ping(self) -> None:
        try:
            if self.cluster:
                self.client.ping(target_nodes=self.client.get_primaries())
            else:
                self.client.ping()
        except self._errors as exc:
            raise Unavailable(f"{self.name}: {exc}") from exc

    def keys(self, prefix: str):
        targets = self.client.get_primaries() if self.cluster else [None]
        for node in targets:
            client = node.redis_connection if node is not None else self.client
            for k in client.scan_iter(match=_glob_escape(prefix) + "*", count=1000):
                yield k.decode() if isinstance(k, bytes) else k

    def close(self) -> None:
        self.client.close()
        self.data.close()


def _moved(reply) -> bool:
    return isinstance(reply, Exception) and str(reply).startswith(("MOVED", "ASK"))


def _tampered_as_empty(replies) -> list:
    """A key that holds another type than a string (WRONGTYPE: written by something else) is
    a value of no bytes, which the tier refuses as corrupt and deletes, instead of an error that
    would fail the other blocks of the batch on every load."""
    return [b"" if isinstance(r, Exception) and not isinstance(r, Unavailable)
            and str(r).startswith("WRONGTYPE") else r for r in replies]


def _raise_first_error(replies) -> None:
    """A read that failed for a key (NOPERM, a node down) fails the batch: the
    tier counts it and reads the blocks as misses."""
    for r in replies:
        if isinstance(r, Unavailable):
            continue  # that node's keys: misses; the other nodes' replies stand
        if isinstance(r, Exception):
            raise RuntimeError(f"redis: {r}") from r


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


class RedisStore(RemoteStore):
    name = "redis"
    key_format = "{prefix}:{{{ns}:{id}}}:{kind}"
    label = staticmethod(redacted)

    @classmethod
    def from_config(cls, geometry: BlockGeometry, config, namespace: bytes,
                    codec: int = 0) -> "RedisStore":
        servers = config["store.redis.servers"]
        servers_file = config["store.redis.servers_file"]
        key = "store.redis.servers_file" if servers_file else "store.redis.servers"
        if servers_file:  # read here too, so that a file the tier cannot use names its key
            try:
                with open(servers_file) as f:
                    listed = [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError(f"config key {key!r}: cannot read {servers_file!r}: {exc}") from None
            if not listed:
                raise ConfigError(f"config key {key!r}: {servers_file!r} lists no server")
        for url in (listed if servers_file else servers):
            scheme = urlsplit(url).scheme
            if scheme not in SCHEMES:
                raise ConfigError(f"config key {key!r}: {redacted(url)!r} is not a "
                                  f"Redis URL (expected {', '.join(s + '://' for s in SCHEMES)})")
        cluster = config["store.redis.cluster"]
        opts = dict(cluster=cluster, username=config["store.redis.username"],
                    password=config["store.redis.password"], timeout_s=config["store.remote.timeout_s"],
                    ttl_s=config["store.redis.ttl_s"], tls_ca_file=config["store.redis.tls_ca_file"],
                    tls_cert_file=config["store.redis.tls_cert_file"],
                    tls_key_file=config["store.redis.tls_key_file"],
                    backoff_s=config["store.remote.backoff_s"],
                    batch_bytes=config["store.remote.batch_bytes"])
        if cluster:  # one cluster: the seeds are tried in turn, the cluster routes the keys
            seeds = list(servers)
            servers = [seeds[0]]

            def connect(_name):
                last = None
                for url in seeds:
                    try:
                        return RedisBackend(url, **opts)
                    except Unavailable as exc:
                        last = exc
                raise last
        else:
            def connect(url):
                return RedisBackend(url, **opts)
        store = cls(geometry, servers, connect, namespace=namespace, codec=codec,
                    key_prefix=config["store.redis.key_prefix"],
                    servers_file=config["store.redis.servers_file"], **remote_options(config))
        store.check_reachable("store.redis.servers_file" if config["store.redis.servers_file"]
                              else "store.redis.servers")
        return store

