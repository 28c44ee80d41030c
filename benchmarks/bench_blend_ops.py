#!/usr/bin/env python3
"""Benchmark of the Blend ops (``ucm.blend.ops``): ``rope_rotate`` (keys moved to new
positions) and ``kv_deviation`` (the check layer's per-token distance), every output checked
against the reference before a time counts.

    pytest benchmarks/bench_blend_ops.py                      # pytest-benchmark groups
    pytest benchmarks/bench_blend_ops.py --benchmark-disable  # smoke run (CI)
    python benchmarks/bench_blend_ops.py cpu  [--tokens 4096] [--json ...]
    python benchmarks/bench_blend_ops.py cuda [--json benchmarks/results/bench_blend_h200.json]

Shape: Llama-3-8B's KV of one layer: 8 KV heads, head dim 128, bfloat16, rope theta 500000,
shifts up to +-131071 positions (a 128K context). Keys are read where a paged cache keeps them:
``rope_rotate`` on the key half of a ``[tokens, H, 2 D]`` K|V buffer (a strided view, stride
``2 D`` per head), written to a new tensor and in place; ``kv_deviation`` on four contiguous
``[tokens, H, D]`` tensors.

**pytest** (one group per op and device, one test per provider): CPU tensors, providers
``reference`` and ``numba`` (1,024 tokens); CUDA tensors, providers ``reference`` and
``triton`` (32K tokens; skipped without a GPU). Each provider's output is compared with the
reference's first; the timed call synchronizes the device.

**Script**: ``cpu``: numba against the reference, best of interleaved rounds. ``cuda``: the
Triton kernels against the reference (PyTorch on the GPU, float64) and against a device copy
of the same bytes (``copy_``, read + write), timed with CUDA events (``triton.testing.do_bench``,
median; and the kernels alone as replays of a CUDA graph, ``do_bench_cudagraph``), at 4K tokens
(a chunk: 8 MiB of keys, in L2; launch-bound) and 256K tokens (512 MiB per tensor, well past the
60 MB L2: the bandwidth figure). The Triton rows call :mod:`ucm.fast.triton.blend` directly, as
a caller holding validated inputs does (the ops' validation adds Python time, no device work).
GB/s count the bytes an op must move (inputs read once, outputs written once); the H200's HBM3e
peak is 4.8 TB/s. Any output outside the tests'
tolerance stops the script before timing, and nothing is reported.
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

torch = pytest.importorskip("torch")

from ucm.blend import ops  # noqa: E402
from _argtypes import count as _count, counts as _counts, write_json  # noqa: E402

H, D, THETA = 8, 128, 500000.0
DTYPE = torch.bfloat16
MAX_SHIFT = 131071
HBM_PEAK = 4.8e12                     # H200 HBM3e, bytes per second (datasheet)
#: (atol, rtol) as tests/test_blend_ops.py
ROPE_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-5, 2.0 ** -10),
            torch.bfloat16: (1e-5, 2.0 ** -7)}
DEVIATION_TOL = (1e-6, 3e-5)


class WrongOutput(AssertionError):
    """An implementation's output differs from the reference's: no time of it is reported."""


def inv_freq(device) -> torch.Tensor:
    return (1.0 / THETA ** (torch.arange(0, D, 2, dtype=torch.float64) / D)).float().to(device)


def make_case(tokens: int, device, seed: int = 0) -> dict:
    """Keys as the key half of a ``[tokens, H, 2 D]`` K|V buffer, shifts, and four K/V tensors."""
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).to(DTYPE)

    kv = randn(tokens, H, 2 * D)
    return {"kv": kv, "keys": kv[..., :D],
            "delta": torch.randint(-MAX_SHIFT, MAX_SHIFT + 1, (tokens,), generator=g,
                                   device=device),
            "freq": inv_freq(device),
            "dev_in": [randn(tokens, H, D) for _ in range(4)]}


def rope_bytes(tokens: int) -> int:
    """Keys read and written, shifts read."""
    return 2 * tokens * H * D * DTYPE.itemsize + tokens * 8


def deviation_bytes(tokens: int) -> int:
    """Four K/V tensors read, the float32 deviations written."""
    return 4 * tokens * H * D * DTYPE.itemsize + tokens * 4


def check_close(got, want, tol, what: str) -> None:
    atol, rtol = tol
    g, w = got.float(), want.float()
    bad = ~((g - w).abs() <= atol + rtol * w.abs())
    if got.shape != want.shape or got.dtype != want.dtype or bool(bad.any()):
        raise WrongOutput(f"{what}: {int(bad.sum())} of {want.numel()} elements outside "
                          f"atol={atol:g}, rtol={rtol:g}")


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def runs(case: dict, provider: str) -> dict:
    """The timed calls of one provider: ``{name: fn}`` (fn returns the output)."""
    keys, delta, freq, kn = case["keys"], case["delta"], case["freq"], case["dev_in"]
    out = torch.empty(keys.shape, dtype=keys.dtype, device=keys.device)
    return {
        "rope_rotate": lambda: ops.rope_rotate(keys, delta, freq, out=out, backend=provider),
        "kv_deviation": lambda: ops.kv_deviation(*kn, backend=provider),
    }


def check_provider(case: dict, provider: str, rows=None) -> None:
    """The provider's outputs against the reference's (on ``rows`` of the tokens when given:
    the reference's float64 temporaries of a large case stay small)."""
    keys, delta, freq, kn = case["keys"], case["delta"], case["freq"], case["dev_in"]
    pick = (lambda t: t) if rows is None else (lambda t: t[rows])
    got = runs(case, provider)
    want = ops.rope_rotate(pick(keys), pick(delta), freq, backend="reference")
    check_close(pick(got["rope_rotate"]()), want, ROPE_TOL[DTYPE], f"rope_rotate {provider}")
    want = ops.kv_deviation(*(pick(t) for t in kn), backend="reference")
    check_close(pick(got["kv_deviation"]()), want, DEVIATION_TOL, f"kv_deviation {provider}")


# ---------------------------------------------------------------------------------------------
# pytest-benchmark: one group per (op, device), one test per provider

PYTEST_TOKENS = {"cpu": 1024, "cuda": 32768}
PROVIDERS = [("cpu", "reference"), ("cpu", "numba"), ("cuda", "reference"), ("cuda", "triton")]


@pytest.fixture(scope="module")
def cases():
    built = {}

    def get(device):
        if device not in built:
            built[device] = make_case(PYTEST_TOKENS[device], device)
        return built[device]
    return get


@pytest.mark.parametrize("op", ["rope_rotate", "kv_deviation"])
@pytest.mark.parametrize("device,provider", PROVIDERS, ids=[f"{d}-{p}" for d, p in PROVIDERS])
def test_blend_op(benchmark, cases, op, device, provider):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if provider == "numba":
        pytest.importorskip("numba")
    if provider == "triton":
        pytest.importorskip("triton")
    case = cases(device)
    check_provider(case, provider)               # no time counts for a wrong output
    fn = runs(case, provider)[op]
    tokens = PYTEST_TOKENS[device]
    benchmark.group = f"{op}-{device}"
    nbytes = (rope_bytes if op == "rope_rotate" else deviation_bytes)(tokens)
    benchmark.extra_info.update(tokens=tokens, heads=H, head_dim=D, dtype=str(DTYPE),
                                bytes=nbytes)

    def timed():
        out = fn()
        sync(device)
        return out
    benchmark.pedantic(timed, rounds=3 if provider == "reference" else 10, warmup_rounds=1)


# ---------------------------------------------------------------------------------------------
# script


def run_cpu(args) -> int:
    import numba

    machine = f"{platform.node()} {platform.machine()} {os.cpu_count()} cores"
    print(f"# Blend ops on {machine}, {time.strftime('%Y-%m-%d')}: numba {numba.__version__}, "
          f"torch {torch.__version__} ({torch.get_num_threads()} threads); {args.tokens} tokens, "
          f"H={H} D={D} {DTYPE}; best of {args.rounds} interleaved rounds", flush=True)
    case = make_case(args.tokens, "cpu")
    try:
        check_provider(case, "numba")
    except WrongOutput as exc:
        print(f"CORRECTNESS FAILURE, no figures reported: {exc}", file=sys.stderr)
        return 1
    fns = {p: runs(case, p) for p in ("reference", "numba")}
    result = {"machine": machine, "date": time.strftime("%Y-%m-%d"), "tokens": args.tokens,
              "heads": H, "head_dim": D, "dtype": str(DTYPE), "ops": {}}
    for op, nbytes in (("rope_rotate", rope_bytes(args.tokens)),
                       ("kv_deviation", deviation_bytes(args.tokens))):
        best = {p: math.inf for p in fns}
        for p in fns:
            fns[p][op]()                                          # warm-up (numba loads)
        for _ in range(args.rounds):
            for p in fns:
                t0 = time.perf_counter()
                fns[p][op]()
                best[p] = min(best[p], time.perf_counter() - t0)
        row = {p: {"seconds": best[p], "GBps": nbytes / best[p] / 1e9} for p in fns}
        row["numba_vs_reference"] = best["reference"] / best["numba"]
        result["ops"][op] = row
        print(f"{op:13s} reference {best['reference'] * 1e3:9.2f} ms  numba "
              f"{best['numba'] * 1e3:7.3f} ms  ({row['numba']['GBps']:.2f} GB/s)  "
              f"{row['numba_vs_reference']:6.1f}x", flush=True)
    if args.json:
        write_json(args.json, result, indent=1)
    return 0


def run_cuda(args) -> int:
    import triton
    from triton.testing import do_bench, do_bench_cudagraph

    from ucm.fast.triton import blend as tb

    name = torch.cuda.get_device_name()
    print(f"# Blend ops on {name}, {time.strftime('%Y-%m-%d')}: torch {torch.__version__}, "
          f"triton {triton.__version__}; H={H} D={D} {DTYPE}; median of do_bench", flush=True)
    result = {"device": name, "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
              "triton": triton.__version__, "heads": H, "head_dim": D, "dtype": str(DTYPE),
              "cases": []}
    table = [f"{'tokens':>7s} {'what':34s} {'time':>10s} {'graph':>10s} {'GB/s':>8s} "
             f"{'of copy':>8s} {'of 4.8TB/s':>10s} {'vs ref':>8s}"]
    for tokens in args.tokens:
        case = make_case(tokens, "cuda", seed=tokens)
        rows = None if tokens <= 65536 else \
            torch.linspace(0, tokens - 1, 4099, device="cuda").long()
        try:
            check_provider(case, "triton", rows)
            # in place on the strided key view, GPT-J pairing, both checked too
            keys = case["keys"].clone()
            want = ops.rope_rotate(case["keys"] if rows is None else case["keys"][rows],
                                   case["delta"] if rows is None else case["delta"][rows],
                                   case["freq"], neox=False, backend="reference")
            tb.rope_rotate(keys, case["delta"], case["freq"], neox=False, out=keys)
            check_close(keys if rows is None else keys[rows], want, ROPE_TOL[DTYPE],
                        "rope_rotate gptj in place")
        except WrongOutput as exc:
            print(f"CORRECTNESS FAILURE, no figures reported: {exc}", file=sys.stderr)
            return 1
        k, delta, freq, kn = case["keys"], case["delta"], case["freq"], case["dev_in"]
        out = torch.empty(k.shape, dtype=k.dtype, device="cuda")
        dense = torch.empty_like(out)
        copy_src = torch.empty(tokens * H * D, dtype=DTYPE, device="cuda").normal_()
        copy_dst = torch.empty_like(copy_src)
        timed = {
            "copy_ (keys' bytes, read + write)": (lambda: copy_dst.copy_(copy_src),
                                                  rope_bytes(tokens)),
            "rope_rotate reference (float64)": (lambda: ops.rope_rotate(
                k, delta, freq, backend="reference"), rope_bytes(tokens)),
            "rope_rotate triton, strided -> new": (lambda: tb.rope_rotate(
                k, delta, freq, out=out), rope_bytes(tokens)),
            "rope_rotate triton, in place": (lambda: tb.rope_rotate(
                k, delta, freq, out=k), rope_bytes(tokens)),
            "rope_rotate triton, contiguous": (lambda: tb.rope_rotate(
                dense, delta, freq, out=dense), rope_bytes(tokens)),
            "rope_rotate triton, gptj in place": (lambda: tb.rope_rotate(
                k, delta, freq, neox=False, out=k), rope_bytes(tokens)),
            "kv_deviation reference": (lambda: ops.kv_deviation(*kn, backend="reference"),
                                       deviation_bytes(tokens)),
            "kv_deviation triton": (lambda: tb.kv_deviation(*kn), deviation_bytes(tokens)),
        }
        ms = {w: do_bench(fn, warmup=50, rep=300, return_mode="median")
              for w, (fn, _) in timed.items()}
        # the kernels without Python's launch time: replays of a CUDA graph (not the reference:
        # it copies host tensors to the device)
        graph = {w: do_bench_cudagraph(fn, rep=100, return_mode="median")
                 for w, (fn, _) in timed.items() if "reference" not in w}
        best = {w: min(ms[w], graph.get(w, math.inf)) for w in ms}
        copy_gbps = rope_bytes(tokens) / best["copy_ (keys' bytes, read + write)"] / 1e6
        entry = {"tokens": tokens, "results": {}}
        for w, (_, nbytes) in timed.items():
            gbps = nbytes / best[w] / 1e6          # GB/s from the graph replay where there is one
            ref = "rope_rotate reference (float64)" if w.startswith("rope") else \
                "kv_deviation reference" if w.startswith("kv") else None
            speedup = ms[ref] / ms[w] if ref and ref != w else None
            entry["results"][w] = {"ms": ms[w], "graph_ms": graph.get(w), "GBps": gbps,
                                   "of_copy": gbps / copy_gbps,
                                   "of_hbm_peak": gbps * 1e9 / HBM_PEAK, "vs_reference": speedup}
            g_us = f"{graph[w] * 1e3:8.1f}us" if w in graph else f"{'-':>10s}"
            table.append(f"{tokens:7d} {w:34s} {ms[w] * 1e3:8.1f}us {g_us} {gbps:8.0f} "
                         f"{gbps / copy_gbps:8.2f} {gbps * 1e9 / HBM_PEAK:10.2f} "
                         + (f"{speedup:7.1f}x" if speedup else f"{'':8s}"))
        result["cases"].append(entry)
        del case, out, dense, copy_src, copy_dst
        torch.cuda.empty_cache()
    print("\n".join(table), flush=True)
    if args.json:
        write_json(args.json, result, indent=1)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Blend ops: fast paths vs the reference.",
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("cpu", help="CPU tensors: numba against the reference")
    c.add_argument("--tokens", type=_count(1), default=4096, help="default %(default)s")
    c.add_argument("--rounds", type=_count(1), default=5,
                   help="interleaved rounds, the best reported (default %(default)s)")
    c.add_argument("--json", help="write the figures here")
    g = sub.add_parser("cuda", help="CUDA tensors: triton against the reference and a copy")
    g.add_argument("--tokens", type=_counts,
                   default=[4096, 262144], help="token counts, comma separated")
    g.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    if args.cmd == "cuda" and not torch.cuda.is_available():
        print("bench_blend_ops.py cuda: no CUDA device", file=sys.stderr)
        return 2
    return run_cpu(args) if args.cmd == "cpu" else run_cuda(args)


if __name__ == "__main__":
    sys.exit(main())
