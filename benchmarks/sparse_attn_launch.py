"""Launch shapes of the sparse decode attention at 20% of the blocks (H200 diagnostic, one run).

The attention on a sparse table is ~86% of an ESA stride-8 step at 1 x 128K and runs ~7 us over
its bytes at the dense rate (``benchmarks/RESULTS.md``). This script times, as CUDA graph replays
(median, microseconds), the Triton decode (``ucm.fast.triton.sparse.decode``) on a random 20%
table of the Llama-3-8B shape over a grid of launch shapes: slices of whole token tiles or whole
KV blocks (``SPLIT_GRAIN``), the number of slices, the token tile, warps, and V loaded with K
(``V_EARLY``); and two ceilings of the same bytes: a gather kernel that only reads the selected
K/V with the same grid (no attention math) and a contiguous read of as many bytes. Each launch
shape is first checked against the reference.

    PYTHONPATH=. python3 benchmarks/sparse_attn_launch.py [--json PATH] [--quick]
"""
from __future__ import annotations

import argparse
import itertools
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from benchmarks.gpu_diag import BS, HKV, D, graph_us as bench, header, make_case, \
    write_json  # noqa: E402
from ucm.fast.triton import sparse as tri  # noqa: E402
from ucm.sparse import ops  # noqa: E402


@triton.jit
def _gather_read_kernel(k_ptr, v_ptr, table_ptr, out_ptr, n_tokens, split_tokens,
                        sk_n, sk_t, sk_h, HKV: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                        TILE: tl.constexpr):
    """Reads the K and V rows of KV head ``program_id(0)`` for one slice of the table's tokens
    (the attention's loads, no arithmetic but a sum): the bytes' floor for this grid."""
    g = tl.program_id(0)
    start = tl.program_id(1) * split_tokens
    end = tl.minimum(start + split_tokens, n_tokens)
    cols = tl.arange(0, TILE)
    d = tl.arange(0, D)
    acc = tl.zeros([TILE, D], tl.float32)
    for t0 in range(start, end, TILE):
        t = t0 + cols
        m = t < end
        phys = tl.load(table_ptr + t // BS, mask=m, other=0).to(tl.int64)
        off = phys[:, None] * sk_n + (t % BS)[:, None] * sk_t + g * sk_h + d[None, :]
        acc += tl.load(k_ptr + off, mask=m[:, None], other=0.0).to(tl.float32)
        acc += tl.load(v_ptr + off, mask=m[:, None], other=0.0).to(tl.float32)
    tl.store(out_ptr + g * tl.num_programs(1) + tl.program_id(1), tl.sum(tl.sum(acc, 1), 0))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true", help="a few shapes only")
    args = ap.parse_args()
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(3)
    report = header(rows=[], ceilings={})
    scale = D ** -0.5
    for batch, tokens in ((1, 131072), (8, 32768)):
        m = tokens // BS
        q, k, v, table, lens = make_case(batch, tokens, seed=3)
        keep = math.ceil(0.2 * m)
        rows_t = []
        for b in range(batch):
            pick = torch.sort(torch.randperm(m - 1, generator=gen, device=dev)[:keep - 1]).values
            sel = torch.cat([pick, torch.tensor([m - 1], device=dev)])
            rows_t.append(table[b, sel])
        t20 = torch.stack(rows_t).to(torch.int32).contiguous()
        n20 = torch.full((batch,), keep * BS, dtype=torch.int32, device=dev)
        shape = f"{batch}x{tokens}"
        kv_bytes = 2 * batch * keep * BS * HKV * D * 2
        want = ops.paged_decode_attention(q.float(), k.float(), v.float(), t20, n20,
                                          backend="reference")
        dense_us = bench(lambda: tri.decode(q, k, v, table, lens, scale))
        report["ceilings"][shape] = ceil = {"dense_us": dense_us, "kv_bytes_20pct": kv_bytes}
        default_us = bench(lambda: tri.decode(q, k, v, t20, n20, scale))
        ceil["default_us"] = default_us
        flat = torch.empty(kv_bytes // 2, dtype=torch.bfloat16, device=dev).normal_()
        ceil["contiguous_sum_us"] = bench(lambda: flat.sum())
        del flat
        if batch == 1:
            out = torch.empty(HKV * 512, dtype=torch.float32, device=dev)
            for splits in (33, 41, 49, 66, 99):
                st = math.ceil(keep * BS / splits / BS) * BS
                ns = math.ceil(keep * BS / st)
                us = bench(lambda: _gather_read_kernel[(HKV, ns)](
                    k, v, t20, out, keep * BS, st, *k.stride()[:3], HKV=HKV, D=D, BS=BS,
                    TILE=128, num_warps=4))
                ceil[f"gather_read_{splits}_splits_us"] = us
        print(f"{shape}: dense {dense_us:.1f} us, 20% default {default_us:.1f} us "
              f"({dense_us / default_us:.2f}x), ceilings {ceil}", flush=True)
        if args.quick:
            grid = itertools.product(("tile", "block"), (None,), (128,), (4,), (False, True))
        else:
            grid = itertools.product(("tile", "block"), (None, 33, 41, 49, 66),
                                     (64, 128), (4, 8), (False, True))
        for grain, splits, tile, warps, v_early in grid:
            if batch > 1 and splits is not None:
                continue
            tri.SPLIT_GRAIN = grain
            try:
                fn = lambda: tri.decode(q, k, v, t20, n20, scale, block_n=tile,  # noqa: E731
                                        num_splits=splits, num_warps=warps, v_early=v_early)
                got = fn()
                err = float((got.float() - want).norm() / want.norm())
                us = bench(fn) if err < 1e-2 else None
                ns = tri._split_len(keep * BS, splits, tile, BS) if splits else tri.plan(
                    batch, HKV, keep * BS, q.device, tile, BS)
                row = dict(shape=shape, grain=grain, splits_asked=splits, num_splits=ns[0],
                           split_tokens=ns[1], tile=tile, warps=warps, v_early=v_early,
                           rel_err=err, us=us)
            except Exception as exc:  # a launch shape that does not fit: recorded
                row = dict(shape=shape, grain=grain, splits_asked=splits, tile=tile,
                           warps=warps, v_early=v_early, error=repr(exc)[:200])
            finally:
                tri.SPLIT_GRAIN = "tile"
            report["rows"].append(row)
            print(row, flush=True)
        del k, v
        torch.cuda.empty_cache()
    ok = [r for r in report["rows"] if r.get("us")]
    for shape in report["ceilings"]:
        best = sorted((r for r in ok if r["shape"] == shape), key=lambda r: r["us"])[:6]
        print(f"best {shape}: " + "; ".join(
            f"{r['grain']} s={r['num_splits']}x{r['split_tokens']} t={r['tile']} w={r['warps']} "
            f"ve={int(r['v_early'])}: {r['us']:.1f}" for r in best), flush=True)
    bad = [r for r in report["rows"] if "error" in r or (r.get("rel_err") or 0) >= 1e-2]
    write_json(args.json, report)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
