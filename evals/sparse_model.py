"""The harnesses' sparse method rows, spelled ``NAME[:OPT+OPT...]`` on their command lines. The
model they run is ucm's reference Llama forward (:mod:`ucm.reference.llama`)."""
from __future__ import annotations


def method_variant(name: str, cfg: dict, **shape):
    """A harness row's sparse method from ``NAME[:OPT+OPT...]``: ``kvhead`` = per-KV-head
    selection (quest, oracle), ``gN`` = ``sparse_repr_group`` N, ``sN`` = ``retrieval_stride``
    N (ESA); e.g. ``quest:kvhead+g2``, ``esa:g2+s1``. ``cfg`` (ucm options) is not modified."""
    import ucm.sparse

    base, _, opts = name.partition(":")
    cfg, extra = dict(cfg), {}
    for opt in filter(None, opts.split("+")):
        if opt == "kvhead":
            extra["per_kv_head"] = True
        elif opt[:1] == "g" and opt[1:].isdigit():
            cfg["sparse_repr_group"] = int(opt[1:])
        elif opt[:1] == "s" and opt[1:].isdigit():
            cfg["retrieval_stride"] = int(opt[1:])
        else:
            raise ValueError(f"--methods: unknown option {opt!r} in {name!r} (expected kvhead, "
                             f"gN or sN)")
    return ucm.sparse.create(cfg, method=base, **extra, **shape)


def check_methods(methods, ratios, cfg: dict, **shape) -> None:
    """Build every (method, ratio) row once, so that an unknown method or option, a ratio or a
    ucm option that ucm refuses fails before any work, with ucm's own message (a
    ``ValueError`` naming what is wrong); the rows are dropped at once."""
    for ratio in ratios:
        for name in methods:
            method_variant(name, dict(cfg, sparse_method="esa", sparse_ratio=ratio), **shape)
