"""GPU benchmark of the sparse-attention ops (run on a CUDA machine; H200 figures in
``benchmarks/results/sparse_h200.json`` and ``benchmarks/RESULTS.md``).

Shape: Llama-3-8B decode, one layer: 32 query heads, 8 KV heads, head dim 128, bf16, 16-token
blocks, paged cache ``[num_blocks, 16, 8, 128]`` whose blocks are handed to requests in a random
order; batch 8 x 32K tokens and batch 1 x 128K tokens; 20% of the blocks kept.

First checks the Triton ops against the reference on the GPU (fresh random inputs: attention
dense and on a selection, G = 4 bf16 sub-block tables, mean / Quest scores per head and summed,
the Triton head mass, selections, the selection with the table folded in), then times, in one
run, with CUDA events (``triton.testing.do_bench``, median; "graph": replays of one CUDA graph):

(a) dense: Triton ``paged_decode_attention`` over the full block table (graph: the best of the
    plain launch, the merge folded into the split kernel and programmatic dependent launch);
(b) SDPA: ``scaled_dot_product_attention`` on the same K/V made contiguous (fastest backend);
(c) ``copy_`` of a buffer the size of the K/V (read + write bandwidth);
(d) the sparse parts alone: scoring with ``sparse_repr_group`` 4 tables (``[num_blocks, 4, 8,
    128]`` bf16; ESA's means, Quest's min/max; per head and summed), head mass (PyTorch, Triton),
    selection, selection with the table folded in, table, attention variants;
(e) per decode step, the shipped configurations: ESA at ``retrieval_stride`` 1 and 8 and Quest
    (every step); one graph holds one scoring + selection and ``stride`` attentions, divided by
    ``stride``. Variants: "method" (what ``ucm.sparse``'s ESA computes on CUDA when every row
    re-selects: ``score_select_head_mass`` with ``seq_lens``, i.e. per-head scores, the fused
    head mass + selection writing the attention's table in its last launch, then the
    attention; before session 10 it ran the table kernel after the selection, now "method_table"),
    "method_async" (ESA with ``esa_async_retrieval``: the re-selection on a second stream beside
    the step's first attention, which reads the previous table on ``BESIDE_SHARE`` of its planned
    slices (``decode(..., beside=True)``); the new table from the next step on), "fast" (scores, then ``select_head_mass`` with the table folded in), "sum" (scores
    summed over heads in the kernel, no head mass); suffixes: "_s5" (session 5's code path: PyTorch head mass for "method", the two-launch
    Triton head mass for "fast", pairwise / single-program selection, no histogram selection,
    the unrolled scoring loop, no programmatic dependent launch), "_nodpdl" (this code without
    programmatic dependent launch on the decode launches), "_fused" (merge folded into the
    split kernel), "_pairs" (pairwise selection at any batch).
    Also the byte floor of each: dense bytes / (selected K/V + table bytes / stride).

The timed functions are the Triton implementations (``ucm.fast.triton.sparse``), as an attention
backend would call them with validated inputs; the public, validating ops (one device sync per
call) are timed once for the ESA stride-1 path.

    python benchmarks/bench_sparse.py --json benchmarks/results/sparse_h200.json [--tune] [--sweep] [--explore]
    python benchmarks/bench_sparse.py --smoke      # CPU, interpreter, tiny shapes: does it run

``--tune`` also sweeps the scoring tile, the sparse attention's launch and the selection warps;
``--sweep`` the dense decode launch. The figures use the modules' defaults.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: ``--smoke``: tiny shapes on the CPU through the Triton interpreter, every figure a single call
#: (checks that the script runs, before spending GPU time; the numbers mean nothing).
SMOKE = "--smoke" in sys.argv
#: ``--explore``: step variants (unrolled scoring, selection PDL, 4,096 bins, the head mass then
#: the selection, pairwise selection of summed scores, the log-sum-exp statistics written by the
#: scoring launch, the attention's programs per multiprocessor, stages and token tile) and sweeps
#: of the scoring and histogram selection knobs, in each shape.
EXPLORE = "--explore" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
import warnings  # noqa: E402
from triton.testing import do_bench, do_bench_cudagraph  # noqa: E402

from ucm.reference import sparse as ref  # noqa: E402
from ucm.sparse import ops  # noqa: E402
from ucm.fast.triton import sparse as tri  # noqa: E402

HQ, HKV, D, BS = 32, 8, 128, 16
DTYPE = torch.bfloat16
SHAPES = ((8, 32768), (1, 131072))
DEV = "cuda"
if SMOKE:
    HQ, HKV, D = 8, 2, 32
    SHAPES = ((2, 1024), (1, 2048))
    DEV = "cpu"
RATIO = 0.2
INIT_WINDOW, LOCAL_WINDOW = 1, 4
#: ESA's default ``retrieval_stride``: decode steps per scoring + selection.
STRIDE = 8
#: The shipped sub-block summaries: ``sparse_repr_group`` 4 -> 4 summaries of 4 tokens per
#: 16-token block, bfloat16 tables (what the methods keep for a bfloat16 cache).
GROUPS = 4
TABLE_DTYPE = torch.bfloat16
#: ESA's mean table: int8 rows with per-row float32 scales, what the methods keep for a bfloat16
#: cache on a GPU (``sparse_repr_dtype`` auto, since session 10; Quest's bounds stay
#: TABLE_DTYPE). torch.bfloat16: the tables of sessions 4-9.
MEAN_DTYPE = torch.int8


def make_case(batch: int, tokens: int, seed: int, dev: str = DEV):
    """q, k_cache, v_cache, block_table, seq_lens: every request ``tokens`` long, blocks of the
    cache handed out in a random order (plus a few spare blocks)."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    m = tokens // BS
    n_phys = batch * m + 64
    k = torch.randn(n_phys, BS, HKV, D, generator=gen, device=dev, dtype=torch.float32).to(DTYPE)
    v = torch.randn(n_phys, BS, HKV, D, generator=gen, device=dev, dtype=torch.float32).to(DTYPE)
    q = torch.randn(batch, HQ, D, generator=gen, device=dev, dtype=torch.float32).to(DTYPE)
    perm = torch.randperm(n_phys, generator=gen, device=dev)[: batch * m]
    table = perm.reshape(batch, m).to(torch.int32).contiguous()
    lens = torch.full((batch,), tokens, dtype=torch.int32, device=dev)
    return q, k, v, table, lens


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    return float((out.float() - want.float()).norm() / want.float().norm())


def selection_agreement(sel_a, count_a, sel_b, count_b) -> dict:
    """Share of the blocks of selection ``a`` that selection ``b`` also keeps (mean and worst
    row), and whether the counts agree."""
    shares = []
    for b in range(sel_a.shape[0]):
        ka = set(sel_a[b, : int(count_a[b])].tolist())
        kb = set(sel_b[b, : int(count_b[b])].tolist())
        shares.append(len(ka & kb) / len(ka))
    return dict(mean=sum(shares) / len(shares), worst=min(shares),
                counts_equal=bool(torch.equal(count_a, count_b)))


# ---------------------------------------------------------------------------------------------
# correctness (before any timing)

