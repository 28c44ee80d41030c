"""What a cheaper re-selection could gain at 1 x 128K (H200 diagnostic, one run).

The ESA stride-8 step at 1 x 128K needs its re-selection (scores, head mass + selection, table)
at <= ~28.6 us for 3.5x, against ~43 us (``sparse_async_select.py``). This script measures the
two costs any redesign trades in, as CUDA graph replays (median, microseconds):

- a launch inside a graph: graphs of 1..6 back-to-back trivial kernels (132 programs each);
- a grid-wide barrier inside one launch (all programs resident, an atomic arrival counter and a
  spin on it): kernels of 32 / 128 programs passing 1, 3 or 6 barriers;
- the scoring launch on smaller tables: per-head ESA scores on G = 4 sub-block means in bf16
  (67 MB, what ships), on G = 2 in bf16 (half the bytes: what 8-bit G = 4 means would read) and on
  whole-block means (G = 1);
- the selection's parts as they run now (``select_head_mass`` with / without the table folded
  in, the table kernel).

    PYTHONPATH=. python3 benchmarks/sparse_select_costs.py [--json PATH]
"""
from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from benchmarks.gpu_diag import BS, HKV, D, graph_us as bench, header, make_case, \
    noop_kernel, write_json  # noqa: E402
from ucm.fast.triton import sparse as tri  # noqa: E402
from ucm.sparse import ops  # noqa: E402


@triton.jit
def _barrier_kernel(bar_ptr, out_ptr, ROUNDS: tl.constexpr):
    """Every program passes ROUNDS grid-wide barriers (arrival counter, spin until all arrived);
    the last program to leave resets the counters for the next launch."""
    pid = tl.program_id(0)
    n = tl.num_programs(0)
    acc = pid
    for r in tl.static_range(ROUNDS):
        tl.debug_barrier()
        tl.atomic_add(bar_ptr, 1, sem="release")
        cur = tl.atomic_add(bar_ptr, 0, sem="acquire")
        while cur < n * (r + 1):
            cur = tl.atomic_add(bar_ptr, 0, sem="acquire")
        acc += cur
    left = tl.atomic_add(bar_ptr + 1, 1, sem="acq_rel")
    if left == n - 1:
        tl.atomic_xchg(bar_ptr, 0)
        tl.atomic_xchg(bar_ptr + 1, 0)
    tl.store(out_ptr + pid, acc)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = "cuda"
    report = header(launches_us={}, barriers_us={}, parts_us={})
    x = torch.zeros(4096, dtype=torch.int32, device=dev)
    for n in range(1, 7):
        report["launches_us"][n] = us = bench(lambda: [noop_kernel[(132,)](x) for _ in range(n)])
        print(f"{n} trivial launches: {us:.2f} us", flush=True)
    bar = torch.zeros(2, dtype=torch.int32, device=dev)
    out = torch.zeros(1024, dtype=torch.int32, device=dev)
    for progs in (32, 128):
        for rounds in (0, 1, 3, 6):
            _barrier_kernel[(progs,)](bar, out, ROUNDS=rounds)
            torch.cuda.synchronize()
            want = sum(progs * (r + 1) for r in range(rounds))
            ok = bool((out[:progs] >= torch.arange(progs, device=dev) + want).all()) and \
                int(bar.abs().sum()) == 0
            us = bench(lambda: _barrier_kernel[(progs,)](bar, out, ROUNDS=rounds))
            report["barriers_us"][f"{progs}x{rounds}"] = dict(us=us, ok=ok)
            print(f"{progs} programs, {rounds} barriers: {us:.2f} us (ok {ok})", flush=True)

    tokens = 131072
    m = tokens // BS
    q, k, _, table, lens = make_case(1, tokens, seed=9)
    n_phys = k.shape[0]
    nblk = torch.tensor([m], dtype=torch.int32, device=dev)
    ids = torch.arange(n_phys, dtype=torch.int32, device=dev)
    scale = D ** -0.5
    budget_n = math.ceil(0.2 * m)
    budget = torch.tensor([budget_n], dtype=torch.int32, device=dev)
    width = ops.select_width(m, budget_n, 1, 4)
    parts = report["parts_us"]
    for g in (4, 2, 1):
        shape = (n_phys, g, HKV, D) if g > 1 else (n_phys, HKV, D)
        mean = torch.empty(shape, dtype=torch.bfloat16, device=dev)
        tri.update_block_reprs(k, ids, torch.full_like(ids, BS), mean=mean)
        parts[f"score_per_head_g{g}_bf16"] = bench(lambda: tri.score_blocks(
            q, table, nblk, kind="mean", reduce="none", mean=mean))
        if g == 4:
            per_head = tri.score_blocks(q, table, nblk, kind="mean", reduce="none", mean=mean)
        del mean
    kw = dict(scale=scale, init_window=1, local_window=4, width=width)
    parts["select_head_mass"] = bench(lambda: tri.select_head_mass(per_head, nblk, budget, **kw))
    parts["select_head_mass_with_table"] = bench(lambda: tri.select_head_mass(
        per_head, nblk, budget, block_table=table, seq_lens=lens, block_size=BS, **kw))
    sel, count = tri.select_head_mass(per_head, nblk, budget, **kw)
    parts["table"] = bench(lambda: tri.sparse_block_table(table, lens, sel, count, BS))
    for name, us in parts.items():
        print(f"{name}: {us:.1f} us", flush=True)
    # each kernel's own run time (CUPTI; no launch gaps): where the selection's time goes
    from torch.profiler import ProfilerActivity, profile

    def reselect():
        s_ = tri.score_blocks(q, table, nblk, kind="mean", reduce="none", mean=mean4)
        sel_, count_ = tri.select_head_mass(s_, nblk, budget, **kw)
        return tri.sparse_block_table(table, lens, sel_, count_, BS)
    mean4 = torch.empty(n_phys, 4, HKV, D, dtype=torch.bfloat16, device=dev)
    tri.update_block_reprs(k, ids, torch.full_like(ids, BS), mean=mean4)
    for _ in range(5):
        reselect()
    torch.cuda.synchronize()
    reps = 50
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            reselect()
        torch.cuda.synchronize()
    kernels = {}
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            kernels.setdefault(ev.name, []).append(ev.device_time if hasattr(ev, "device_time")
                                                   else ev.cuda_time)
    report["kernel_us"] = {n: dict(calls=len(v), mean=sum(v) / len(v)) for n, v in kernels.items()}
    for n, v in sorted(report["kernel_us"].items(), key=lambda kv: -kv[1]["mean"]):
        print(f"kernel {n[:60]}: {v['mean']:.2f} us x {v['calls'] / reps:.0f} per re-selection",
              flush=True)
    write_json(args.json, report)
    bad = [k_ for k_, v in report["barriers_us"].items() if not v["ok"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
