"""Where the sparse decode attention's time goes at batch 1 (H200 diagnostic, one run).

The sparse attention over 20% of a 1 x 128K request takes ~0.27x of the dense time instead of
0.20x (``benchmarks/RESULTS.md``). This script times, as CUDA graph replays (median), the Triton
decode (``ucm.fast.triton.sparse.decode``) on tables of the same request keeping 2.5% ... 100%
of its blocks, and fits ``time = fixed + bytes / bandwidth`` over them; it also times the split
kernel alone (merge launch replaced by nothing), the merge launch alone, an empty graph of two
trivial kernels (launch cost inside a graph), and the 20% table with physically consecutive
blocks instead of scattered ones. First checks the 20% attention against the reference.

    PYTHONPATH=. python3 benchmarks/sparse_diag_attention.py [--json PATH]
"""
from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402

from benchmarks.gpu_diag import BS, HKV, HQ, D, graph_us as bench, header, make_case, \
    noop_kernel, write_json  # noqa: E402
from ucm.fast.triton import sparse as tri  # noqa: E402
from ucm.sparse import ops  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(3)
    tokens = 131072
    m = tokens // BS
    q, k, v, table, lens = make_case(1, tokens, seed=3)
    scale = D ** -0.5
    report = header()

    def sparse_table(frac: float, consecutive: bool = False):
        keep = max(2, math.ceil(frac * m))
        pick = torch.sort(torch.randperm(m - 1, generator=gen, device=dev)[:keep - 1]).values
        sel = torch.cat([pick, torch.tensor([m - 1], device=dev)]).to(torch.int32)
        t = (torch.arange(keep, device=dev, dtype=torch.int32) if consecutive
             else table[0, sel.long()])[None].contiguous()
        n = torch.tensor([(keep - 1) * BS + BS], dtype=torch.int32, device=dev)
        return t, n

    t20, n20 = sparse_table(0.2)
    want = ops.paged_decode_attention(q.float(), k.float(), v.float(), t20, n20,
                                      backend="reference")
    got = tri.decode(q, k, v, t20, n20, scale)
    err = float((got.float() - want).norm() / want.norm())
    report["check_rel_err_20pct"] = err
    print(f"check 20%: rel err {err:.2e}", flush=True)
    if not err < 1e-2:
        return 1

    rows = []
    for frac in (0.025, 0.05, 0.1, 0.2, 0.4, 0.7, 1.0):
        t, n = (table, lens) if frac == 1.0 else sparse_table(frac)
        us = bench(lambda: tri.decode(q, k, v, t, n, scale))
        kv = 2 * int(n) * HKV * D * 2
        rows.append(dict(frac=frac, tokens=int(n), kv_bytes=kv, us=us,
                         splits=tri.plan(1, HKV, t.shape[1] * BS, q.device)[0]))
        print(f"{frac:6.3f}: {int(n):7d} tokens {us:7.1f} us ({kv / us / 1e6:.2f} TB/s)", flush=True)
    xs = torch.tensor([r["kv_bytes"] for r in rows], dtype=torch.float64)
    ys = torch.tensor([r["us"] for r in rows], dtype=torch.float64)
    A = torch.stack([torch.ones_like(xs), xs], 1)
    fixed, per_byte = torch.linalg.lstsq(A, ys[:, None]).solution[:, 0].tolist()
    report["fit"] = dict(fixed_us=fixed, bandwidth_TBps=1 / per_byte / 1e6)
    print(f"fit: time = {fixed:.1f} us + bytes / {1 / per_byte / 1e6:.2f} TB/s", flush=True)
    report["by_fraction"] = rows

    parts = {}
    parts["decode_20pct"] = bench(lambda: tri.decode(q, k, v, t20, n20, scale))
    tc, nc = sparse_table(0.2, consecutive=True)
    parts["decode_20pct_consecutive_blocks"] = bench(lambda: tri.decode(q, k, v, tc, nc, scale))
    # split kernel alone: the merge launch replaced by nothing
    real_jit = tri._jit

    class _Skip:
        def __getitem__(self, grid):
            return lambda *a, **kw: None

    def split_only():
        tri._jit = lambda fn: _Skip() if fn is tri._decode_reduce_kernel else real_jit(fn)
        try:
            return tri.decode(q, k, v, t20, n20, scale)
        finally:
            tri._jit = real_jit
    parts["split_kernel_only_20pct"] = bench(split_only)
    splits, _ = tri.plan(1, HKV, t20.shape[1] * BS, q.device)
    opart = torch.randn(1, HQ, splits, D, device=dev)
    lse = torch.randn(1, HQ, splits, device=dev)
    out = torch.empty(1, HQ, D, dtype=q.dtype, device=dev)
    parts["merge_kernel_only"] = bench(lambda: real_jit(tri._decode_reduce_kernel)[(HQ, 1)](
        opart, lse, out, *out.stride(), splits, HQ=HQ, D=D, DPAD=D,
        SPAD=triton.next_power_of_2(splits), num_warps=4))
    x = torch.zeros(1024, dtype=torch.int32, device=dev)
    parts["two_noop_kernels"] = bench(lambda: (noop_kernel[(132,)](x), noop_kernel[(132,)](x)))
    parts["one_noop_kernel"] = bench(lambda: noop_kernel[(132,)](x))
    report["parts_us"] = parts
    for name, us in parts.items():
        print(f"{name}: {us:.1f} us", flush=True)
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
