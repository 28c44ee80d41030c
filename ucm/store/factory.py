"""Tiers by name: ``open_store(config, block_bytes=..., shard_bytes=..., namespace=...)``.

Built-in tiers: ``memory``, ``posix`` (this machine); ``redis``, ``mooncake``, ``s3`` (shared by
many engines: ``ucm.store.remote``). ``register(name, "package.module:Class")`` adds one; a
pipeline entry may also name ``"package.module:Class"`` directly. A tier class is built with
``Class.from_config(geometry, config, namespace)``.
"""
from __future__ import annotations

import importlib
import inspect
import logging
import os
from typing import Optional, Union

from ucm.config import Config, ConfigError
from ucm.store.base import BlockGeometry, KVStore

log = logging.getLogger("ucm.store")

_TIERS: dict[str, object] = {
    "memory": "ucm.store.memory:MemoryStore",
    "posix": "ucm.store.posix:PosixStore",
    "redis": "ucm.store.redis:RedisStore",
    "mooncake": "ucm.store.mooncake:MooncakeStore",
    "s3": "ucm.store.s3:S3Store",
}


def register(name: str, cls: Union[str, type]) -> None:
    """Make tier ``name`` available to pipelines (a class or ``"package.module:Class"``)."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"tier name must be an identifier, got {name!r}")
    _TIERS[name] = cls


def tiers() -> list[str]:
    return sorted(_TIERS)


def tier_class(spec: str):
    """The class a pipeline entry names (``"memory"``, ``"package.module:Class"``)."""
    return _resolve(spec.strip())


def pipeline_is_process_local(pipeline: str) -> bool:
    """Whether every tier of a ``store.pipeline`` value keeps its blocks inside the process that
    opened it (``memory`` alone): another process never sees them. Raises ``ValueError`` for
    an unknown tier."""
    specs = [s for s in pipeline.split("|") if s.strip()]
    return all(getattr(tier_class(s), "process_local", False) for s in specs)


def _resolve(spec: str):
    target = _TIERS.get(spec, spec if ":" in spec else None)
    if target is None:
        raise ValueError(f"config key 'store.pipeline': unknown tier {spec!r}; known tiers: "
                         f"{', '.join(tiers())}, or 'package.module:Class'")
    if isinstance(target, type):
        cls = target
    else:
        module, _, attr = target.partition(":")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"config key 'store.pipeline': cannot load tier {spec!r} ({exc})") from None
    if not (isinstance(cls, type) and (issubclass(cls, KVStore) or hasattr(cls, "from_config"))):
        raise ValueError(f"config key 'store.pipeline': {spec!r} is not a tier class (a "
                         f"ucm.store.KVStore subclass, or a class with from_config), got {cls!r}")
    return cls


def create_tier(spec: str, geometry: BlockGeometry, config: Config, namespace: bytes,
                codec: int = 0) -> KVStore:
    """One tier; ``codec``: the code its block headers record (0: raw blocks). A tier without a
    block header (or a custom tier that takes no ``codec``) relies on the namespace alone."""
    return _build(_resolve(spec), spec, geometry, config, namespace, codec)


def _build(cls, spec: str, geometry: BlockGeometry, config: Config, namespace: bytes,
           codec: int) -> KVStore:
    """The tier of the resolved class ``cls`` (``spec`` names it in errors)."""
    if hasattr(cls, "from_config"):
        if codec and "codec" in inspect.signature(cls.from_config).parameters:
            tier = cls.from_config(geometry, config, namespace, codec=codec)
        else:
            tier = cls.from_config(geometry, config, namespace)
    else:
        tier = cls(geometry, config, namespace)
    if not isinstance(tier, KVStore):
        raise ValueError(f"config key 'store.pipeline': tier {spec!r} built {type(tier).__name__}, "
                         f"not a ucm.store.KVStore")
    return tier


def codec_spec(config: Config):
    """The :class:`ucm.compress.CodecSpec` the ``compression.*`` options describe (None when
    compression is off); ConfigError naming the key when they do not make one."""
    if not config["compression.enabled"]:
        return None
    from ucm.compress import CodecSpec, KeyRounding, Projection

    projection = rounding = None
    try:
        if config["compression.method"] == "learned":
            projection = Projection.load(os.path.expanduser(config["compression.projection"]))
        if config["compression.key_rounding"]:
            rounding = KeyRounding.load(os.path.expanduser(config["compression.key_rounding"]))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    try:
        return CodecSpec(method=config["compression.method"], bits=config["compression.bits"],
                         group=config["compression.group"], key_mode=config["compression.key_mode"],
                         salient=config["compression.salient"],
                         ratio=config["compression.compression_ratio"], projection=projection,
                         rounding=rounding)
    except ValueError as exc:
        raise ConfigError(f"config key {str(exc).split(':')[0]!r}: {exc}") from None


def open_store(config: Optional[Union[Config, dict, str]] = None, *, block_bytes: int,
               shard_bytes: Optional[int] = None, namespace: Optional[bytes] = None,
               kv_shape=None, **overrides) -> KVStore:
    """Build the store named by ``store.pipeline`` (a single tier or a pipeline).

    ``config``: a Config, a dict or a YAML path (``Config.load``); ``overrides`` are config keys
    with dots written as ``__`` (``store__pipeline="memory"``) or plain names (``buffer_number``).
    ``namespace``: the 16-byte namespace digest written into stored blocks. ``kv_shape``: a
    :class:`ucm.compress.KVShape` describing one shard (one layer) of a block, needed when
    ``compression.enabled`` (the store is then a :class:`ucm.store.codec.CodecStore` over the
    pipeline; the vLLM connector passes it).
    """
    if not isinstance(config, Config):
        config = Config.load(config, env={}) if config is not None else Config()
    if overrides:
        config = config.replace(**{k.replace("__", "."): v for k, v in overrides.items()})
    geometry = BlockGeometry(block_bytes, block_bytes if shard_bytes is None else shard_bytes)
    ns = bytes(16) if namespace is None else namespace
    spec = codec_spec(config)
    tier_geometry, tier_ns, code = geometry, ns, 0
    if spec is not None:
        from ucm.store.codec import inner_geometry, inner_namespace

        if kv_shape is None:
            raise ConfigError("config key 'compression.enabled': compression needs the shape of "
                              "the KV (the vLLM connector passes it; open_store(..., kv_shape="
                              "ucm.compress.KVShape(...)))")
        spec = spec.for_shape(kv_shape)
        if spec.rounding is not None:
            layers = geometry.block_bytes // geometry.shard_bytes
            try:
                if not spec.rounds_keys:
                    raise ValueError(f"acts on keys quantized per channel (INT8, INT4, sparse "
                                     f"with key_mode channel), the codec is {spec.params()}")
                spec.rounding.check(kv_shape, layers - 1)
            except ValueError as exc:
                raise ConfigError(f"config key 'compression.key_rounding': {exc}") from None
        try:
            spec.check(kv_shape)
            tier_geometry = inner_geometry(geometry, spec, kv_shape)
        except ValueError as exc:
            raise ConfigError(f"config key 'compression.method' ({spec.method}): {exc}") from None
        tier_ns, code = inner_namespace(ns, spec), spec.code()
    specs = [s.strip() for s in config["store.pipeline"].split("|")]
    classes = [_resolve(name) for name in specs]
    for i, cls in enumerate(classes):  # one tier under two names would hold every block twice
        if cls in classes[:i]:
            raise ConfigError(f"config key 'store.pipeline': {specs[classes.index(cls)]!r} and "
                              f"{specs[i]!r} are the same tier ({cls.__module__}:{cls.__name__}); "
                              f"each tier once")
    built = []
    try:
        for name, cls in zip(specs, classes):
            built.append(_build(cls, name, tier_geometry, config, tier_ns, code))
    except BaseException:
        for t in built:
            t.close()
        raise
    if len(built) == 1:
        store = built[0]
    else:
        from ucm.store.pipeline import PipelineStore

        store = PipelineStore(built, write_back=config["store.write_back"],
                              admission=config["store.admission"])
    if spec is None:
        return store
    from ucm.store.codec import CodecStore

    return CodecStore(store, geometry, spec, kv_shape, namespace=ns,
                      io_threads=config["store.io_threads"],
                      wait_timeout_s=config["store.wait_timeout_s"])


def _memory_from_config(cls, geometry, config, namespace):
    capacity = config["store.memory.capacity"]
    slots = max(1, capacity // geometry.block_bytes) if capacity else config["buffer_number"]
    key = "store.memory.capacity" if capacity else "buffer_number"
    from ucm.ops import physical_memory

    if slots * geometry.block_bytes > physical_memory():
        raise ConfigError(f"config key {key!r}: a memory tier of {slots} blocks of "
                          f"{geometry.block_bytes} bytes is more than this machine's memory "
                          f"({physical_memory()} bytes)")
    return cls(geometry, buffer_number=slots, io_threads=config["store.io_threads"],
               wait_timeout_s=config["store.wait_timeout_s"], namespace=namespace,
               policy=config["store.memory.policy"])


_BUDGET_LOGGED: set = set()


def _posix_budget(config, geometry) -> int:
    """``cache_capacity``; left at its default, also at most half the free space of the first
    root (a default must not fill a disk; never below two blocks per root, so a full disk means
    failed saves, not an engine that cannot start). Where the tier writes, and how much, is
    logged once per process and roots."""
    budget = config["cache_capacity"]
    roots = [os.path.expanduser(r) for r in config["store.posix.roots"]]
    why = "cache_capacity"
    if config.source("cache_capacity") == "default":
        probe = roots[0]
        while not os.path.exists(probe) and os.path.dirname(probe) != probe:
            probe = os.path.dirname(probe)
        try:
            st = os.statvfs(probe)
            half_free = st.f_bavail * st.f_frsize // 2
            if half_free < budget:
                floor = 2 * len(roots) * (geometry.block_bytes + (1 << 20))
                budget = max(half_free, floor)
                why = "half the free space of the first root (default budget)"
        except OSError:
            pass
    key = (tuple(roots), budget)
    if key not in _BUDGET_LOGGED:
        _BUDGET_LOGGED.add(key)
        log.info("ucm posix tier: storing up to %.1f GiB (%s) under %s", budget / 2**30, why,
                 ", ".join(roots))
    return budget


def _posix_from_config(cls, geometry, config, namespace, codec=0):
    return cls(geometry, roots=config["store.posix.roots"], namespace=namespace, codec=codec,
               capacity_bytes=_posix_budget(config, geometry), o_direct=config["store.posix.o_direct"],
               fsync=config["store.posix.fsync"], io_threads=config["store.io_threads"],
               wait_timeout_s=config["store.wait_timeout_s"], read_only=config["store.posix.read_only"],
               group=config["store.posix.group"] or None)


def _install():
    from ucm.store.memory import MemoryStore
    from ucm.store.posix import PosixStore

    MemoryStore.from_config = classmethod(_memory_from_config)
    PosixStore.from_config = classmethod(_posix_from_config)


_install()