def close(a, b) -> float:
    """Relative max error over the finite entries (inf pattern must agree, else inf)."""
    if not torch.equal(torch.isfinite(a), torch.isfinite(b)):
        return float("inf")
    fin = torch.isfinite(b)
    return float((a[fin] - b[fin]).abs().max() / b[fin].abs().max().clamp_min(1e-30))


def check(report: dict, cases=None) -> bool:
    """Triton vs reference on the GPU, fresh random inputs: attention (dense, on a selection,
    both merges), G = 4 bf16 sub-block tables, scores (mean, Quest; per head and summed),
    head mass, selection, selection with the table folded in."""
    results = []
    ok = True
    cases = cases or [(3, 1008, "ragged small"), (8, 32768, "8 x 32K"), (1, 131072, "1 x 128K")]
    for i, (batch, tokens, name) in enumerate(cases):
        q, k, v, table, lens = make_case(batch, tokens, seed=100 + i)
        if name == "ragged small":  # ragged lengths, partial last blocks
            lens = torch.tensor([tokens - 8, 17, tokens // 2 + 1], dtype=torch.int32, device=DEV)
        scale = D ** -0.5
        r = dict(case=name, batch=batch, tokens=tokens)
        want = ops.paged_decode_attention(q.float(), k.float(), v.float(), table, lens,
                                          backend="reference")
        for merge in (False, True):
            out = torch.full_like(q, float("nan"))
            tri.decode(q, k, v, table, lens, scale, out, fused_merge=merge)
            r[f"dense_rel_err_fused_merge_{merge}"] = (rel_err(out, want)
                                                        if not torch.isnan(out).any() else 1.0)
        n_blocks = ((lens + BS - 1) // BS).int()
        ids = torch.arange(k.shape[0], device=DEV, dtype=torch.int32)
        full = torch.full_like(ids, BS)
        tabs = {}
        for backend in ("triton", "reference"):
            t = {n: torch.full((k.shape[0], GROUPS, HKV, D), float("nan"), dtype=TABLE_DTYPE,
                               device=DEV) for n in ("mean", "kmin", "kmax")}
            ops.update_block_reprs(k, ids, full, backend=backend, **t)
            tabs[backend] = t
        r["tables_max_ulps"] = max(float(((tabs["triton"][n].float() - tabs["reference"][n].float())
                                          .abs() / tabs["reference"][n].float().abs()
                                          .clamp_min(1e-30)).max() * 2 ** 7)
                                   for n in ("mean", "kmin", "kmax"))
        t = tabs["reference"]
        scores = {}
        for kind, kw in (("mean", dict(mean=t["mean"])), ("quest", dict(kmin=t["kmin"], kmax=t["kmax"]))):
            for reduce in ("none", "sum"):
                got = ops.score_blocks(q, table, n_blocks, kind=kind, reduce=reduce, backend="triton", **kw)
                ref_s = ops.score_blocks(q, table, n_blocks, kind=kind, reduce=reduce,
                                         backend="reference", **kw)
                r[f"score_{kind}_{reduce}_rel_err"] = close(got, ref_s)
                unrolled = knobs(lambda: ops.score_blocks(q, table, n_blocks, kind=kind,
                                                          reduce=reduce, backend="triton", **kw),
                                 SCORE_LOOP_STAGES=0, SCORE_PROGRAMS_PER_SM=4)()
                r[f"score_{kind}_{reduce}_unrolled_rel_err"] = close(unrolled, ref_s)
                scores[(kind, reduce)] = ref_s
        per_head = scores[("mean", "none")]
        hm_ref = torch.softmax(per_head * scale, -1).mean(1)
        hm = tri.head_mass(per_head, scale)
        r["head_mass_rel_err"] = close(hm, hm_ref)
        budget = max(1, math.ceil(RATIO * int(n_blocks.max())))
        sel_t = ops.select_blocks(hm_ref, n_blocks, budget, init_window=INIT_WINDOW,
                                  local_window=LOCAL_WINDOW, backend="triton")
        sel_r = ops.select_blocks(hm_ref, n_blocks, budget, init_window=INIT_WINDOW,
                                  local_window=LOCAL_WINDOW, backend="reference")
        r["selection_identical"] = bool(torch.equal(sel_t[0], sel_r[0]) and torch.equal(sel_t[1], sel_r[1]))
        stab, slens = ops.sparse_block_table(table, lens, *sel_r, BS, backend="reference")
        width = ops.select_width(table.shape[1], budget, INIT_WINDOW, LOCAL_WINDOW)
        folded = tri.select_sparse_table(hm_ref, n_blocks, torch.full_like(n_blocks, budget), table,
                                         lens, init_window=INIT_WINDOW, local_window=LOCAL_WINDOW,
                                         width=width, block_size=BS)
        r["select_table_identical"] = all(torch.equal(a, b) for a, b in
                                          zip(folded, (*sel_r, stab, slens)))
        sel_p = knobs(lambda: tri.select_blocks(hm_ref, n_blocks, torch.full_like(n_blocks, budget),
                                                init_window=INIT_WINDOW, local_window=LOCAL_WINDOW,
                                                width=width), **PAIRS)()
        folded_p = knobs(lambda: tri.select_sparse_table(
            hm_ref, n_blocks, torch.full_like(n_blocks, budget), table, lens,
            init_window=INIT_WINDOW, local_window=LOCAL_WINDOW, width=width, block_size=BS),
            **PAIRS)()
        # ties: the same scores rounded to 3 significant bits (many equal values)
        coarse = (hm_ref.view(torch.int32) & ~((1 << 21) - 1)).view(torch.float32)
        tie_r = ops.select_blocks(coarse, n_blocks, budget, init_window=INIT_WINDOW,
                                  local_window=LOCAL_WINDOW, backend="reference")
        tie_p = knobs(lambda: tri.select_blocks(coarse, n_blocks, torch.full_like(n_blocks, budget),
                                                init_window=INIT_WINDOW, local_window=LOCAL_WINDOW,
                                                width=width), **PAIRS)()
        r["select_pairs_identical"] = (all(torch.equal(a, b) for a, b in zip(sel_p, sel_r))
                                       and all(torch.equal(a, b) for a, b in zip(tie_p, tie_r)))
        r["select_table_pairs_identical"] = all(torch.equal(a, b) for a, b in
                                                zip(folded_p, (*sel_r, stab, slens)))
        # histogram selection: on the head mass (fused: selected exactly on the mass it wrote;
        # default knobs, every batch, the search instead of the list) and on plain scores
        bud_t = torch.full_like(n_blocks, budget)
        hist_ok = True
        for tag, extra in (("default", {}), ("hist", HIST),
                           ("hist_search", dict(HIST, SELECT_HIST_LIST=0))):
            got = knobs(lambda: tri.select_head_mass(
                per_head, n_blocks, bud_t, scale=scale, init_window=INIT_WINDOW,
                local_window=LOCAL_WINDOW, width=width, block_table=table, seq_lens=lens,
                block_size=BS, return_mass=True), **extra)()
            want = ops.select_blocks(got[-1], n_blocks, budget, init_window=INIT_WINDOW,
                                     local_window=LOCAL_WINDOW, backend="reference")
            want_t = ops.sparse_block_table(table, lens, *want, BS, backend="reference")
            same = all(torch.equal(a, b) for a, b in zip(got[:4], (*want, *want_t)))
            r[f"head_mass_select_{tag}_identical"] = same
            r[f"head_mass_select_{tag}_mass_rel_err"] = close(got[-1], hm_ref)
            hist_ok &= same and r[f"head_mass_select_{tag}_mass_rel_err"] < 1e-4
        agree = selection_agreement(sel_r[0], sel_r[1], *tri.select_head_mass(
            per_head, n_blocks, bud_t, scale=scale, init_window=INIT_WINDOW,
            local_window=LOCAL_WINDOW, width=width))
        r["head_mass_select_vs_torch_mass_agreement"] = agree["mean"]
        for tag, extra in (("hist", HIST), ("hist_search", dict(HIST, SELECT_HIST_LIST=0))):
            got = knobs(lambda: tri.select_sparse_table(
                hm_ref, n_blocks, bud_t, table, lens, init_window=INIT_WINDOW,
                local_window=LOCAL_WINDOW, width=width, block_size=BS), **extra)()
            tie_h = knobs(lambda: tri.select_blocks(
                coarse, n_blocks, bud_t, init_window=INIT_WINDOW, local_window=LOCAL_WINDOW,
                width=width), **extra)()
            same = (all(torch.equal(a, b) for a, b in zip(got, (*sel_r, stab, slens)))
                    and all(torch.equal(a, b) for a, b in zip(tie_h, tie_r)))
            r[f"select_{tag}_identical"] = same
            hist_ok &= same
        sp_want = ops.paged_decode_attention(q.float(), k.float(), v.float(), stab, slens,
                                             backend="reference")
        for merge in (False, True):
            out = torch.full_like(q, float("nan"))
            tri.decode(q, k, v, stab, slens, scale, out, fused_merge=merge)
            r[f"sparse_rel_err_fused_merge_{merge}"] = (rel_err(out, sp_want)
                                                         if not torch.isnan(out).any() else 1.0)
        r["folded_table_rel_err"] = rel_err(tri.decode_selected(q, k, v, table, lens, *sel_r,
                                                                scale=scale), sp_want)
        errs = [v for n, v in r.items() if n.endswith("rel_err") or "rel_err_" in n]
        passed = (all(e < 1e-2 for e in errs) and r["tables_max_ulps"] <= 1.0
                  and all(r[n] < 1e-5 for n in r if n.startswith("score_"))
                  and r["head_mass_rel_err"] < 1e-4 and r["selection_identical"]
                  and r["select_table_identical"] and r["select_pairs_identical"]
                  and r["select_table_pairs_identical"] and hist_ok)
        r["passed"] = passed
        ok &= passed
        results.append(r)
        print(f"check {name}: " + ", ".join(f"{n} {v:.2e}" if isinstance(v, float) else f"{n} {v}"
                                             for n, v in r.items() if n not in ("case", "batch", "tokens")),
              flush=True)
        del k, v
        empty_cache()
    report["correctness"] = results
    return ok


# ---------------------------------------------------------------------------------------------
# timing

def empty_cache():
    if not SMOKE:
        torch.cuda.empty_cache()


def bench(fn, graph: bool = False) -> float:
    """Median milliseconds."""
    if SMOKE:
        fn()
        return 1.0
    if graph:
        return float(do_bench_cudagraph(fn, rep=100, return_mode="median"))
    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def sweep(report: dict) -> dict:
    """Time the decode kernel over launch configurations; returns the fastest per shape."""
    best = {}
    rows = []
    for batch, tokens in SHAPES:
        q, k, v, table, lens = make_case(batch, tokens, seed=7)
        scale = D ** -0.5
        for block_n, warps, stages, per_sm in itertools.product((64, 128), (4, 8), (2, 3),
                                                                (1, 2, 3, 4)):
            tri.PROGRAMS_PER_SM = per_sm
            splits, _ = tri.plan(batch, HKV, table.shape[1] * BS, q.device, block_n)
            try:
                ms = bench(lambda: tri.decode(q, k, v, table, lens, scale, block_n=block_n,
                                              num_splits=splits, num_warps=warps,
                                              num_stages=stages))
            except Exception as exc:  # e.g. out of shared memory: a configuration, not a failure
                rows.append(dict(batch=batch, tokens=tokens, block_n=block_n, warps=warps,
                                 stages=stages, per_sm=per_sm, error=repr(exc)[:200]))
                continue
            rows.append(dict(batch=batch, tokens=tokens, block_n=block_n, warps=warps,
                             stages=stages, per_sm=per_sm, splits=splits, ms=ms))
            key = f"{batch}x{tokens}"
            if key not in best or ms < best[key]["ms"]:
                best[key] = rows[-1]
        del k, v
        empty_cache()
    use_config({})
    report["sweep"] = rows
    report["sweep_best"] = best
    for key, row in best.items():
        print(f"sweep best {key}: {row}", flush=True)
    return best


def sdpa_fastest(qs, kc, vc):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    found = {}
    warnings.filterwarnings("ignore", message=".*kernel not used because.*")
    warnings.filterwarnings("ignore", message=".*(runtime disabled|same num_heads).*")
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                    SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
        def fn(backend=backend):
            with sdpa_kernel([backend]):
                return torch.nn.functional.scaled_dot_product_attention(qs, kc, vc, enable_gqa=True)
        try:
            fn()
            if not SMOKE:
                torch.cuda.synchronize()
            found[backend.name] = (bench(fn), fn)
        except Exception as exc:
            found[backend.name] = (None, repr(exc)[:160])
    usable = {n: v for n, v in found.items() if v[0] is not None}
    name = min(usable, key=lambda n: usable[n][0])
    return name, usable[name][0], usable[name][1], {n: v[0] if v[0] is not None else v[1]
                                                   for n, v in found.items()}


def use_config(cfg: dict) -> None:
    """Make a launch configuration the decode kernel's default (public op and kernel agree)."""
    tri.BLOCK_N = cfg.get("block_n", DEFAULTS["block_n"])
    tri.NUM_WARPS = cfg.get("warps", DEFAULTS["warps"])
    tri.NUM_STAGES = cfg.get("stages", DEFAULTS["stages"])
    tri.PROGRAMS_PER_SM = cfg.get("per_sm", DEFAULTS["per_sm"])


SCORE_DEFAULTS = (tri.SCORE_ROWS, tri.SCORE_PROGRAMS_PER_SM)
DEFAULTS = dict(block_n=tri.BLOCK_N, warps=tri.NUM_WARPS, stages=tri.NUM_STAGES,
                per_sm=tri.PROGRAMS_PER_SM)


def knobs(fn, **values):
    """``fn`` run with module knobs of ucm.fast.triton.sparse set (restored after)."""
    def run():
        saved = {n: getattr(tri, n) for n in values}
        for n, v in values.items():
            setattr(tri, n, v)
        try:
            return fn()
        finally:
            for n, v in saved.items():
                setattr(tri, n, v)
    return run


#: The pairwise-rank selection (two launches over the whole GPU) for every row length.
PAIRS = dict(SELECT_PAIRS_MIN_BLOCKS=0, SELECT_PAIRS_MAX_ROWS=1 << 20, SELECT_HIST_MIN_BLOCKS=None)
#: Session 5's code path (no histogram selection, no fused head mass, no decode PDL).
S5 = dict(SELECT_HIST_MIN_BLOCKS=None, MASS_HIST_MIN_BLOCKS=None, DECODE_PDL=False,
          SELECT_PDL=False, SCORE_PDL=False, SCORE_LOOP_STAGES=0, SCORE_PROGRAMS_PER_SM=4)
NO_DPDL = dict(DECODE_PDL=False)
#: The histogram selection at every batch and row length (checks, explore).
HIST = dict(SELECT_HIST_MIN_BLOCKS=0, SELECT_HIST_MAX_ROWS=1 << 20, MASS_HIST_MIN_BLOCKS=0,
            MASS_HIST_MAX_ROWS=1 << 20)


PDL_ERROR = [None]


def with_pdl(fn):
    """``fn()`` with every kernel of ucm.fast.triton.sparse launched with programmatic dependent
    launch (:data:`ucm.fast.triton.sparse.PDL`); None (error kept) where this Triton or device
    cannot."""
    if SMOKE or PDL_ERROR[0]:
        return None
    tri.PDL = True
    try:
        return fn()
    except Exception as exc:  # e.g. no launch_pdl in this Triton: recorded, not fatal
        PDL_ERROR[0] = repr(exc)[:300]
        print(f"PDL unavailable: {PDL_ERROR[0]}", flush=True)
        return None
    finally:
        tri.PDL = False


def probe_pdl(report: dict) -> None:
    """Launch the sparse path once eagerly with programmatic dependent launch and compare it with
    the plain launch (outside any graph capture, so a failure cannot break a capture)."""
    if SMOKE:
        return
    q, k, v, table, lens = make_case(2, 4096, seed=5)
    nblk = ((lens + BS - 1) // BS).int()
    t = torch.empty(k.shape[0], GROUPS, HKV, D, dtype=TABLE_DTYPE, device=DEV)
    ids = torch.arange(k.shape[0], dtype=torch.int32, device=DEV)
    tri.update_block_reprs(k, ids, torch.full_like(ids, BS), mean=t)
    budget = torch.full_like(nblk, 52)

    def path():
        s = tri.score_blocks(q, table, nblk, kind="mean", reduce="none", mean=t)
        m = tri.head_mass(s, D ** -0.5)
        _, _, st, sl = tri.select_sparse_table(m, nblk, budget, table, lens, init_window=1,
                                               local_window=4, width=52, block_size=BS)
        return tri.decode(q, k, v, st, sl, D ** -0.5)
    want = path()
    got = with_pdl(lambda: (path(), torch.cuda.synchronize())[0])
    same = got is not None and bool(torch.equal(got, want))
    if got is not None and not same:
        PDL_ERROR[0] = "PDL output differs from the plain launch"
    report["pdl_probe"] = dict(available=got is not None, identical=same, error=PDL_ERROR[0])
    print(f"PDL probe: {report['pdl_probe']}", flush=True)


def time_shape(batch: int, tokens: int, cfg: dict, tune: bool = False) -> dict:
    """All timings of one shape (one process, one run): dense, SDPA, copy; the sparse parts; and
    the per-decode-step graphs of the shipped configurations."""
    q, k, v, table, lens = make_case(batch, tokens, seed=11)
    scale = D ** -0.5
    use_config(cfg)
    splits, _ = tri.plan(batch, HKV, table.shape[1] * BS, q.device)
    kv_bytes = 2 * batch * tokens * HKV * D * k.element_size()
    io_bytes = kv_bytes + 2 * q.numel() * q.element_size() + table.numel() * 4
    res = dict(batch=batch, tokens=tokens, kv_bytes_read=kv_bytes,
               decode_config=dict(block_n=tri.BLOCK_N, num_warps=tri.NUM_WARPS,
                                  num_stages=tri.NUM_STAGES, programs_per_sm=tri.PROGRAMS_PER_SM,
                                  num_splits=splits, fused_merge_default=tri.FUSED_MERGE))

    def dense_fn(merge=False):
        return lambda: tri.decode(q, k, v, table, lens, scale, fused_merge=merge)

    # (a) dense Triton (both merges: the figures' numerator is the faster one)
    dense = bench(dense_fn())
    dense_graph = bench(dense_fn(), graph=True)
    dense_graph_fused = bench(dense_fn(True), graph=True)
    dense_graph_pdl = with_pdl(lambda: bench(dense_fn(), graph=True))
    dense_graph_whole = bench(knobs(dense_fn(), REDUCE_CHUNK=None), graph=True)
    dense_graph_no_dpdl = bench(knobs(dense_fn(), DECODE_PDL=False), graph=True)
    dense_best = min(x for x in (dense_graph, dense_graph_fused, dense_graph_pdl,
                                 dense_graph_no_dpdl,
                                 dense_graph_whole) if x is not None)
    # (b) SDPA on contiguous K/V
    kc = k[table.long()].reshape(batch, tokens, HKV, D).transpose(1, 2).contiguous()
    vc = v[table.long()].reshape(batch, tokens, HKV, D).transpose(1, 2).contiguous()
    qs = q[:, :, None, :]
    sdpa_name, sdpa, sdpa_fn, sdpa_all = sdpa_fastest(qs, kc, vc)
    sdpa_err = rel_err(dense_fn()(), sdpa_fn()[:, :, 0])
    del kc, vc
    empty_cache()
    # (c) copy of the same number of bytes
    src = torch.empty(kv_bytes, dtype=torch.uint8, device=DEV).random_(0, 256)
    dst = torch.empty_like(src)
    copy = bench(lambda: dst.copy_(src))
    del src, dst
    empty_cache()

    # (d) sparse at 20%: G = 4 bf16 sub-block tables (a method keeps them incrementally)
    n_blocks = table.shape[1]
    nblk = torch.full((batch,), n_blocks, dtype=torch.int32, device=DEV)
    ids = torch.arange(k.shape[0], dtype=torch.int32, device=DEV)
    t4 = {n: torch.empty(k.shape[0], GROUPS, HKV, D, dtype=TABLE_DTYPE, device=DEV)
          for n in ("mean", "kmin", "kmax")}
    tri.update_block_reprs(k, ids, torch.full_like(ids, BS), **t4)
    esa_tables = dict(mean=t4["mean"])
    if MEAN_DTYPE == torch.int8:
        esa_tables = dict(mean=torch.empty(k.shape[0], GROUPS, HKV, D, dtype=torch.int8, device=DEV),
                          mean_scale=torch.empty(k.shape[0], GROUPS, HKV, device=DEV))
        tri.update_block_reprs(k, ids, torch.full_like(ids, BS), **esa_tables)
    mean1 = torch.empty(k.shape[0], HKV, D, dtype=TABLE_DTYPE, device=DEV)
    tri.update_block_reprs(k, ids, torch.full_like(ids, BS), mean=mean1)
    budget_n = math.ceil(RATIO * n_blocks)
    budget = torch.full((batch,), budget_n, dtype=torch.int32, device=DEV)
    width = ops.select_width(n_blocks, budget_n, INIT_WINDOW, LOCAL_WINDOW)
    kinds = {"esa": ("mean", esa_tables),
             "quest": ("quest", dict(kmin=t4["kmin"], kmax=t4["kmax"]))}

    def scorer(method, reduce="none"):
        kind, kw = kinds[method]
        return lambda: tri.score_blocks(q, table, nblk, kind=kind, reduce=reduce, **kw)

    per_head = scorer("esa")()
    summed = scorer("esa", "sum")()
    stats_buf = torch.empty(batch, HQ, 3, dtype=torch.float32, device=DEV)
    mass = tri.head_mass(per_head, scale)
    sel, count, stab, slens = tri.select_sparse_table(
        mass, nblk, budget, table, lens, init_window=INIT_WINDOW, local_window=LOCAL_WINDOW,
        width=width, block_size=BS)
    mass_torch = torch.softmax(per_head * scale, -1).mean(1)
    sel_torch = tri.select_blocks(mass_torch, nblk, budget, init_window=INIT_WINDOW,
                                  local_window=LOCAL_WINDOW, width=width)
    head_mass_agreement = selection_agreement(sel_torch[0], sel_torch[1], sel, count)
    fold_sel = knobs(lambda: tri.score_select_head_mass(
        q, table, nblk, budget, kind="mean", scale=scale, init_window=INIT_WINDOW,
        local_window=LOCAL_WINDOW, width=width, return_mass=True, **kinds["esa"][1]),
        SCORE_HEAD_STATS=True)()
    plain_sel = tri.select_head_mass(per_head, nblk, budget, scale=scale, init_window=INIT_WINDOW,
                                     local_window=LOCAL_WINDOW, width=width, return_mass=True)
    res["score_stats_fold"] = dict(
        mass_rel_err_vs_plain=rel_err(fold_sel[2], plain_sel[2]),
        selection_agreement_vs_plain=selection_agreement(plain_sel[0], plain_sel[1], fold_sel[0],
                                                         fold_sel[1]),
        selection_equals_reference_on_its_mass=bool(all(torch.equal(a, b) for a, b in zip(
            fold_sel[:2], ops.select_blocks(fold_sel[2], nblk, budget, init_window=INIT_WINDOW,
                                            local_window=LOCAL_WINDOW, backend="reference")))))
    print(f"score-stats fold ({batch} x {tokens}): {res['score_stats_fold']}", flush=True)

    parts = {
        "score_esa_g4_per_head": scorer("esa"),
        "score_esa_g4_sum": scorer("esa", "sum"),
        "score_quest_g4_per_head": scorer("quest"),
        "score_quest_g4_sum": scorer("quest", "sum"),
        "score_esa_g1_sum": lambda: tri.score_blocks(q, table, nblk, kind="mean", mean=mean1),
        "score_esa_g4_per_head_stats": lambda: tri.score_blocks(
            q, table, nblk, kind="mean", reduce="none", head_stats_scale=scale, **kinds["esa"][1]),
        "score_select_head_mass": lambda: tri.score_select_head_mass(
            q, table, nblk, budget, kind="mean", scale=scale, init_window=INIT_WINDOW,
            local_window=LOCAL_WINDOW, width=width, **kinds["esa"][1]),
        "score_select_head_mass_stats": knobs(lambda: tri.score_select_head_mass(
            q, table, nblk, budget, kind="mean", scale=scale, init_window=INIT_WINDOW,
            local_window=LOCAL_WINDOW, width=width, **kinds["esa"][1]), SCORE_HEAD_STATS=True),
        "head_mass_torch": lambda: torch.softmax(per_head * scale, -1).mean(1),
        "head_mass_triton": lambda: tri.head_mass(per_head, scale),
        "lse_bounds": lambda: tri._jit(tri._lse_bounds_kernel)[(batch * HQ,)](
            per_head, stats_buf, n_blocks, scale * tri.LOG2E,
            CHUNK=min(tri._p2(tri.LSE_CHUNK), tri._p2(n_blocks, 16)), num_warps=tri.LSE_WARPS),
        "select_head_mass": lambda: tri.select_head_mass(
            per_head, nblk, budget, scale=scale, init_window=INIT_WINDOW,
            local_window=LOCAL_WINDOW, width=width),
        "select_head_mass_with_table": lambda: tri.select_head_mass(
            per_head, nblk, budget, scale=scale, init_window=INIT_WINDOW,
            local_window=LOCAL_WINDOW, width=width, block_table=table, seq_lens=lens,
            block_size=BS),
        "select_head_mass_with_table_search": knobs(lambda: tri.select_head_mass(
            per_head, nblk, budget, scale=scale, init_window=INIT_WINDOW,
            local_window=LOCAL_WINDOW, width=width, block_table=table, seq_lens=lens,
            block_size=BS), SELECT_HIST_LIST=0),
        "select_head_mass_with_table_hist": knobs(lambda: tri.select_head_mass(
            per_head, nblk, budget, scale=scale, init_window=INIT_WINDOW,
            local_window=LOCAL_WINDOW, width=width, block_table=table, seq_lens=lens,
            block_size=BS), **HIST),
        "select_head_mass_with_table_s5": knobs(lambda: tri.select_head_mass(
            per_head, nblk, budget, scale=scale, init_window=INIT_WINDOW,
            local_window=LOCAL_WINDOW, width=width, block_table=table, seq_lens=lens,
            block_size=BS), **S5),
        "select_hist_with_table": knobs(lambda: tri.select_sparse_table(
            mass, nblk, budget, table, lens, init_window=INIT_WINDOW, local_window=LOCAL_WINDOW,
            width=width, block_size=BS), **HIST),
        "select_hist_sum_with_table_top_bits": knobs(lambda: tri.select_sparse_table(
            summed, nblk, budget, table, lens, init_window=INIT_WINDOW, local_window=LOCAL_WINDOW,
            width=width, block_size=BS), SELECT_HIST_BOUNDED=False, **HIST),
        "select_hist_sum_with_table": knobs(lambda: tri.select_sparse_table(
            summed, nblk, budget, table, lens, init_window=INIT_WINDOW, local_window=LOCAL_WINDOW,
            width=width, block_size=BS), **HIST),
        "select_sum_with_table_s5": knobs(lambda: tri.select_sparse_table(
            summed, nblk, budget, table, lens, init_window=INIT_WINDOW, local_window=LOCAL_WINDOW,
            width=width, block_size=BS), **S5),
        "select": lambda: tri.select_blocks(mass, nblk, budget, init_window=INIT_WINDOW,
                                            local_window=LOCAL_WINDOW, width=width),
        "select_with_table": lambda: tri.select_sparse_table(
            mass, nblk, budget, table, lens, init_window=INIT_WINDOW, local_window=LOCAL_WINDOW,
            width=width, block_size=BS),
        "select_single_program": knobs(lambda: tri.select_sparse_table(
            mass, nblk, budget, table, lens, init_window=INIT_WINDOW, local_window=LOCAL_WINDOW,
            width=width, block_size=BS), SELECT_PAIRS_MIN_BLOCKS=None, SELECT_HIST_MIN_BLOCKS=None),
        "select_pairs": knobs(lambda: tri.select_blocks(
            mass, nblk, budget, init_window=INIT_WINDOW, local_window=LOCAL_WINDOW, width=width),
            **PAIRS),
        "select_with_table_pairs": knobs(lambda: tri.select_sparse_table(
            mass, nblk, budget, table, lens, init_window=INIT_WINDOW, local_window=LOCAL_WINDOW,
            width=width, block_size=BS), **PAIRS),
        "table": lambda: tri.sparse_block_table(table, lens, sel, count, BS),
        "attention_table": lambda: tri.decode(q, k, v, stab, slens, scale, fused_merge=False),
        "attention_table_no_decode_pdl": knobs(lambda: tri.decode(
            q, k, v, stab, slens, scale, fused_merge=False), DECODE_PDL=False),
        "attention_table_whole_merge": knobs(lambda: tri.decode(
            q, k, v, stab, slens, scale, fused_merge=False), REDUCE_CHUNK=None),
        "attention_table_fused_merge": lambda: tri.decode(q, k, v, stab, slens, scale,
                                                          fused_merge=True),
        "attention_folded": lambda: tri.decode(q, k, v, table, lens, scale, sel=sel, count=count,
                                               fused_merge=False),
        "attention_folded_fused_merge": lambda: tri.decode(q, k, v, table, lens, scale, sel=sel,
                                                           count=count, fused_merge=True),
    }
    # per-KV-head selection (Quest's per_kv_head option): one selection row per (request, KV
    # head), tables [B, Hkv, K]; checked against the reference on one request first
    try:
        kv_mass = torch.softmax(scorer("quest")() * scale, -1).reshape(
            batch, HKV, HQ // HKV, -1).mean(2)
        kv_args = (kv_mass.reshape(batch * HKV, -1), nblk.repeat_interleave(HKV),
                   budget.repeat_interleave(HKV), table.repeat_interleave(HKV, 0),
                   lens.repeat_interleave(HKV))
        _, _, kv_t, kv_n = tri.select_sparse_table(*kv_args, init_window=INIT_WINDOW,
                                                   local_window=LOCAL_WINDOW, width=width,
                                                   block_size=BS)
        kv_t, kv_n = kv_t.reshape(batch, HKV, -1), kv_n.reshape(batch, HKV)
        kv_out = tri.decode(q, k, v, kv_t, kv_n, scale)
        kv_want = ops.paged_decode_attention(q[:1].float(), k.float(), v.float(), kv_t[:1],
                                             kv_n[:1], backend="reference")
        res["per_kv_head_attention_rel_err_row0"] = rel_err(kv_out[:1], kv_want)
        del kv_want
        parts["select_per_kv_head_with_table"] = lambda: tri.select_sparse_table(
            *kv_args, init_window=INIT_WINDOW, local_window=LOCAL_WINDOW, width=width,
            block_size=BS)
        parts["attention_per_kv_head_table"] = lambda: tri.decode(q, k, v, kv_t, kv_n, scale)
    except Exception as exc:  # an extra figure: recorded, the run goes on
        res["per_kv_head_error"] = repr(exc)[:300]
        print(f"per-KV-head part failed: {res['per_kv_head_error']}", flush=True)
    parts_graph = {}
    for name, fn in parts.items():
        try:
            parts_graph[name] = bench(fn, graph=True)
        except Exception as exc:  # a part, not the run: recorded
            parts_graph[name] = None
            res.setdefault("errors", {})[name] = repr(exc)[:300]
            print(f"{name} failed: {res['errors'][name]}", flush=True)

    def step_fn(method: str, stride: int, variant: str):
        """One graph: scoring + selection once, then ``stride`` attentions. "method": what
        ucm.sparse runs on CUDA (``score_select_head_mass``: per-head scores, the fused head
        mass + selection; with ``SCORE_HEAD_STATS`` the scoring launch also writes the
        log-sum-exp statistics; table kernel, attention with the merge launch); "fast": scores,
        then ``select_head_mass`` with the table folded into the selection; "sum": scores summed
        over heads inside the scoring kernel (no head mass), then as "fast". Suffixes, in this
        order: ``_pairs``, ``_nofold`` (scores, then ``select_head_mass``: the two calls),
        ``_fused``, ``_nodpdl``, ``_s5`` (see the module docstring)."""
        values = {}
        s5 = variant.endswith("_s5")
        for suffix, extra in (("_s5", S5), ("_nodpdl", NO_DPDL)):
            if variant.endswith(suffix):
                variant = variant[:-len(suffix)]
                values.update(extra)
        fused = variant.endswith("_fused")
        variant = variant[:-len("_fused")] if fused else variant
        nofold = variant.endswith("_nofold")
        variant = variant[:-len("_nofold")] if nofold else variant
        pairs = variant.endswith("_pairs")
        variant = variant[:-len("_pairs")] if pairs else variant
        score = scorer(method, "sum" if variant == "sum" else "none")

        def steps():
            if variant in ("method", "method_table", "method_async") and not s5 and not nofold:
                kind, kw = kinds[method]
                fold = {} if variant == "method_table" else dict(seq_lens=lens, block_size=BS)
                first = 0
                if variant == "method_async":   # beside the first attention, on a second stream
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        _, _, t, n = tri.score_select_head_mass(
                            q, table, nblk, budget, kind=kind, scale=scale,
                            init_window=INIT_WINDOW, local_window=LOCAL_WINDOW, width=width,
                            **kw, **fold)
                    o = tri.decode(q, k, v, stab, slens, scale, fused_merge=fused, beside=True)
                    torch.cuda.current_stream().wait_stream(side)
                    first = 1
                elif fold:
                    _, _, t, n = tri.score_select_head_mass(
                        q, table, nblk, budget, kind=kind, scale=scale, init_window=INIT_WINDOW,
                        local_window=LOCAL_WINDOW, width=width, **kw, **fold)
                else:
                    chosen, cnt = tri.score_select_head_mass(
                        q, table, nblk, budget, kind=kind, scale=scale, init_window=INIT_WINDOW,
                        local_window=LOCAL_WINDOW, width=width, **kw)
                    t, n = tri.sparse_block_table(table, lens, chosen, cnt, BS)
                for _ in range(stride - first):
                    o = tri.decode(q, k, v, t, n, scale, fused_merge=fused)
                return o
            s = score()
            if variant == "method" and s5:
                m = torch.softmax(s * scale, -1).mean(1)
                chosen, cnt = tri.select_blocks(m, nblk, budget, init_window=INIT_WINDOW,
                                                local_window=LOCAL_WINDOW, width=width)
                t, n = tri.sparse_block_table(table, lens, chosen, cnt, BS)
            elif variant == "method":
                chosen, cnt = tri.select_head_mass(s, nblk, budget, scale=scale,
                                                   init_window=INIT_WINDOW,
                                                   local_window=LOCAL_WINDOW, width=width)
                t, n = tri.sparse_block_table(table, lens, chosen, cnt, BS)
            elif variant == "fast" and not s5:
                chosen, cnt, t, n = tri.select_head_mass(
                    s, nblk, budget, scale=scale, init_window=INIT_WINDOW,
                    local_window=LOCAL_WINDOW, width=width, block_table=table, seq_lens=lens,
                    block_size=BS)
            else:
                m = s if variant == "sum" else tri.head_mass(s, scale)
                chosen, cnt, t, n = tri.select_sparse_table(
                    m, nblk, budget, table, lens, init_window=INIT_WINDOW,
                    local_window=LOCAL_WINDOW, width=width, block_size=BS)
            for _ in range(stride):
                o = tri.decode(q, k, v, t, n, scale, fused_merge=fused)
            return o
        if pairs:
            values.update(PAIRS)
        return knobs(steps, **values) if values else steps

    configs = [("esa", 1), ("esa", STRIDE), ("quest", 1)]
    per_step = {}
    side = torch.cuda.Stream() if DEV == "cuda" else None   # ESA's asynchronous retrieval
    for method, stride in configs:
        for variant in ("method", "method_table", "method_async", "fast", "sum", "method_s5",
                        "fast_s5", "sum_s5",
                        "method_nodpdl", "fast_nodpdl", "sum_nodpdl"):
            if variant == "method_async" and (method != "esa" or side is None):
                continue
            name = f"{method}_stride{stride}_{variant}"
            try:
                per_step[name] = bench(step_fn(method, stride, variant), graph=True) / stride
            except Exception as exc:  # a variant, not the run: recorded
                per_step[name] = None
                res.setdefault("errors", {})[name] = repr(exc)[:300]
                print(f"{name} failed: {res['errors'][name]}", flush=True)

    # the bytes each step must move at least: the selected K/V, plus the tables over the stride
    sel_kv = kv_bytes * budget_n / n_blocks
    row_bytes = {"esa": D + 4 if MEAN_DTYPE == torch.int8 else 2 * D,   # int8 + its scale
                 "quest": 2 * 2 * D}
    table_bytes = {m: batch * n_blocks * GROUPS * HKV * row_bytes[m] for m in ("esa", "quest")}
    floors = {f"{m}_stride{s}": kv_bytes / (sel_kv + table_bytes[m] / s) for m, s in configs}

    sweeps = {}
    if EXPLORE:
        for name, variant, extra in (
                ("score_unrolled", "method", dict(SCORE_LOOP_STAGES=0, SCORE_PROGRAMS_PER_SM=4)),
                ("select_pdl", "method", dict(SELECT_PDL=True)),
                ("select_pdl", "fast", dict(SELECT_PDL=True)),
                ("bits12", "method", dict(SELECT_HIST_BITS=12)),
                ("mass_then_select", "method", dict(MASS_HIST_MIN_BLOCKS=None)),
                ("pairs", "sum", dict(SELECT_HIST_MIN_BLOCKS=None)),
                ("select_pdl", "sum", dict(SELECT_PDL=True)),
                ("score_stats", "method", dict(SCORE_HEAD_STATS=True)),
                ("score_stats_group16", "method", dict(SCORE_HEAD_STATS=True,
                                                       SCORE_STATS_GROUP=16)),
                ("per_sm2", "method", dict(PROGRAMS_PER_SM=2)),
                ("stages3", "method", dict(NUM_STAGES=3)),
                ("block_n64", "method", dict(BLOCK_N=64))):
            for method, stride in ((("esa", STRIDE),) if batch > 1 else
                                   (("esa", STRIDE), ("esa", 1))):
                try:
                    sweeps[f"step_{method}_stride{stride}_{variant}_{name}"] = bench(
                        knobs(step_fn(method, stride, variant), **extra), graph=True) / stride
                except Exception as exc:  # a configuration, not the run
                    sweeps[f"step_{method}_stride{stride}_{variant}_{name}"] = None
                    res.setdefault("errors", {})[f"step_{name}"] = repr(exc)[:300]
        for name, extra in (("unrolled", dict(SCORE_LOOP_STAGES=0, SCORE_PROGRAMS_PER_SM=4)),
                            ("pipe3_persm4", dict(SCORE_PROGRAMS_PER_SM=4))):
            sweeps[f"score_esa_g4_per_head_{name}"] = bench(knobs(parts["score_esa_g4_per_head"],
                                                                  **extra), graph=True)
        hist_fn = parts["select_head_mass_with_table"]
        for name, extra in (("bits12", dict(SELECT_HIST_BITS=12)),
                            ("bits12_list64", dict(SELECT_HIST_BITS=12, SELECT_HIST_LIST=64)),
                            ("list64", dict(SELECT_HIST_LIST=64)),
                            ("span128", dict(SELECT_HIST_SPAN=128)),
                            ("warps8", dict(SELECT_HIST_WARPS=8)),
                            ("search", dict(SELECT_HIST_LIST=0)),
                            ("select_pdl", dict(SELECT_PDL=True))):
            try:
                sweeps[f"select_head_mass_with_table_{name}"] = bench(knobs(hist_fn, **extra),
                                                                      graph=True)
            except Exception as exc:  # a configuration, not the run
                sweeps[f"select_head_mass_with_table_{name}"] = None
                res.setdefault("errors", {})[f"sweep_{name}"] = repr(exc)[:300]
    if tune:
        for rows, per_sm, warps in itertools.product((32, 64, 128), (1, 2, 4, 8), (4, 8)):
            tri.SCORE_ROWS, tri.SCORE_PROGRAMS_PER_SM, tri.SCORE_WARPS = rows, per_sm, warps
            for m in ("esa", "quest"):
                sweeps[f"score_{m}_rows{rows}_persm{per_sm}_warps{warps}"] = bench(scorer(m), graph=True)
        tri.SCORE_ROWS, tri.SCORE_PROGRAMS_PER_SM = SCORE_DEFAULTS
        tri.SCORE_WARPS = 4
        for block_n, per_sm, merge in itertools.product((64, 128), (1, 2, 3, 4, 6), (False, True)):
            tri.BLOCK_N, tri.PROGRAMS_PER_SM = block_n, per_sm
            sweeps[f"attention_block_n{block_n}_per_sm{per_sm}_fused{int(merge)}"] = bench(
                lambda: tri.decode(q, k, v, stab, slens, scale, fused_merge=merge), graph=True)
            sweeps[f"dense_block_n{block_n}_per_sm{per_sm}_fused{int(merge)}"] = bench(
                lambda: tri.decode(q, k, v, table, lens, scale, fused_merge=merge), graph=True)
        use_config({})
        for block_n, warps, stages in itertools.product((64, 128), (4, 8), (2, 3, 4)):
            sweeps[f"attention_block_n{block_n}_warps{warps}_stages{stages}_fused1"] = bench(
                lambda: tri.decode(q, k, v, stab, slens, scale, fused_merge=True, block_n=block_n,
                                   num_warps=warps, num_stages=stages), graph=True)
        for warps in (4, 8, 16):
            tri.SELECT_WARPS = warps
            sweeps[f"select_warps{warps}"] = bench(parts["select"], graph=True)
        tri.SELECT_WARPS = None

    def sparse_public():
        s = ops.score_blocks(q, table, nblk, kind="mean", reduce="none", **esa_tables)
        chosen, cnt = ops.select_blocks(torch.softmax(s * scale, -1).mean(1), nblk, budget_n,
                                        init_window=INIT_WINDOW, local_window=LOCAL_WINDOW)
        t, n = ops.sparse_block_table(table, lens, chosen, cnt, BS)
        return ops.paged_decode_attention(q, k, v, t, n)

    public = bench(sparse_public)
    copy_bw = 2 * kv_bytes / (copy * 1e-3)
    attn_bw = io_bytes / (dense * 1e-3)
    res.update(
        pdl_error=PDL_ERROR[0],
        ms=dict(dense=dense, dense_graph=dense_graph, dense_graph_fused_merge=dense_graph_fused,
                dense_graph_whole_merge=dense_graph_whole,
                dense_graph_pdl=dense_graph_pdl, dense_graph_no_decode_pdl=dense_graph_no_dpdl,
                dense_best=dense_best,
                sdpa=sdpa, copy=copy, sparse_public_ops_esa_stride1=public,
                sparse_parts_graph=parts_graph, sparse_per_step_graph=per_step),
        sweeps_graph_ms=sweeps, stride=STRIDE, groups=GROUPS, table_dtype=str(TABLE_DTYPE),
        esa_mean_dtype=str(MEAN_DTYPE),
        head_mass_triton_vs_torch_selection_agreement=head_mass_agreement,
        sdpa_backend=sdpa_name, sdpa_backends_ms=sdpa_all, dense_vs_sdpa_rel_err=sdpa_err,
        sparse_budget_blocks=budget_n, sparse_blocks=n_blocks,
        bandwidth_GBps=dict(dense_attention=attn_bw / 1e9, copy_read_plus_write=copy_bw / 1e9),
        byte_floor_ratios=floors,
        ratios=dict(dense_over_sdpa=dense / sdpa,
                    bandwidth_over_copy=attn_bw / copy_bw,
                    dense_over_sparse_public_ops_esa_stride1=dense / public,
                    **{f"dense_over_{name}": dense_best / ms for name, ms in per_step.items()
                       if ms}),
    )
    use_config({})
    del k, v
    empty_cache()
    return res


def kernel_resources() -> dict:
    """Registers, spills and shared memory of every compiled kernel of the module (from Triton's
    per-device caches; empty where this Triton keeps them elsewhere)."""
    out = {}
    for (name, interp), fn in tri._jitted.items():
        try:
            for entry in getattr(fn, "device_caches", {}).values():
                cache = entry[0] if isinstance(entry, tuple) else entry
                for k in cache.values():
                    meta = getattr(k, "metadata", None)
                    out.setdefault(name, []).append(dict(
                        regs=getattr(k, "n_regs", None), spills=getattr(k, "n_spills", None),
                        shared=getattr(meta, "shared", None), warps=getattr(meta, "num_warps", None)))
        except Exception as exc:  # a diagnostic, not the run
            out[name] = repr(exc)[:200]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run through the interpreter")
    ap.add_argument("--sweep", action="store_true", help="tune the decode launch first")
    ap.add_argument("--explore", action="store_true",
                    help="short sweep of the pairwise selection and the split count")
    ap.add_argument("--tune", action="store_true",
                    help="also sweep the scoring tile, the sparse attention launch and the selection warps")
    args = ap.parse_args()
    if SMOKE:
        report = dict(smoke=True, date=datetime.datetime.now(datetime.timezone.utc).isoformat())
        ok = check(report, [(3, 200, "ragged small"), (1, 1024, "smoke")])
        report["timings"] = [time_shape(b, t, {}, tune=args.tune) for b, t in SHAPES]
        print("smoke run: correctness", ok)
        return 0 if ok else 1
    if not torch.cuda.is_available():
        print("bench_sparse: needs a CUDA device", file=sys.stderr)
        return 2
    report = dict(machine=dict(gpu=torch.cuda.get_device_name(), host=platform.node(),
                               torch=torch.__version__, triton=triton.__version__,
                               sms=torch.cuda.get_device_properties(0).multi_processor_count),
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  shape=dict(q_heads=HQ, kv_heads=HKV, head_dim=D, block_size=BS, dtype=str(DTYPE),
                             sparse_ratio=RATIO, init_window=INIT_WINDOW, local_window=LOCAL_WINDOW,
                             repr_groups=GROUPS, table_dtype=str(TABLE_DTYPE),
                             esa_mean_dtype=str(MEAN_DTYPE)),
                  command=" ".join(sys.argv))
    t0 = time.time()
    if not check(report):
        print("correctness check FAILED: no timings", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
        return 1
    if args.sweep:
        sweep(report)
    probe_pdl(report)
    report["timings"] = []
    for batch, tokens in SHAPES:
        r = time_shape(batch, tokens, {}, tune=args.tune)
        report["timings"].append(r)
        print(f"timed {batch}x{tokens}", flush=True)
    report["seconds"] = time.time() - t0
    report["kernel_resources"] = kernel_resources()
    for name in ("_hist_pick_kernel", "_lse_bounds_kernel", "_score_dot_kernel",
                 "_score_dot_pipe_kernel", "_decode_split_kernel"):
        print(f"resources {name}: {report['kernel_resources'].get(name)}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    print("\nper decode step, graph replays: dense (best merge) / sparse at 20%, G = 4 bf16 tables; "
          "byte floor = dense bytes / (selected K/V + tables / stride)")
    for r in report["timings"]:
        dense_best = r["ms"]["dense_best"]
        pdl = r["ms"]["dense_graph_pdl"]
        print(f"{r['batch']}x{r['tokens']}: dense {dense_best * 1e3:.1f} us (graph; split+merge "
              f"{r['ms']['dense_graph'] * 1e3:.1f}, fused merge "
              f"{r['ms']['dense_graph_fused_merge'] * 1e3:.1f}, pdl "
              f"{pdl * 1e3 if pdl else float('nan'):.1f}, no decode pdl "
              f"{r['ms']['dense_graph_no_decode_pdl'] * 1e3:.1f}); SDPA {r['ms']['sdpa'] * 1e3:.1f} us "
              f"({r['sdpa_backend']}); BW/copy {r['ratios']['bandwidth_over_copy']:.3f}")
        for name, ms in r["ms"]["sparse_per_step_graph"].items():
            floor = r["byte_floor_ratios"]["_".join(name.split("_")[:2])]
            if ms is None:
                continue
            print(f"   {name:28s} {dense_best / ms:5.2f}x ({ms * 1e3:6.1f} us; byte floor {floor:.2f}x)")
        print("   parts (graph, us): " + ", ".join(f"{n} {v * 1e3:.1f}"
                                                  for n, v in r["ms"]["sparse_parts_graph"].items()
                                                  if v is not None))
        if r["sweeps_graph_ms"]:
            print("   sweeps (us): " + ", ".join(f"{n} {v * 1e3:.1f}"
                                                 for n, v in r["sweeps_graph_ms"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
