"""KV storage tiers behind one async API (lookup / load / dump / wait / commit).

``open_store(config, block_bytes=..., shard_bytes=..., namespace=...)`` builds the tiers named
by ``store.pipeline`` (``"memory|posix"`` by default). See :mod:`ucm.store.base` for the
contract, :mod:`ucm.store.memory`, :mod:`ucm.store.posix` and :mod:`ucm.store.pipeline`.
"""
from ucm.store.base import BlockBuffers, BlockGeometry, KVStore, Task, TaskResult
from ucm.store.factory import open_store, register, tiers

__all__ = ["BlockBuffers", "BlockGeometry", "KVStore", "Task", "TaskResult", "open_store",
           "register", "tiers"]
