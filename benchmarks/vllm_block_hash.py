#!/usr/bin/env python3
"""Time vLLM's own prefix-cache block hashing, as a reference point.

Run with the interpreter of a venv that has vLLM installed, e.g.

    /work/vllm-venv/bin/python benchmarks/vllm_block_hash.py
    /work/vllm-venv/bin/python benchmarks/vllm_block_hash.py --algo sha256_cbor

It builds a deterministic prompt (numpy rng seed 0, token ids < 49152) and
hashes every full block the way vLLM's engine does:

* ``get_hash_fn_by_name(algo)`` (vllm.utils.hashing) picks the hash function,
  ``init_none_hash(fn)`` seeds the root parent hash (NONE_HASH), and
* ``--mode request`` (default): the closure from
  ``get_request_block_hasher(block_size, fn)`` is called on a real
  ``vllm.v1.request.Request`` -- the exact code EngineCore attaches to each
  request; it chains ``hash_block_tokens(fn, parent_hash, block_tokens,
  extra_keys)`` block after block.
* ``--mode chain``: the same chain done by calling ``hash_block_tokens``
  directly in a loop (no Request object, extra_keys=None).

Prints one JSON line. This script deliberately does not import ``ucm``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

ALGOS_FALLBACK = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")


def _die(msg: str, code: int = 2) -> None:
    print(f"vllm_block_hash.py: {msg}", file=sys.stderr)
    sys.exit(code)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("n_tokens", nargs="?", type=int, default=131072,
                   help="number of prompt tokens (default 131072)")
    p.add_argument("--block-size", "-b", type=int, default=16,
                   help="tokens per block (default 16)")
    p.add_argument("--algo", default=None,
                   help="vLLM prefix_caching_hash_algo (default: vLLM's "
                        "own default from CacheConfig)")
    p.add_argument("--mode", choices=("request", "chain"), default="request",
                   help="request: vLLM's get_request_block_hasher on a real "
                        "Request (default); chain: hash_block_tokens loop")
    p.add_argument("--repeats", type=int, default=5,
                   help="timed repeats (default 5; best and median reported)")
    p.add_argument("--list-algos", action="store_true",
                   help="print the algorithms this vLLM offers and exit")
    args = p.parse_args(argv)

    if args.n_tokens < 0 or args.block_size <= 0 or args.repeats <= 0:
        _die("n_tokens must be >= 0, block size and repeats must be > 0")

    try:
        import vllm
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core import kv_cache_utils
        from vllm.v1.core.kv_cache_utils import (
            get_request_block_hasher,
            hash_block_tokens,
            init_none_hash,
        )
    except Exception as e:  # ImportError, or a broken torch install
        _die(f"vllm is not importable with {sys.executable}: "
             f"{type(e).__name__}: {e}\n"
             "Use the interpreter of a venv with vLLM installed, e.g. "
             "/work/vllm-venv/bin/python benchmarks/vllm_block_hash.py")

    import typing

    try:
        from vllm.config.cache import CacheConfig, PrefixCachingHashAlgo
        algos = tuple(typing.get_args(PrefixCachingHashAlgo)) or ALGOS_FALLBACK
        default_algo = CacheConfig.__dataclass_fields__[
            "prefix_caching_hash_algo"].default
    except Exception:
        algos, default_algo = ALGOS_FALLBACK, "sha256"

    if args.list_algos:
        print(json.dumps({"vllm_version": vllm.__version__,
                          "default": default_algo, "algos": list(algos)}))
        return 0

    algo = args.algo or default_algo
    if algo not in algos:
        _die(f"unknown algo {algo!r}; this vLLM offers {list(algos)}")
    hash_fn = get_hash_fn_by_name(algo)
    try:
        hash_fn(b"probe")
    except ModuleNotFoundError as e:  # xxhash is optional in vLLM
        _die(f"algo {algo!r} unavailable: {e}")
    # Same as EngineCore.__init__: seed NONE_HASH for this hash function.
    init_none_hash(hash_fn)

    import numpy as np

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 49152, size=args.n_tokens).tolist()  # list[int]
    bs = args.block_size
    n_blocks = args.n_tokens // bs

    if args.mode == "request":
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        hasher = get_request_block_hasher(bs, hash_fn)
        # No block_hasher passed, so request.block_hashes stays empty and each
        # call below recomputes every full block from token 0.
        req = Request(request_id="bench", prompt_token_ids=tokens,
                      sampling_params=SamplingParams(max_tokens=1),
                      pooling_params=None)

        def run() -> list:
            return hasher(req)
    else:
        def run() -> list:
            out = []
            parent = None
            for start in range(0, n_blocks * bs, bs):
                parent = hash_block_tokens(hash_fn, parent,
                                           tokens[start:start + bs], None)
                out.append(parent)
            return out

    hashes = run()  # warm-up, also a sanity check
    if len(hashes) != n_blocks:
        _die(f"expected {n_blocks} block hashes, got {len(hashes)}", 1)

    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)

    best = min(times)
    print(json.dumps({
        "vllm_version": vllm.__version__,
        "algo": algo,
        "mode": args.mode,
        "n_tokens": args.n_tokens,
        "block_size": bs,
        "seconds_best": best,
        "seconds_median": statistics.median(times),
        "blocks": n_blocks,
        "repeats": args.repeats,
        "mtokens_per_s_best": (args.n_tokens / best / 1e6) if best else None,
        "hash_bytes": len(hashes[0]) if hashes else None,
        "none_hash_seed": kv_cache_utils.get_none_hash_seed()
        if algo.startswith("sha256") else "random-per-process",
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
