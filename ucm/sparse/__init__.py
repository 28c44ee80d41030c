"""Sparse attention methods built on the ops of :mod:`ucm.sparse.ops` (contract:
``docs/sparse.md``).

``create(config, **shape)`` builds the method named by the ``sparse_method`` option::

    m = ucm.sparse.create(cfg, num_layers=30, num_q_heads=9, num_kv_heads=3, head_dim=64,
                          block_size=16, device="cpu")

Methods (:data:`METHODS`): ``esa`` (mean keys, re-selection every ``retrieval_stride`` steps),
``gsa`` (hash codes, Hamming top-k, prefetch hook), ``kvstar`` (channel-pruned scores,
multi-query voting), ``quest`` (min/max upper bounds), ``mass`` (every step, each block's
attention mass under its tokens' int4 keys), ``adaptive`` (estimated-mass budgets per
request and layer); and two baselines for the accuracy harness, not for deployment: ``oracle``
(exact attention mass) and ``random``. ``sparse_method="none"`` gives ``None`` (dense).
"""
from __future__ import annotations

from typing import Mapping, Optional, Union

from ucm.config import Config
from ucm.sparse.adaptive import Adaptive
from ucm.sparse.base import SparseMethod, as_config
from ucm.sparse.baselines import Oracle, Random
from ucm.sparse.esa import ESA
from ucm.sparse.gsa import GSA
from ucm.sparse.kvstar import KVStar
from ucm.sparse.mass import Mass
from ucm.sparse.quest import Quest

__all__ = ["create", "SparseMethod", "METHODS", "BASELINES"]

METHODS: dict[str, type] = {cls.name: cls for cls in (ESA, GSA, KVStar, Quest, Mass, Adaptive,
                                                      Oracle, Random)}
BASELINES = ("oracle", "random")


def create(config: Union[Config, Mapping, None] = None, *, method: Optional[str] = None,
           **shape) -> Optional[SparseMethod]:
    """The sparse method of ``config`` (a :class:`ucm.Config`, a dict of options or None).

    ``method`` overrides ``config.sparse_method`` (the harness uses it for the baselines, which
    the option does not offer). ``shape``: ``num_layers, num_q_heads, num_kv_heads, head_dim,
    block_size, device`` plus ``per_kv_head`` (quest: one selection per KV head; default: the
    ``sparse_per_kv_head`` option) and
    method-specific arguments (``prefetch`` for gsa, ``seed`` for
    random). Returns None for ``"none"``."""
    cfg = as_config(config)
    name = cfg["sparse_method"] if method is None else method
    if name == "none":
        return None
    cls = METHODS.get(name)
    if cls is None:
        raise ValueError(f"method: unknown sparse method {name!r}; expected one of "
                         f"{['none'] + list(METHODS)}")
    return cls(cfg, **shape)
