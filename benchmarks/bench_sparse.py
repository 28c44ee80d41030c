"""GPU benchmark of the sparse-attention ops (run on a CUDA machine; H200 figures in
``benchmarks/results/sparse_h200.json``).

Shape: Llama-3-8B decode, one layer: 32 query heads, 8 KV heads, head dim 128, bf16, 16-token
blocks, paged cache ``[num_blocks, 16, 8, 128]`` whose blocks are handed to requests in a random
order; batch 8 x 32K tokens and batch 1 x 128K tokens.

First checks the Triton ops against the reference on the GPU (fresh random inputs, relative
error of attention, equality of selections), then times, in one run, with
``triton.testing.do_bench`` (CUDA events, median):

(a) dense: Triton ``paged_decode_attention`` over the full block table;
(b) SDPA: ``torch.nn.functional.scaled_dot_product_attention`` on the same K/V already made
    contiguous ``[B, Hkv, N, D]`` (GQA through ``enable_gqa``), every backend tried, the fastest
    kept (its name is reported); the time of making the K/V contiguous is excluded;
(c) the ceiling: ``copy_`` of a device buffer the size of the K/V read by (a); bandwidth counts
    bytes read + written;
(d) sparse at 20% of blocks: ``score_blocks(kind="mean")`` + ``select_blocks`` +
    ``sparse_block_table`` + attention over the selected blocks, each part timed alone too. The
    block means are computed beforehand (a method keeps them incrementally). The sparse path is
    timed as launched eagerly and as one CUDA graph replay (what a decode step under CUDA graphs
    pays; eager launches of five small kernels cost more host time than the GPU work here).

(e) per decode step as the methods run it: ESA re-selects every ``retrieval_stride`` = 8 steps,
    so one CUDA graph holds one scoring + selection then 8 x (sparse table + attention), its
    replay time divided by 8 (stride 1: the whole path every step). Also with bfloat16 block
    means (and their selection's agreement with the float32 one) and with the sparse table
    folded into the attention kernel (``decode_selected``).

The timed functions are the Triton implementations behind the ops (``ucm.fast.triton.sparse``),
as an attention backend calls them with validated inputs; the public ops (validation: one device
sync per call) are timed once more for the whole sparse path. Ratios: dense/SDPA time (eager,
both one launch), attention bandwidth (bytes of K, V, q, out and table read or written over the
dense time) / copy bandwidth (bytes read + written), dense/sparse time (graph replays).

    python benchmarks/bench_sparse.py --json benchmarks/results/sparse_h200.json [--sweep]

``--sweep`` also times the decode kernel over launch configurations (token tile, warps, stages,
programs per multiprocessor; dense and on the sparse table) and the selection kernel's warps;
the figures themselves always use the modules' defaults (what the public ops run).
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
RATIO = 0.2
INIT_WINDOW, LOCAL_WINDOW = 1, 4
#: ESA's default ``retrieval_stride``: decode steps per scoring + selection.
STRIDE = 8


def make_case(batch: int, tokens: int, seed: int, dev: str = "cuda"):
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

def check(report: dict) -> bool:
    results = []
    ok = True
    cases = [(3, 1008, "ragged small"), (8, 32768, "8 x 32K"), (1, 131072, "1 x 128K")]
    for i, (batch, tokens, name) in enumerate(cases):
        q, k, v, table, lens = make_case(batch, tokens, seed=100 + i)
        if name == "ragged small":  # ragged lengths, partial last blocks
            lens = torch.tensor([1000, 17, 513], dtype=torch.int32, device="cuda")
        scale = D ** -0.5
        out = torch.full_like(q, float("nan"))
        ops.paged_decode_attention(q, k, v, table, lens, out=out, backend="triton")
        want = ops.paged_decode_attention(q.float(), k.float(), v.float(), table, lens,
                                          backend="reference")
        err = rel_err(out, want)
        n_blocks = (lens + BS - 1) // BS
        mean = torch.empty(k.shape[0], HKV, D, dtype=torch.float32, device="cuda")
        ids = torch.arange(k.shape[0], device="cuda", dtype=torch.int32)
        full = torch.full_like(ids, BS)
        ops.update_block_reprs(k, ids, full, mean=mean, backend="triton")
        mean_ref = torch.empty_like(mean)
        ops.update_block_reprs(k, ids, full, mean=mean_ref, backend="reference")
        mean_err = float((mean - mean_ref).abs().max())
        s_tri = ops.score_blocks(q, table, n_blocks.int(), kind="mean", mean=mean, backend="triton")
        s_ref = ops.score_blocks(q, table, n_blocks.int(), kind="mean", mean=mean, backend="reference")
        fin = torch.isfinite(s_ref)
        score_err = float((s_tri[fin] - s_ref[fin]).abs().max() / s_ref[fin].abs().max())
        budget = max(1, math.ceil(RATIO * int(n_blocks.max())))
        sel_t = ops.select_blocks(s_ref, n_blocks.int(), budget, init_window=INIT_WINDOW,
                                  local_window=LOCAL_WINDOW, backend="triton")
        sel_r = ops.select_blocks(s_ref, n_blocks.int(), budget, init_window=INIT_WINDOW,
                                  local_window=LOCAL_WINDOW, backend="reference")
        same_sel = bool(torch.equal(sel_t[0], sel_r[0]) and torch.equal(sel_t[1], sel_r[1]))
        stab, slens = ops.sparse_block_table(table, lens, *sel_r, BS)
        sp = ops.paged_decode_attention(q, k, v, stab, slens, backend="triton")
        sp_want = ops.paged_decode_attention(q.float(), k.float(), v.float(), stab, slens,
                                             backend="reference")
        sp_err = rel_err(sp, sp_want)
        fused = tri.decode_selected(q, k, v, table, lens, *sel_r, scale=scale)
        fused_err = rel_err(fused, sp_want)
        # bfloat16 block means: Triton tables and scores against the reference's
        m16 = torch.full_like(mean, float("nan"), dtype=torch.bfloat16)
        ops.update_block_reprs(k, ids, full, mean=m16, backend="triton")
        m16_ref = torch.empty_like(m16)
        ops.update_block_reprs(k, ids, full, mean=m16_ref, backend="reference")
        m16_ulps = float(((m16.float() - m16_ref.float()).abs()
                          / m16_ref.float().abs().clamp_min(1e-30)).max() * 2 ** 7)
        s16 = ops.score_blocks(q, table, n_blocks.int(), kind="mean", mean=m16, backend="triton")
        s16_ref = ops.score_blocks(q, table, n_blocks.int(), kind="mean", mean=m16_ref,
                                   backend="reference")
        score16_err = float((s16[fin] - s16_ref[fin]).abs().max() / s16_ref[fin].abs().max())
        passed = (err < 1e-2 and not torch.isnan(out).any() and mean_err < 1e-5
                  and score_err < 1e-5 and same_sel and sp_err < 1e-2 and fused_err < 1e-2
                  and m16_ulps <= 1.0 and score16_err < 1e-2)
        ok &= passed
        results.append(dict(case=name, batch=batch, tokens=tokens, dense_rel_err=err,
                            sparse_rel_err=sp_err, fused_table_rel_err=fused_err,
                            mean_max_abs_err=mean_err, score_rel_err=score_err,
                            bf16_mean_max_ulps_vs_reference=m16_ulps,
                            bf16_score_rel_err=score16_err,
                            selection_identical=same_sel, passed=passed))
        print(f"check {name}: attention rel err {err:.2e}, sparse {sp_err:.2e}, fused table "
              f"{fused_err:.2e}, mean {mean_err:.1e}, scores {score_err:.1e}, bf16 means "
              f"{m16_ulps:.2f} ulp / scores {score16_err:.1e}, selection identical {same_sel} "
              f"-> {'ok' if passed else 'FAIL'}", flush=True)
        del k, v
        torch.cuda.empty_cache()
    report["correctness"] = results
    return ok


# ---------------------------------------------------------------------------------------------
# timing

def bench(fn, graph: bool = False) -> float:
    """Median milliseconds."""
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
        torch.cuda.empty_cache()
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


SELECT_DEFAULTS = (tri.SELECT_RADIX, tri.SELECT_KERNEL_MAX_BLOCKS)
SCORE_DEFAULTS = (tri.SCORE_TILE_ELEMS, tri.SCORE_WARPS)
DEFAULTS = dict(block_n=tri.BLOCK_N, warps=tri.NUM_WARPS, stages=tri.NUM_STAGES,
                per_sm=tri.PROGRAMS_PER_SM)


def time_shape(batch: int, tokens: int, cfg: dict, tune: bool = False) -> dict:
    q, k, v, table, lens = make_case(batch, tokens, seed=11)
    scale = D ** -0.5
    use_config(cfg)
    splits, _ = tri.plan(batch, HKV, table.shape[1] * BS, q.device)
    kv_bytes = 2 * batch * tokens * HKV * D * k.element_size()
    io_bytes = kv_bytes + 2 * q.numel() * q.element_size() + table.numel() * 4
    res = dict(batch=batch, tokens=tokens, kv_bytes_read=kv_bytes,
               decode_config=dict(block_n=tri.BLOCK_N, num_warps=tri.NUM_WARPS,
                                  num_stages=tri.NUM_STAGES, programs_per_sm=tri.PROGRAMS_PER_SM,
                                  num_splits=splits,
                                  is_default=all(cfg.get(k, v) == v for k, v in DEFAULTS.items())))

    def dense_fn():
        return tri.paged_decode_attention(q, k, v, table, lens, scale=scale)

    # (a) dense Triton
    dense = bench(dense_fn)
    dense_graph = bench(dense_fn, graph=True)
    # (b) SDPA on contiguous K/V
    kc = k[table.long()].reshape(batch, tokens, HKV, D).transpose(1, 2).contiguous()
    vc = v[table.long()].reshape(batch, tokens, HKV, D).transpose(1, 2).contiguous()
    qs = q[:, :, None, :]
    sdpa_name, sdpa, sdpa_fn, sdpa_all = sdpa_fastest(qs, kc, vc)
    sdpa_err = rel_err(dense_fn(), sdpa_fn()[:, :, 0])
    del kc, vc
    torch.cuda.empty_cache()
    # (c) copy of the same number of bytes
    src = torch.empty(kv_bytes, dtype=torch.uint8, device="cuda").random_(0, 256)
    dst = torch.empty_like(src)
    copy = bench(lambda: dst.copy_(src))
    del src, dst
    torch.cuda.empty_cache()
    # (d) sparse at 20%
    n_blocks = table.shape[1]
    nblk = torch.full((batch,), n_blocks, dtype=torch.int32, device="cuda")
    mean = torch.empty(k.shape[0], HKV, D, dtype=torch.float32, device="cuda")
    ids = torch.arange(k.shape[0], dtype=torch.int32, device="cuda")
    tri.update_block_reprs(k, ids, torch.full_like(ids, BS), mean=mean)
    budget_n = math.ceil(RATIO * n_blocks)
    budget = torch.full((batch,), budget_n, dtype=torch.int32, device="cuda")
    width = ops.select_width(n_blocks, budget_n, INIT_WINDOW, LOCAL_WINDOW)

    def score():
        return tri.score_blocks(q, table, nblk, kind="mean", mean=mean)

    scores = score()

    def select():
        return tri.select_blocks(scores, nblk, budget, init_window=INIT_WINDOW,
                                 local_window=LOCAL_WINDOW, width=width)

    sel, count = select()

    def build():
        return tri.sparse_block_table(table, lens, sel, count, BS)

    stab, slens = build()

    def attend():
        return tri.paged_decode_attention(q, k, v, stab, slens, scale=scale)

    def sparse_path():
        s = tri.score_blocks(q, table, nblk, kind="mean", mean=mean)
        chosen, cnt = tri.select_blocks(s, nblk, budget, init_window=INIT_WINDOW,
                                        local_window=LOCAL_WINDOW, width=width)
        t, n = tri.sparse_block_table(table, lens, chosen, cnt, BS)
        return tri.paged_decode_attention(q, k, v, t, n, scale=scale)

    # (e) the same path as the methods run it: re-selection every STRIDE decode steps (ESA's
    # retrieval_stride), alternatives: bfloat16 block means (scoring reads half the bytes), the
    # sparse table folded into the attention kernel (``decode_selected``).
    mean16 = torch.full_like(mean, float("nan"), dtype=torch.bfloat16)
    tri.update_block_reprs(k, ids, torch.full_like(ids, BS), mean=mean16)
    mean16_err = float((mean16.float() - mean).abs().max() / mean.abs().max())
    scores16 = tri.score_blocks(q, table, nblk, kind="mean", mean=mean16)
    sel16, count16 = tri.select_blocks(scores16, nblk, budget, init_window=INIT_WINDOW,
                                       local_window=LOCAL_WINDOW, width=width)
    agreement = selection_agreement(sel, count, sel16, count16)
    fused_out = tri.decode_selected(q, k, v, table, lens, sel, count, scale=scale)
    fused_equal = bool(torch.equal(fused_out, attend()))

    def step_fn(stride: int, bf16: bool, fused: bool):
        reprs = mean16 if bf16 else mean

        def steps():
            s = tri.score_blocks(q, table, nblk, kind="mean", mean=reprs)
            chosen, cnt = tri.select_blocks(s, nblk, budget, init_window=INIT_WINDOW,
                                            local_window=LOCAL_WINDOW, width=width)
            for _ in range(stride):
                if fused:
                    o = tri.decode_selected(q, k, v, table, lens, chosen, cnt, scale=scale)
                else:
                    t, n = tri.sparse_block_table(table, lens, chosen, cnt, BS)
                    o = tri.paged_decode_attention(q, k, v, t, n, scale=scale)
            return o
        return steps

    per_step = {}
    for stride in (1, STRIDE):
        for bf16, fused in itertools.product((False, True), (False, True)):
            name = f"stride{stride}{'_bf16means' if bf16 else ''}{'_fused_table' if fused else ''}"
            per_step[name] = bench(step_fn(stride, bf16, fused), graph=True) / stride
    parts_alt = dict(score_bf16_means=bench(lambda: tri.score_blocks(q, table, nblk, kind="mean",
                                                                     mean=mean16), graph=True),
                     attention_fused_table=bench(lambda: tri.decode_selected(
                         q, k, v, table, lens, sel, count, scale=scale), graph=True))

    def sparse_public():
        s = ops.score_blocks(q, table, nblk, kind="mean", mean=mean)
        chosen, cnt = ops.select_blocks(s, nblk, budget_n, init_window=INIT_WINDOW,
                                        local_window=LOCAL_WINDOW)
        t, n = ops.sparse_block_table(table, lens, chosen, cnt, BS)
        return ops.paged_decode_attention(q, k, v, t, n)

    parts = {name: bench(fn) for name, fn in (("score", score), ("select", select),
                                               ("table", build), ("attention", attend))}
    parts_graph = {name: bench(fn, graph=True) for name, fn in (
        ("score", score), ("select", select), ("table", build), ("attention", attend))}
    select_variants = {}
    for name, radix, limit in (("radix", True, 1 << 30), ("4-ary", False, 1 << 30),
                               ("topk", True, 0)):
        tri.SELECT_RADIX, tri.SELECT_KERNEL_MAX_BLOCKS = radix, limit
        assert all(torch.equal(a, b) for a, b in zip(select(), (sel, count)))
        select_variants[name] = bench(select, graph=True)
    tri.SELECT_RADIX, tri.SELECT_KERNEL_MAX_BLOCKS = SELECT_DEFAULTS
    if tune:
        for warps in (4, 8, 16, 32):
            tri.SELECT_WARPS = warps
            select_variants[f"{'radix' if tri.SELECT_RADIX else '4-ary'}_warps{warps}"] = \
                bench(select, graph=True)
        tri.SELECT_WARPS = None
        score_sweep = {}
        for elems, warps in itertools.product((2048, 4096, 8192, 16384), (2, 4, 8)):
            tri.SCORE_TILE_ELEMS, tri.SCORE_WARPS = elems, warps
            score_sweep[f"elems{elems}_warps{warps}"] = bench(score, graph=True)
        tri.SCORE_TILE_ELEMS, tri.SCORE_WARPS = SCORE_DEFAULTS
        res["score_sweep_graph_ms"] = score_sweep
        # the sparse attention's own launch: tile x programs per multiprocessor
        attn_sweep = {}
        for block_n, per_sm in itertools.product((64, 128), (1, 2, 3, 4, 6)):
            tri.BLOCK_N, tri.PROGRAMS_PER_SM = block_n, per_sm
            attn_sweep[f"block_n{block_n}_per_sm{per_sm}"] = bench(attend, graph=True)
        use_config({})
        res["sparse_attention_sweep_graph_ms"] = attn_sweep
    sparse_eager = bench(sparse_path)
    sparse_graph = bench(sparse_path, graph=True)
    public = bench(sparse_public)
    same = torch.equal(sparse_path(), sparse_public())

    copy_bw = 2 * kv_bytes / (copy * 1e-3)
    attn_bw = io_bytes / (dense * 1e-3)
    res.update(
        ms=dict(dense=dense, dense_graph=dense_graph, sdpa=sdpa, copy=copy,
                sparse_eager=sparse_eager, sparse_graph=sparse_graph, sparse_public_ops=public,
                sparse_parts_eager=parts, sparse_parts_graph=parts_graph,
                sparse_parts_alternatives_graph=parts_alt,
                select_variants_graph=select_variants, sparse_per_step_graph=per_step),
        bf16_means=dict(max_rel_err_vs_float32=mean16_err,
                        selection_agreement_vs_float32=agreement),
        fused_table_equals_table_then_attention=fused_equal, stride=STRIDE,
        sdpa_backend=sdpa_name, sdpa_backends_ms=sdpa_all, dense_vs_sdpa_rel_err=sdpa_err,
        sparse_budget_blocks=budget_n, sparse_blocks=n_blocks, public_equals_impl=same,
        bandwidth_GBps=dict(dense_attention=attn_bw / 1e9, copy_read_plus_write=copy_bw / 1e9),
        ratios=dict(dense_over_sdpa=dense / sdpa,
                    bandwidth_over_copy=attn_bw / copy_bw,
                    dense_over_sparse_graph=dense_graph / sparse_graph,
                    dense_over_sparse_eager=dense / sparse_eager,
                    dense_over_sparse_public_ops=dense / public,
                    **{f"dense_over_sparse_{name}": dense_graph / ms
                       for name, ms in per_step.items()}),
    )
    use_config({})
    del k, v
    torch.cuda.empty_cache()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--sweep", action="store_true", help="tune the decode launch first")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_sparse: needs a CUDA device", file=sys.stderr)
        return 2
    report = dict(machine=dict(gpu=torch.cuda.get_device_name(), host=platform.node(),
                               torch=torch.__version__, triton=triton.__version__,
                               sms=torch.cuda.get_device_properties(0).multi_processor_count),
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  shape=dict(q_heads=HQ, kv_heads=HKV, head_dim=D, block_size=BS, dtype=str(DTYPE),
                             sparse_ratio=RATIO, init_window=INIT_WINDOW, local_window=LOCAL_WINDOW))
    t0 = time.time()
    if not check(report):
        print("correctness check FAILED: no timings", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
        return 1
    if args.sweep:
        sweep(report)
    report["timings"] = []
    for batch, tokens in SHAPES:
        r = time_shape(batch, tokens, {}, tune=args.sweep)
        report["timings"].append(r)
        print(json.dumps(r), flush=True)
    report["seconds"] = time.time() - t0
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    print(f"\nper decode step, graph replays (dense / sparse; stride {STRIDE} = one scoring + "
          f"selection per {STRIDE} steps):")
    for r in report["timings"]:
        print(f"{r['batch']}x{r['tokens']}: " + ", ".join(
            f"{name} {r['ms']['dense_graph'] / ms:.2f}x ({ms * 1e3:.1f} us)"
            for name, ms in r["ms"]["sparse_per_step_graph"].items()))
        print(f"   alt parts {r['ms']['sparse_parts_alternatives_graph']}, select "
              f"{r['ms']['select_variants_graph']}, bf16 {r['bf16_means']}, fused equal "
              f"{r['fused_table_equals_table_then_attention']}")
    print(f"\n{'shape':>10} {'dense ms':>9} {'SDPA ms':>8} {'dense/SDPA':>10} {'BW/copy':>8} "
          f"{'dense/sparse':>12} {'graph parts ms (score/select/table/attn)':>42}")
    for r in report["timings"]:
        p = r["ms"]["sparse_parts_graph"]
        print(f"{r['batch']}x{r['tokens']:>7} {r['ms']['dense']:9.4f} {r['ms']['sdpa']:8.4f} "
              f"{r['ratios']['dense_over_sdpa']:10.3f} {r['ratios']['bandwidth_over_copy']:8.3f} "
              f"{r['ratios']['dense_over_sparse_graph']:12.3f}   "
              f"{p['score']:.4f}/{p['select']:.4f}/{p['table']:.4f}/{p['attention']:.4f}"
              f"  ({r['sdpa_backend']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
