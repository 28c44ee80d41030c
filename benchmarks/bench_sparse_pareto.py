"""H200 decode speed of every sparse configuration at every ratio: the speed half of the Pareto
table (``evals/sparse_pareto.py`` joins it with the quality half).

    PYTHONPATH=. python3 benchmarks/bench_sparse_pareto.py --json benchmarks/results/sparse_pareto_speed_h200.json

Shape and cache as ``benchmarks/bench_sparse.py`` (Llama-3-8B decode, one layer: 32 query heads,
8 KV heads, head dim 128, bf16, 16-token blocks handed out in a random order; 8 x 32K and
1 x 128K; init window 1, local window 4). For each ratio in ``--ratios`` and each configuration
of :data:`CONFIGS` one CUDA graph holds one retrieval (scoring, selection, the attention's
table) and ``stride`` attentions; its replay time divided by ``stride`` is the configuration's
time per decode step, and the speed-up is the dense Triton kernel's graph time over it (the
same run). Scoring and selection are always included.

Before timing, each configuration's retrieval is checked on the timed inputs against the
PyTorch reference: the scores of its tables (relative error), and its selection (the same
blocks, up to float32 rounding of the head mass: at least 99.9% of the selected blocks agree);
a failed check stops the run without any speed-up.
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.bench_sparse import (BS, D, DTYPE, HKV, HQ, INIT_WINDOW, LOCAL_WINDOW,  # noqa: E402
                                     SHAPES, bench, make_case)
from ucm.sparse import ops  # noqa: E402
from ucm.sparse.mass import HEAD_BUDGET_CAP  # noqa: E402
from _argtypes import write_json  # noqa: E402

RATIOS = (0.7, 0.5, 0.3, 0.2)


@dataclass(frozen=True)
class Spec:
    """One timed configuration: how a method retrieves on a GPU."""
    name: str
    kind: str            # "mean" (int8 means, ESA), "quest" (bf16 bounds) or "mass" (int4 keys)
    group: int           # tokens per sub-block summary
    stride: int          # decode steps per retrieval
    per_kv_head: bool = False
    pooled: bool = False  # per KV head: one budget per request over its KV heads (mass ships it)


#: the shipped methods' GPU paths and the candidates measured against them
CONFIGS = (
    Spec("esa (stride 8, g4)", "mean", 4, 8),
    Spec("esa stride 1, g4", "mean", 4, 1),
    Spec("esa stride 1, g2", "mean", 2, 1),
    Spec("esa stride 2, g2", "mean", 2, 2),
    Spec("esa stride 4, g2", "mean", 2, 4),
    Spec("esa stride 3, g2", "mean", 2, 3),
    Spec("esa stride 8, g2", "mean", 2, 8),
    Spec("quest (g4)", "quest", 4, 1),
    Spec("mean per KV head, g2", "mean", 2, 1, per_kv_head=True),
    Spec("mean per KV head, g2, stride 4", "mean", 2, 4, per_kv_head=True),
    Spec("quest per KV head, g2", "quest", 2, 1, per_kv_head=True),
    Spec("mass", "mass", 1, 1),
    Spec("mass per KV head", "mass", 1, 1, per_kv_head=True, pooled=True),
    Spec("mass per KV head, own budgets", "mass", 1, 1, per_kv_head=True),
)


def tables_for(k, kind: str, group: int) -> dict:
    """The summary tables of every cache block, as the methods keep them for a bf16 cache on a
    GPU: int8 means with per-row scales, or bf16 Quest bounds."""
    from ucm.fast.triton import sparse as tri

    n = k.shape[0]
    ids = torch.arange(n, dtype=torch.int32, device=k.device)
    if kind == "mass":
        t = dict(keys4=torch.empty(n, HKV, BS, D // 2, dtype=torch.uint8, device=k.device),
                 scale4=torch.empty(n, HKV, D, dtype=torch.float16, device=k.device))
        tri.quantize_token_keys(k, ids, **t)
        return t
    G = BS // group
    if kind == "mean":
        t = dict(mean=torch.empty(n, G, HKV, D, dtype=torch.int8, device=k.device),
                 mean_scale=torch.empty(n, G, HKV, device=k.device))
    else:
        t = {x: torch.empty(n, G, HKV, D, dtype=DTYPE, device=k.device) for x in ("kmin", "kmax")}
    tri.update_block_reprs(k, ids, torch.full_like(ids, BS), **t)
    return t


class Retrieval:
    """One configuration's retrieval on one case: ``run()`` -> (table, lens) for the attention."""

    def __init__(self, spec: Spec, q, table, lens, tabs, budget_n: int):
        self.spec, self.q, self.table, self.lens, self.tabs = spec, q, table, lens, tabs
        B, M = table.shape
        self.nblk = torch.full((B,), M, dtype=torch.int32, device=q.device)
        self.budget = torch.full((B,), budget_n, dtype=torch.int32, device=q.device)
        self.width = ops.select_width(M, budget_n, INIT_WINDOW, LOCAL_WINDOW)
        # pooled per-KV-head budgets reach HEAD_BUDGET_CAP times the budget
        self.width_pooled = ops.select_width(M, HEAD_BUDGET_CAP * budget_n, INIT_WINDOW,
                                             LOCAL_WINDOW)
        self.sk = dict(init_window=INIT_WINDOW, local_window=LOCAL_WINDOW, width=self.width)
        self.scale = D ** -0.5

    def run(self):
        from ucm.fast.triton import sparse as tri

        s = self.spec
        if s.kind == "mass":
            return self._mass()
        if not s.per_kv_head:
            _, _, t, n = tri.score_select_head_mass(
                self.q, self.table, self.nblk, self.budget, kind=s.kind, scale=self.scale,
                seq_lens=self.lens, block_size=BS, **self.tabs, **self.sk)
            return t, n
        B, M = self.table.shape
        per_head = tri.score_blocks(self.q, self.table, self.nblk, kind=s.kind, reduce="none",
                                    **self.tabs)
        mass = torch.softmax(per_head * self.scale, -1).reshape(B, HKV, HQ // HKV, M).mean(2)
        sel, count = tri.select_blocks(mass.reshape(B * HKV, M),
                                       self.nblk.repeat_interleave(HKV),
                                       self.budget.repeat_interleave(HKV), **self.sk)
        t, n = tri.sparse_block_table(self.table.repeat_interleave(HKV, 0),
                                      self.lens.repeat_interleave(HKV), sel, count, BS)
        return t.reshape(B, HKV, -1), n.reshape(B, HKV)

    def _mass(self):
        """``mass``: int4-key block mass per query head, then the fused head-mass selection over
        the request (shared) or over ``B * Hkv`` rows of the KV heads' query heads."""
        from ucm.fast.triton import sparse as tri

        B, M = self.table.shape
        per_head = tri.score_token_mass(self.q, self.table, self.nblk, scale=self.scale,
                                        **self.tabs)
        if not self.spec.per_kv_head:
            _, _, t, n = tri.select_head_mass(per_head, self.nblk, self.budget, scale=self.scale,
                                              block_table=self.table, seq_lens=self.lens,
                                              block_size=BS, **self.sk)
            return t, n
        if self.spec.pooled:
            shares = torch.softmax(per_head * self.scale, -1).view(B, HKV, HQ // HKV, M).mean(2)
            budgets = tri.pool_head_budgets(shares, self.nblk, self.budget, cap=HEAD_BUDGET_CAP,
                                            init_window=INIT_WINDOW, local_window=LOCAL_WINDOW)
            _, _, t, n = tri.select_sparse_table(
                shares.reshape(B * HKV, M), self.nblk.repeat_interleave(HKV), budgets.view(-1),
                self.table.repeat_interleave(HKV, 0), self.lens.repeat_interleave(HKV),
                block_size=BS, init_window=INIT_WINDOW, local_window=LOCAL_WINDOW,
                width=self.width_pooled)
            return t.view(B, HKV, -1), n.view(B, HKV)
        _, _, t, n = tri.select_head_mass(
            per_head.view(B * HKV, HQ // HKV, M), self.nblk.repeat_interleave(HKV),
            self.budget.repeat_interleave(HKV), scale=self.scale,
            block_table=self.table.repeat_interleave(HKV, 0),
            seq_lens=self.lens.repeat_interleave(HKV), block_size=BS, **self.sk)
        return t.view(B, HKV, -1), n.view(B, HKV)

    def scores(self, backend: str):
        """Per-head scores of this configuration's tables through ``backend``."""
        s = self.spec
        if s.kind == "mass":
            return ops.score_token_mass(self.q, self.table, self.nblk, scale=self.scale,
                                        backend=backend, **self.tabs)
        kw = ({"mean": self.tabs["mean"], "mean_scale": self.tabs["mean_scale"]}
              if s.kind == "mean" else self.tabs)
        return ops.score_blocks(self.q, self.table, self.nblk, kind=s.kind, reduce="none",
                                backend=backend, **kw)

    def reference(self):
        """The same selection through the PyTorch reference (float32 scores)."""
        s = self.spec
        B, M = self.table.shape
        per_head = self.scores("reference")
        sk = dict(init_window=INIT_WINDOW, local_window=LOCAL_WINDOW)
        if not s.per_kv_head:
            mass = torch.softmax(per_head * self.scale, -1).mean(1)
            sel, count = ops.select_blocks(mass, self.nblk, self.budget, backend="reference", **sk)
            return ops.sparse_block_table(self.table, self.lens, sel, count, BS,
                                          backend="reference"), per_head
        mass = torch.softmax(per_head * self.scale, -1).reshape(B, HKV, HQ // HKV, M).mean(2)
        budgets = self.budget.repeat_interleave(HKV)
        if s.pooled:
            budgets = ops.pool_head_budgets(mass, self.nblk, self.budget, cap=HEAD_BUDGET_CAP,
                                            backend="reference", **sk).view(-1)
        sel, count = ops.select_blocks(mass.reshape(B * HKV, M), self.nblk.repeat_interleave(HKV),
                                       budgets, backend="reference", **sk)
        t, n = ops.sparse_block_table(self.table.repeat_interleave(HKV, 0),
                                      self.lens.repeat_interleave(HKV), sel, count, BS,
                                      backend="reference")
        return (t.reshape(B, HKV, -1), n.reshape(B, HKV)), per_head


def agreement(a, b) -> float:
    """Share of the attended blocks that two (table, lens) selections have in common."""
    (ta, la), (tb, lb) = a, b
    ta, tb = ta.reshape(-1, ta.shape[-1]), tb.reshape(-1, tb.shape[-1])
    la, lb = la.reshape(-1), lb.reshape(-1)
    same = total = 0
    for i in range(ta.shape[0]):
        na, nb = -(-int(la[i]) // BS), -(-int(lb[i]) // BS)
        x, y = set(ta[i, :na].tolist()), set(tb[i, :nb].tolist())
        same += len(x & y)
        total += max(len(x), len(y))
    return same / max(total, 1)


def time_shape(batch: int, tokens: int, ratios, specs) -> dict:
    from ucm.fast.triton import sparse as tri

    q, k, v, table, lens = make_case(batch, tokens, seed=11)
    # do_bench_cudagraph runs fn on a fresh stream that does not wait for the default one:
    # the case must be written before the dense decode reads its table
    torch.cuda.synchronize()
    scale = D ** -0.5
    M = table.shape[1]
    dense = bench(lambda: tri.decode(q, k, v, table, lens, scale), graph=True)
    out = dict(batch=batch, tokens=tokens, dense_graph_ms=dense, ratios={})
    tabs_cache: dict = {}
    kf, vf = k.float(), v.float()
    for ratio in ratios:
        budget_n = math.ceil(ratio * M)
        row = {}
        for spec in specs:
            key = (spec.kind, spec.group)
            if key not in tabs_cache:
                tabs_cache[key] = tables_for(k, spec.kind, spec.group)
            r = Retrieval(spec, q, table, lens, tabs_cache[key], budget_n)
            got = r.run()
            want, per_head_ref = r.reference()
            tri_scores = r.scores("triton")
            err = float((tri_scores - per_head_ref).abs().max()
                        / per_head_ref.abs().max().clamp_min(1e-30))
            agree = agreement(got, want)
            # mass: bfloat16 products of dequantized int4 keys (its ranking tolerates them, the
            # selection differs from the float32 one only at near-ties)
            ok = (err < 2e-2 and agree >= 0.99) if spec.kind == "mass" else \
                (err < 1e-4 and agree >= 0.999)
            attn_ref = ops.paged_decode_attention(q.float(), kf, vf, *want,
                                                  backend="reference")
            attn = tri.decode(q, k, v, *want, scale)
            attn_err = float((attn.float() - attn_ref).norm() / attn_ref.norm())
            ok &= attn_err < 1e-2

            def step(r=r, spec=spec):
                t, n = r.run()
                for _ in range(spec.stride):
                    o = tri.decode(q, k, v, t, n, scale)
                return o

            ms = bench(step, graph=True) / spec.stride if ok else None
            row[spec.name] = dict(spec=asdict(spec), budget_blocks=budget_n, ms=ms,
                                  speedup=dense / ms if ms else None, check=dict(
                                      score_rel_err=err, selection_agreement=agree,
                                      attention_rel_err=attn_err, passed=ok))
            print(f"{batch}x{tokens} ratio {ratio} {spec.name:34s} "
                  + (f"{dense / ms:5.2f}x ({ms * 1e3:6.1f} us)" if ms else "CHECK FAILED")
                  + f"  [scores {err:.1e}, selection {agree:.4f}, attention {attn_err:.1e}]",
                  flush=True)
        out["ratios"][str(ratio)] = row
    del k, v, kf, vf
    torch.cuda.empty_cache()
    return out


def fastest(rows: dict, k: int = 5, skip=()) -> tuple:
    """``(timed, best)`` of a sweep's ``{name: ms or why not}``: the timed variants, and the
    ``k`` fastest names (``skip``: names that are not variants)."""
    timed = {n: t for n, t in rows.items() if isinstance(t, float) and n not in skip}
    return timed, sorted(timed, key=timed.get)[:k]


def sweep_scoring(report: dict) -> None:
    """Time the mean scoring (int8, per head) and ESA's whole retrieval
    (``score_select_head_mass`` with the table) for 2- and 4-token means over a grid of scoring
    launch constants, at both shapes and ratio 0.2; prints the best per group and shape."""
    import itertools

    from ucm.fast.triton import sparse as tri

    out = {}
    for batch, tokens in SHAPES:
        q, k, v, table, lens = make_case(batch, tokens, seed=11)
        torch.cuda.synchronize()
        M = table.shape[1]
        nblk = torch.full((batch,), M, dtype=torch.int32, device=q.device)
        budget_n = math.ceil(0.2 * M)
        budget = torch.full((batch,), budget_n, dtype=torch.int32, device=q.device)
        sk = dict(init_window=INIT_WINDOW, local_window=LOCAL_WINDOW,
                  width=ops.select_width(M, budget_n, INIT_WINDOW, LOCAL_WINDOW))
        for group in (2, 4):
            tabs = tables_for(k, "mean", group)
            want = tri.score_blocks(q, table, nblk, kind="mean", reduce="none", **tabs)
            rows, cfgs = {}, {}
            for score_rows, per_sm, warps, stages, loop in itertools.product(
                    (64, 128, 256), (1, 2, 4), (4, 8), (2,), (2, 3)):
                cfg = tri.LAUNCH.replace(score_rows=score_rows, score_programs_per_sm=per_sm,
                                         score_warps=warps, score_stages=stages,
                                         score_loop_stages=loop)
                name = f"rows{score_rows}_sm{per_sm}_w{warps}_s{stages}_l{loop}"
                cfgs[name] = cfg
                try:
                    got = tri.score_blocks(q, table, nblk, kind="mean", reduce="none",
                                           launch=cfg, **tabs)
                    if not torch.equal(got, want):
                        rows[name] = "differs"
                        continue
                    rows[name] = bench(lambda cfg=cfg: tri.score_blocks(
                        q, table, nblk, kind="mean", reduce="none", launch=cfg, **tabs),
                        graph=True)
                except Exception as exc:  # a configuration that does not fit: recorded
                    rows[name] = repr(exc)[:120]
            timed, best = fastest(rows)
            default = ("rows64_sm2_w4_s2_l3", timed.get("rows64_sm2_w4_s2_l3"))
            full = {}
            for name in best[:2] + [default[0]]:
                cfg = cfgs[name]
                full[name] = bench(lambda cfg=cfg: tri.score_select_head_mass(
                    q, table, nblk, budget, kind="mean", scale=D ** -0.5, seq_lens=lens,
                    block_size=BS, launch=cfg, **tabs, **sk), graph=True)
            key = f"{batch}x{tokens}_g{group}"
            out[key] = dict(scoring_ms=rows, best=best, retrieval_ms=full)
            print(f"{key}: scoring default {default[1] * 1e3:.1f} us; best "
                  + ", ".join(f"{n} {timed[n] * 1e3:.1f}" for n in best)
                  + "; retrieval " + ", ".join(f"{n} {t * 1e3:.1f}" for n, t in full.items()),
                  flush=True)
        del k, v
        torch.cuda.empty_cache()
    report["scoring_sweep"] = out


def sweep_mass_scoring(report: dict) -> None:
    """Time ``score_token_mass`` (the ``mass`` ranking's scoring) over a grid of its launch
    constants at both shapes, each checked against the float32 reference first (bfloat16
    products: within the equivalence test's bound); prints the five fastest per shape."""
    import itertools

    from ucm.fast.triton import sparse as tri

    out = {}
    for batch, tokens in SHAPES:
        q, k, v, table, lens = make_case(batch, tokens, seed=11)
        tabs = tables_for(k, "mass", 1)
        del k, v
        M = table.shape[1]
        nblk = torch.full((batch,), M, dtype=torch.int32, device=q.device)
        scale = D ** -0.5
        want = ops.score_token_mass(q, table, nblk, scale=scale, backend="reference", **tabs)
        fin = torch.isfinite(want)
        bound = float(2.0 ** -7 * (q.float().abs().sum(-1).max() * 7
                                   * tabs["scale4"].float().abs().max()) + 1e-4)
        rows = {}
        for score_rows, warps, stages in itertools.product((32, 64, 128), (1, 2, 4), (1, 2)):
            cfg = tri.LAUNCH.replace(score_mass_rows=score_rows, score_mass_warps=warps,
                                     score_mass_stages=stages)
            name = f"rows{score_rows}_w{warps}_s{stages}"
            got = tri.score_token_mass(q, table, nblk, scale=scale, launch=cfg, **tabs)
            err = float((got - want).abs()[fin].max())
            if not torch.equal(torch.isinf(got), torch.isinf(want)) or err > bound:
                rows[name] = f"differs: {err:.3g} > {bound:.3g}"
                continue
            rows[name] = bench(lambda cfg=cfg: tri.score_token_mass(
                q, table, nblk, scale=scale, launch=cfg, **tabs), graph=True)
        timed, best = fastest(rows)
        key = f"{batch}x{tokens}"
        out[key] = dict(scoring_ms=rows, best=best)
        print(f"{key}: mass scoring best " + ", ".join(f"{n} {timed[n] * 1e3:.1f} us"
                                                       for n in best), flush=True)
        del tabs
        torch.cuda.empty_cache()
    report["mass_scoring_sweep"] = out


def sweep_pool(report: dict) -> None:
    """Time ``pool_head_budgets`` (the pooled per-KV-head budgets of ``mass``) on softmax shares
    of 8 KV heads at 8 x 2,048, 1 x 8,192 and 4 x 8,192 blocks, ratio 0.2, over a grid of its
    launch constants, each checked bit-identical to the reference first; the reference's time
    beside it."""
    import itertools

    from ucm.fast.triton import sparse as tri

    def name_of(cfg) -> str:
        return (f"span{cfg.pool_span}_hw{cfg.pool_hist_warps}_sw{cfg.pool_scan_warps}"
                f"_se{cfg.pool_scan_elems}")

    out = {}
    for batch, blocks in ((8, 2048), (1, 8192), (4, 8192)):
        gen = torch.Generator(device="cuda").manual_seed(5)
        logits = torch.randn(batch, HKV, blocks, generator=gen, device="cuda") * 3
        shares = torch.softmax(logits, -1)
        nblk = torch.full((batch,), blocks, dtype=torch.int32, device="cuda")
        budget = torch.full((batch,), math.ceil(0.2 * blocks), dtype=torch.int32,
                            device="cuda")
        kw = dict(cap=HEAD_BUDGET_CAP, init_window=INIT_WINDOW, local_window=LOCAL_WINDOW)
        want = ops.pool_head_budgets(shares, nblk, budget, backend="reference", **kw)
        # (the reference reads its budgets' range back: no graph)
        rows = {"reference": bench(lambda: ops.pool_head_budgets(
            shares, nblk, budget, backend="reference", **kw))}
        for span, hist_warps, scan_warps, scan_elems in itertools.product(
                (256, 512, 1024), (2, 4, 8), (4, 8), (2048, 4096, 16384)):
            cfg = tri.LAUNCH.replace(pool_span=span, pool_hist_warps=hist_warps,
                                     pool_scan_warps=scan_warps, pool_scan_elems=scan_elems)
            name = name_of(cfg)
            got = tri.pool_head_budgets(shares, nblk, budget, launch=cfg, **kw)
            if not torch.equal(got, want):
                rows[name] = "differs"
                continue
            rows[name] = bench(lambda cfg=cfg: tri.pool_head_budgets(
                shares, nblk, budget, launch=cfg, **kw), graph=True)
        timed, best = fastest(rows, skip=("reference",))
        key = f"{batch}x{blocks}"
        out[key] = dict(ms=rows, best=best)
        shipped = timed.get(name_of(tri.LAUNCH), float("nan"))
        print(f"{key}: reference {rows['reference'] * 1e3:.1f} us; shipped "
              f"{shipped * 1e3:.1f} us; best "
              + ", ".join(f"{n} {timed[n] * 1e3:.1f}" for n in best)
              + f"; differs: {[n for n, t in rows.items() if t == 'differs']}", flush=True)
    report["pool_sweep"] = out


def sweep_select_rows(report: dict) -> None:
    """Time the per-KV-head selections of ``mass`` (the pooled budgets' ``select_sparse_table``
    and the own budgets' ``select_head_mass``) over ``B * Hkv`` rows, with the histogram
    selection allowed for up to 1 (the default) or 8 / 64 rows, at 1 x 8,192 and 8 x 2,048 /
    8 x 4,096 / 8 x 8,192 blocks of 8 KV heads, ratio 0.2; every variant checked identical to
    the default's output first. The shared selection of ``B`` rows at the same sizes beside."""
    from ucm.fast.triton import sparse as tri

    out = {}
    for batch, blocks in ((1, 8192), (8, 2048), (8, 4096), (8, 8192)):
        gen = torch.Generator(device="cuda").manual_seed(9)
        per_head = torch.randn(batch * HKV, HQ // HKV, blocks, generator=gen, device="cuda") * 4
        shares = torch.softmax(per_head * D ** -0.5, -1).mean(1)            # [B * Hkv, M]
        rows = batch * HKV
        nblk = torch.full((rows,), blocks, dtype=torch.int32, device="cuda")
        budget_n = math.ceil(0.2 * blocks)
        budgets = torch.full((rows,), budget_n, dtype=torch.int32, device="cuda")
        table = torch.randperm(rows * blocks, device="cuda").view(rows, blocks).int()
        lens = nblk * BS
        sk = dict(init_window=INIT_WINDOW, local_window=LOCAL_WINDOW,
                  width=ops.select_width(blocks, HEAD_BUDGET_CAP * budget_n, INIT_WINDOW,
                                         LOCAL_WINDOW))
        res, want_p, want_o = {}, None, None
        for cap in (1, 8, 64):
            cfg = tri.LAUNCH.replace(hist_max_rows=cap, mass_hist_max_rows=cap)
            got_p = tri.select_sparse_table(shares, nblk, budgets, table, lens, block_size=BS,
                                            launch=cfg, **sk)
            got_o = tri.select_head_mass(per_head, nblk, budgets, scale=D ** -0.5,
                                         block_table=table, seq_lens=lens, block_size=BS,
                                         launch=cfg, **sk)
            if want_p is None:
                want_p, want_o = got_p, got_o
            same = all(torch.equal(a, b) for a, b in zip(got_p + got_o, want_p + want_o))
            res[f"rows{cap}"] = dict(
                same=same,
                pooled_ms=bench(lambda cfg=cfg: tri.select_sparse_table(
                    shares, nblk, budgets, table, lens, block_size=BS, launch=cfg, **sk),
                    graph=True),
                own_ms=bench(lambda cfg=cfg: tri.select_head_mass(
                    per_head, nblk, budgets, scale=D ** -0.5, block_table=table, seq_lens=lens,
                    block_size=BS, launch=cfg, **sk), graph=True),
                shared_ms=bench(lambda cfg=cfg: tri.select_sparse_table(
                    shares[:batch], nblk[:batch], budgets[:batch], table[:batch],
                    lens[:batch], block_size=BS, launch=cfg, **sk), graph=True))
        key = f"{batch}x{blocks}"
        out[key] = res
        print(key, "; ".join(f"{k}: pooled {v['pooled_ms'] * 1e3:.1f} own {v['own_ms'] * 1e3:.1f}"
                              f" shared {v['shared_ms'] * 1e3:.1f} us same {v['same']}"
                              for k, v in res.items()), flush=True)
    report["select_rows_sweep"] = out


def main(argv=None) -> int:
    import triton

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ratios", default=",".join(map(str, RATIOS)))
    ap.add_argument("--only", default="", help="configuration names separated by ';' (names hold "
                    "commas; default: all)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--sweep-scoring", action="store_true",
                    help="only time the mean scoring over a grid of launch constants")
    ap.add_argument("--sweep-mass-scoring", action="store_true",
                    help="only time the mass scoring over a grid of launch constants")
    ap.add_argument("--sweep-select-rows", action="store_true",
                    help="only time the per-KV-head selections with the histogram selection "
                    "allowed for more rows")
    ap.add_argument("--sweep-pool", action="store_true",
                    help="only time the pooled per-KV-head budgets over a grid of launch "
                    "constants")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_sparse_pareto: needs a CUDA device", file=sys.stderr)
        return 2
    sweeps = {"sweep_scoring": sweep_scoring, "sweep_mass_scoring": sweep_mass_scoring,
              "sweep_pool": sweep_pool, "sweep_select_rows": sweep_select_rows}
    sweep = next((f for flag, f in sweeps.items() if getattr(args, flag)), None)
    if sweep is not None:
        report = {"command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name()}
        sweep(report)
        if args.json:
            write_json(args.json, report, indent=1)
        return 0
    ratios = [float(x) for x in args.ratios.split(",")]
    wanted = [x.strip() for x in args.only.split(";") if x.strip()]
    unknown = sorted(set(wanted) - {s.name for s in CONFIGS})
    if unknown:
        ap.error(f"--only: unknown configurations {unknown}; known: {[s.name for s in CONFIGS]}")
    specs = [s for s in CONFIGS if not wanted or s.name in wanted]
    t0 = time.time()
    report = dict(machine=dict(gpu=torch.cuda.get_device_name(), host=platform.node(),
                               torch=torch.__version__, triton=triton.__version__),
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  shape=dict(q_heads=HQ, kv_heads=HKV, head_dim=D, block_size=BS,
                             dtype=str(DTYPE), init_window=INIT_WINDOW,
                             local_window=LOCAL_WINDOW),
                  command="python benchmarks/bench_sparse_pareto.py " + " ".join(argv or sys.argv[1:]),
                  timings=[time_shape(b, t, ratios, specs) for b, t in SHAPES])
    report["seconds"] = time.time() - t0
    failed = [n for s in report["timings"] for r in s["ratios"].values() for n, x in r.items()
              if not x["check"]["passed"]]
    report["failed_checks"] = failed
    if args.json:
        write_json(args.json, report, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
