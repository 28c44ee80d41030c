#!/usr/bin/env python3
"""Foundation ops: each fast implementation against its reference (and a peer or the machine's
ceiling where there is one), every output checked before a time counts.

    pytest benchmarks/bench_foundation.py                      # pytest-benchmark, one group per op
    pytest benchmarks/bench_foundation.py --benchmark-disable  # smoke run (CI)
    python benchmarks/bench_foundation.py [--vllm-python PY] [--json benchmarks/results/bench_foundation_cpu.json]

The script times every provider of every op in one run (best of several repeats) and prints the
ratios RESULTS.md cites; it stops with an error, reporting nothing, if any provider's output
differs from the reference. Ops and providers (``baseline`` = the denominator of the ratios):

* ``hash_blocks``: 131,072 tokens in 16-token blocks; ``reference`` (pure Python, baseline),
  ``numba``; the script adds vLLM's own default block hashing (its ``get_request_block_hasher``
  on a real ``Request``), run by an interpreter that has vLLM (``--vllm-python``,
  ``UCM_VLLM_PYTHON``, this interpreter or ``../vllm-venv``; skipped with a note if none).
* ``lookup_prefix``: ``BlockIndex.lookup_prefix`` over 1,000,000 resident ids; ``reference``
  (baseline), ``numba``.
* ``copy_segments``: 256 MiB in 64 KiB segments to a random permutation of slots; ``numpy``
  (a single-threaded numpy copy of the same segments between the same buffers, baseline),
  ``reference`` (``ctypes.memmove`` per segment), ``native`` with 1 and with ``threads``
  threads, and the ceiling: one contiguous copy of the 256 MiB (native, ``threads`` threads).
* ``checksum``: ucm-sum64 of 32 MiB; ``reference`` (numpy, baseline), ``native``.
* ``io_read``: ``io_batch`` reading a 64 MiB file (page cache warm) in 2 MiB ops with their
  checksums; ``reference`` (``os.preadv`` + numpy checksum, baseline), ``native``, and the
  ceiling: native reads without checksums.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np
from _argtypes import count as _count, write_json  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


# ---------------------------------------------------------------------------------------------
# vLLM's block hashing. Runs in an interpreter that has vLLM (and maybe not ucm or pytest), as
# ``python bench_foundation.py vllm-hash ...``: it needs only vLLM and numpy.

def vllm_block_hash(n_tokens: int, block_size: int, repeats: int, algo: str | None) -> dict:
    """Seconds vLLM takes to hash every full block of a prompt as its engine does: the hash
    function of ``prefix_caching_hash_algo`` (vLLM's default unless ``algo``), ``NONE_HASH``
    seeded as EngineCore does, then ``get_request_block_hasher``'s closure on a ``Request``."""
    import vllm
    from vllm.config.cache import CacheConfig
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    algo = algo or CacheConfig.__dataclass_fields__["prefix_caching_hash_algo"].default
    hash_fn = get_hash_fn_by_name(algo)
    init_none_hash(hash_fn)
    tokens = tokens_for_hashing(n_tokens).tolist()
    hasher = get_request_block_hasher(block_size, hash_fn)
    # no block_hasher passed: request.block_hashes stays empty, each call hashes every block
    req = Request(request_id="bench", prompt_token_ids=tokens, sampling_params=SamplingParams(max_tokens=1),
                  pooling_params=None)
    if len(hasher(req)) != n_tokens // block_size:
        raise SystemExit("vLLM's block hasher returned the wrong number of hashes")
    return {"vllm_version": vllm.__version__, "algo": algo, "seconds_best": best_of(lambda: hasher(req), repeats)}


def tokens_for_hashing(n_tokens: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 49152, size=n_tokens)


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


if __name__ == "__main__" and sys.argv[1:2] == ["vllm-hash"]:
    _p = argparse.ArgumentParser(prog="bench_foundation.py vllm-hash")
    _p.add_argument("n_tokens", type=int)
    _p.add_argument("--block-size", type=int, required=True)
    _p.add_argument("--repeats", type=int, required=True)
    _p.add_argument("--algo")
    _a = _p.parse_args(sys.argv[2:])
    print(json.dumps(vllm_block_hash(_a.n_tokens, _a.block_size, _a.repeats, _a.algo)))
    sys.exit(0)

import tempfile  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any, Callable  # noqa: E402

import pytest  # noqa: E402

import ucm  # noqa: E402
from ucm import ops  # noqa: E402


class WrongOutput(AssertionError):
    """A provider's output differs from the reference: no time of it may be reported."""


@dataclass
class Provider:
    run: Callable[[], Any]                  # one timed call
    check: Callable[[Any], None]            # raises WrongOutput unless run()'s effect is right
    repeats: int = 7                        # script: best of this many
    role: str = "fast"                      # reference | fast | peer | ceiling


@dataclass
class Case:
    op: str
    baseline: str
    providers: dict
    nbytes: int = 0                         # bytes moved per call (for GB/s), 0 if not a copy
    info: dict = field(default_factory=dict)
    cleanup: Callable[[], None] = lambda: None


def _expect(cond: bool, what: str) -> None:
    if not cond:
        raise WrongOutput(what)


def hashing_case(n_tokens: int, block_size: int) -> Case:
    tokens = tokens_for_hashing(n_tokens)
    ns = ucm.Namespace("bench", "bfloat16", block_size)
    expected = ucm.hash_blocks(tokens, ns, backend="reference")

    def provider(backend, repeats, role):
        return Provider(lambda: ucm.hash_blocks(tokens, ns, backend=backend),
                        lambda out: _expect(np.array_equal(out, expected), f"hash_blocks[{backend}] != reference"),
                        repeats, role)
    return Case("hash_blocks", "reference", {"reference": provider("reference", 3, "reference"),
                                             "numba": provider("numba", 30, "fast")},
                info={"n_tokens": n_tokens, "block_size": block_size})


def index_case(n_ids: int) -> Case:
    ids = np.random.default_rng(0).integers(0, 2**64 - 1, size=(n_ids, 2), dtype=np.uint64, endpoint=True)
    miss = ids.copy()
    miss[n_ids // 2, 0] ^= np.uint64(1)
    providers = {}
    for backend, repeats, role in (("reference", 3, "reference"), ("numba", 10, "fast")):
        idx = ucm.BlockIndex(n_ids, backend=backend)
        idx.insert(ids, np.arange(n_ids))
        _expect(idx.lookup_prefix(miss) == n_ids // 2, f"lookup_prefix[{backend}] missed the changed id")
        providers[backend] = Provider(lambda idx=idx: idx.lookup_prefix(ids),
                                      lambda hit, b=backend: _expect(hit == n_ids, f"lookup_prefix[{b}] = {hit}"),
                                      repeats, role)
    return Case("lookup_prefix", "reference", providers, info={"n_ids": n_ids})


def copy_case(total: int, segment: int, threads: int) -> Case:
    n = total // segment
    rng = np.random.default_rng(0)
    src = ucm.alloc_aligned(total)
    src[:] = rng.integers(0, 256, total, dtype=np.uint8)
    dst = ucm.alloc_aligned(total)
    so = np.arange(n, dtype=np.uint64) * np.uint64(segment)
    do = rng.permutation(n).astype(np.uint64) * np.uint64(segment)
    lengths = np.full(n, segment, dtype=np.uint64)
    expected = np.empty_like(src)
    expected.reshape(n, segment)[(do // np.uint64(segment)).astype(np.int64)] = src.reshape(n, segment)
    pairs = list(zip(so.tolist(), do.tolist()))

    def numpy_copy():
        for a, b in pairs:
            dst[b:b + segment] = src[a:a + segment]

    def scattered(name):
        def check(_):
            ok = np.array_equal(dst, expected)
            dst[:] = 0  # the next provider's check sees only its own bytes
            _expect(ok, f"copy_segments[{name}]: wrong bytes")
        return check

    def contiguous(_):
        ok = np.array_equal(dst, src)
        dst[:] = 0
        _expect(ok, "contiguous copy: wrong bytes")

    def native(k):
        return lambda: ucm.copy_ranges(src, so, dst, do, lengths, k, backend="native")
    providers = {
        "numpy": Provider(numpy_copy, scattered("numpy"), 7, "peer"),
        "reference": Provider(lambda: ucm.copy_ranges(src, so, dst, do, lengths, 1, backend="reference"),
                              scattered("reference"), 3, "reference"),
        "native_1thread": Provider(native(1), scattered("native_1thread"), 7, "fast"),
        **({f"native_{threads}threads": Provider(native(threads), scattered(f"native_{threads}threads"), 7,
                                                 "fast")} if threads > 1 else {}),  # (1: the row above)
        "ceiling_contiguous": Provider(
            lambda: ucm.copy_ranges(src, [0], dst, [0], [total], threads, backend="native"), contiguous, 7,
            "ceiling"),
    }
    return Case("copy_segments", "numpy", providers, nbytes=total,
                info={"total_bytes": total, "segment_bytes": segment, "threads": threads})


def checksum_case(nbytes: int) -> Case:
    data = np.random.default_rng(2).integers(0, 256, nbytes, dtype=np.uint8)
    expected = ops.checksum(data, 5, backend="reference")

    def provider(backend, repeats, role):
        return Provider(lambda: ops.checksum(data, 5, backend=backend),
                        lambda out: _expect(out == expected, f"checksum[{backend}] != reference"), repeats, role)
    return Case("checksum", "reference", {"reference": provider("reference", 3, "reference"),
                                          "native": provider("native", 10, "fast")},
                nbytes=nbytes, info={"bytes": nbytes})


def io_read_case(nbytes: int, op_bytes: int, threads: int, directory: str | None = None) -> Case:
    n = nbytes // op_bytes
    data = np.random.default_rng(3).integers(0, 256, nbytes, dtype=np.uint8)
    fd, path = tempfile.mkstemp(prefix="ucm-bench-io-", dir=directory)
    os.write(fd, data.tobytes())
    os.fsync(fd)
    dst = ucm.alloc_aligned(nbytes)
    expected = [ops.checksum(data[k * op_bytes:(k + 1) * op_bytes], 0) for k in range(n)]

    def batch():
        b = ops.new_io_ops(n)
        b["fd"], b["len"] = fd, op_bytes
        b["addr"] = dst.ctypes.data + np.arange(n, dtype=np.uint64) * np.uint64(op_bytes)
        b["file_off"] = np.arange(n, dtype=np.uint64) * np.uint64(op_bytes)
        return b

    def provider(backend, want_checksum, repeats, role):
        b = batch()

        def check(failed):
            ok = failed == 0 and (b["result"] == op_bytes).all() and np.array_equal(dst, data) and \
                (not want_checksum or b["checksum"].tolist() == expected)
            dst[:] = 0
            _expect(ok, f"io_batch[{backend}, checksum={want_checksum}]: wrong bytes or checksums")
        return Provider(lambda: ops.io_batch(b, threads, want_checksum, backend=backend), check, repeats, role)

    def cleanup():
        os.close(fd)
        os.unlink(path)
    return Case("io_read", "reference", {"reference": provider("reference", True, 3, "reference"),
                                         "native": provider("native", True, 7, "fast"),
                                         "ceiling_no_checksum": provider("native", False, 7, "ceiling")},
                nbytes=nbytes, info={"bytes": nbytes, "op_bytes": op_bytes, "threads": threads},
                cleanup=cleanup)


# ---------------------------------------------------------------------------------------------
# pytest-benchmark: one group per op, one test per provider

N_TOKENS, BLOCK_SIZE = 131072, 16
N_IDS = 1_000_000
COPY_BYTES, SEGMENT, THREADS = 256 << 20, 64 << 10, 2
CHECKSUM_BYTES = 32 << 20
IO_BYTES, IO_OP_BYTES = 64 << 20, 2 << 20

CASES = {
    "hash_blocks": lambda: hashing_case(N_TOKENS, BLOCK_SIZE),
    "lookup_prefix": lambda: index_case(N_IDS),
    "copy_segments": lambda: copy_case(COPY_BYTES, SEGMENT, THREADS),
    "checksum": lambda: checksum_case(CHECKSUM_BYTES),
    "io_read": lambda: io_read_case(IO_BYTES, IO_OP_BYTES, THREADS),
}
PARAMS = [("hash_blocks", p) for p in ("reference", "numba")] + \
    [("lookup_prefix", p) for p in ("reference", "numba")] + \
    [("copy_segments", p) for p in ("numpy", "reference", "native_1thread", f"native_{THREADS}threads",
                                    "ceiling_contiguous")] + \
    [("checksum", p) for p in ("reference", "native")] + \
    [("io_read", p) for p in ("reference", "native", "ceiling_no_checksum")]


@pytest.fixture(scope="module")
def cases():
    built = {}
    yield lambda op: built[op] if op in built else built.setdefault(op, CASES[op]())
    for case in built.values():
        case.cleanup()


@pytest.mark.parametrize("op,provider", PARAMS, ids=[f"{o}-{p}" for o, p in PARAMS])
def test_foundation(benchmark, cases, op, provider):
    case = cases(op)
    prov = case.providers[provider]
    benchmark.group = op
    benchmark.extra_info.update(case.info, role=prov.role, baseline=case.baseline)
    prov.check(prov.run())  # no time counts for a wrong output
    out = benchmark.pedantic(prov.run, rounds=min(prov.repeats, 5), warmup_rounds=0)
    prov.check(out)


# ---------------------------------------------------------------------------------------------
# script: every ratio in one run

def time_case(case: Case) -> dict:
    """Every provider checked, timed (best of its repeats) and checked again; ratios against the
    case's baseline (> 1: faster than the baseline)."""
    res = {"info": case.info, "baseline": case.baseline, "providers": {}}
    for name, prov in case.providers.items():
        prov.check(prov.run())
        last = []
        secs = best_of(lambda: last.append(prov.run()), prov.repeats)
        prov.check(last[-1])
        row = {"role": prov.role, "seconds": secs}
        if case.nbytes:
            row["GBps"] = case.nbytes / secs / 1e9
        res["providers"][name] = row
    base = res["providers"][case.baseline]["seconds"]
    for row in res["providers"].values():
        row["vs_baseline"] = base / row["seconds"]
    case.cleanup()
    return res


def find_vllm_python(explicit: str | None) -> str | None:
    candidates = [explicit] if explicit else [
        os.environ.get("UCM_VLLM_PYTHON"), sys.executable,
        os.path.join(os.path.dirname(os.path.dirname(HERE)), "vllm-venv", "bin", "python")]
    for c in candidates:
        if c and os.path.exists(c) and \
                subprocess.run([c, "-c", "import vllm"], capture_output=True).returncode == 0:
            return c
    return None


def vllm_peer(python: str | None, n_tokens: int, block_size: int) -> dict:
    if not python:
        return {"error": "no interpreter with vllm found (--vllm-python, UCM_VLLM_PYTHON)"}
    r = subprocess.run([python, os.path.abspath(__file__), "vllm-hash", str(n_tokens), "--block-size",
                        str(block_size), "--repeats", "7"], capture_output=True, text=True)
    if r.returncode:
        return {"error": r.stderr.strip()[-300:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    import platform

    p = argparse.ArgumentParser(description="Foundation ops: fast implementation vs reference, peer and ceiling, ratios of one run.",
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--vllm-python", help="interpreter with vLLM installed (default: search)")
    p.add_argument("--tokens", type=_count(BLOCK_SIZE), default=N_TOKENS,
                   help="hash_blocks: tokens hashed (default %(default)s)")
    p.add_argument("--ids", type=_count(1), default=N_IDS,
                   help="lookup_prefix: resident ids (default %(default)s)")
    p.add_argument("--copy-mib", type=_count(1), default=COPY_BYTES >> 20,
                   help="copy_segments: MiB copied (default %(default)s)")
    p.add_argument("--threads", type=_count(1), default=THREADS,
                   help="native threads of copy_segments and io_read (default %(default)s)")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    machine = f"{platform.node()} {platform.machine()} {os.cpu_count()} cores"
    print(f"# foundation benchmarks on {machine}, {time.strftime('%Y-%m-%d')}", flush=True)
    builders = {"hash_blocks": lambda: hashing_case(args.tokens, BLOCK_SIZE),
                "lookup_prefix": lambda: index_case(args.ids),
                "copy_segments": lambda: copy_case(args.copy_mib << 20, SEGMENT, args.threads),
                "checksum": lambda: checksum_case(CHECKSUM_BYTES),
                "io_read": lambda: io_read_case(IO_BYTES, IO_OP_BYTES, args.threads)}
    out = {"machine": machine, "date": time.strftime("%Y-%m-%d"),
           "backends": {op: e["selected"] for op, e in ucm.backend_info()["ops"].items()}, "ops": {}}
    for op, build in builders.items():
        try:
            res = time_case(build())
        except WrongOutput as exc:
            print(f"CORRECTNESS FAILURE, no figures reported: {exc}", file=sys.stderr)
            return 1
        out["ops"][op] = res
        base = res["baseline"]
        print(f"{op} ({', '.join(f'{k} {v}' for k, v in res['info'].items())}):", flush=True)
        for name, row in res["providers"].items():
            rate = f"  {row['GBps']:7.2f} GB/s" if "GBps" in row else ""
            print(f"  {name:24s} {row['role']:9s} {row['seconds'] * 1e3:10.3f} ms{rate}  "
                  f"{row['vs_baseline']:8.2f}x {base}", flush=True)
    v = vllm_peer(find_vllm_python(args.vllm_python), args.tokens, BLOCK_SIZE)
    hb = out["ops"]["hash_blocks"]["providers"]
    if "seconds_best" in v:
        v["numba_vs_vllm"] = v["seconds_best"] / hb["numba"]["seconds"]
        print(f"hash_blocks vs vLLM {v['vllm_version']} ({v['algo']}, {v['seconds_best'] * 1e3:.2f} ms): "
              f"numba {v['numba_vs_vllm']:.1f}x faster", flush=True)
    else:
        print(f"hash_blocks vs vLLM skipped: {v['error']}", flush=True)
    out["vllm_block_hash"] = v
    if args.json:
        write_json(args.json, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
