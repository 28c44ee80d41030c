"""Benchmark of the sparse-attention ops: a pytest-benchmark part on CPU tensors and the H200
figures as a script.

**pytest** (CPU, tiny shapes; seconds with ``--benchmark-disable``): each case runs with the
reference provider and the fast one (the Triton kernels through the interpreter; skipped when
this process imported Triton natively), checks the provider's output against the reference's,
then times it:

    pytest benchmarks/bench_sparse.py                      # timings
    pytest benchmarks/bench_sparse.py --benchmark-disable  # smoke run (CI)

**Script** (a CUDA machine; H200 figures in ``benchmarks/results/bench_sparse_h200.json``):

    PYTHONPATH=. python3 benchmarks/bench_sparse.py --json benchmarks/results/bench_sparse_h200.json [--sweep]

Shape: Llama-3-8B decode, one layer: 32 query heads, 8 KV heads, head dim 128, bf16, 16-token
blocks, paged cache ``[num_blocks, 16, 8, 128]`` whose blocks are handed to requests in a random
order; batch 8 x 32K tokens and batch 1 x 128K tokens; 20% of the blocks kept (init window 1,
local window 4). Summary tables as the methods keep them for a bfloat16 cache on a GPU: 4-token
sub-blocks (``sparse_repr_group`` 4), ESA's means int8 with per-row scales, Quest's bounds
bfloat16.

First checks every Triton op against the reference on the GPU (fresh random inputs, a ragged
small case and both timed shapes: attention dense and on a selection, tables, scores, head mass,
every selection path); when any check fails it writes the report and stops without timing, so
no speedup is ever reported for wrong results. Then times, with CUDA events
(``triton.testing.do_bench``, median; "graph": replays of one CUDA graph):

(a) dense: the Triton ``paged_decode_attention`` over the full block table;
(b) SDPA: ``scaled_dot_product_attention`` on the same K/V made contiguous (fastest backend);
(c) ``copy_`` of a buffer the size of the K/V (read + write bandwidth);
(d) the sparse parts alone (scoring, head mass, selections, table, attention on the table);
(e) per decode step: one graph holds one scoring + selection and ``stride`` attentions, divided
    by ``stride``, for ESA at ``retrieval_stride`` 8 and 1 and Quest. Variants: "method" (what
    ESA computes on CUDA when every row re-selects: ``score_select_head_mass`` with
    ``seq_lens``, whose last launch writes the attention's table, then the attentions);
    "method_table" (the selection, then the table kernel); "sum" (scores summed over
    heads, no head mass: not a method). Speedup = dense / step, with the byte floor of each
    (dense bytes / (selected K/V + table bytes / stride)).

The timed functions are the Triton implementations (``ucm.fast.triton.sparse``) as an attention
backend calls them with validated inputs, under the default launch configuration
(``LAUNCH``); ``--sweep`` also times launch configurations passed explicitly.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import itertools
import math
import os
import platform
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

torch = pytest.importorskip("torch")

if not torch.cuda.is_available():  # CPU: the kernels run through the Triton interpreter
    from ucm.fast.triton import prepare_interpreter

    prepare_interpreter()

from ucm.sparse import ops  # noqa: E402
from _argtypes import write_json  # noqa: E402

# ---------------------------------------------------------------------------------------------
# pytest-benchmark: CPU tensors, tiny shapes, reference and fast providers

CPU_B, CPU_HQ, CPU_HKV, CPU_D, CPU_BS, CPU_M = 2, 8, 2, 32, 16, 64   # 1,024 tokens per request


def _interpreter_ready() -> tuple[bool, str]:
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed"
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    if isinstance(tl.sum, JITFunction):
        return False, "triton was imported natively in this process (no interpreter)"
    return True, ""


@pytest.fixture(params=["reference", "triton"])
def provider(request, monkeypatch):
    """The implementation timed: the reference, or the Triton kernels through the interpreter."""
    if request.param == "triton":
        ok, why = _interpreter_ready()
        if not ok:
            pytest.skip(why)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    return request.param


@pytest.fixture(scope="module")
def cpu_case():
    g = torch.Generator().manual_seed(0)
    n_phys = CPU_B * CPU_M
    k = torch.randn(n_phys, CPU_BS, CPU_HKV, CPU_D, generator=g)
    v = torch.randn(n_phys, CPU_BS, CPU_HKV, CPU_D, generator=g)
    q = torch.randn(CPU_B, CPU_HQ, CPU_D, generator=g)
    table = torch.randperm(n_phys, generator=g).reshape(CPU_B, CPU_M).to(torch.int32)
    lens = torch.tensor([CPU_M * CPU_BS, CPU_M * CPU_BS - 5], dtype=torch.int32)
    mean = torch.empty(n_phys, 4, CPU_HKV, CPU_D)
    ops.update_block_reprs(k, torch.arange(n_phys), torch.full((n_phys,), CPU_BS), mean=mean,
                           backend="reference")
    return q, k, v, table, lens, mean


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_dense_decode(benchmark, cpu_case, provider):
    """Paged decode attention over the whole table."""
    q, k, v, table, lens, _ = cpu_case
    want = ops.paged_decode_attention(q, k, v, table, lens, backend="reference")
    out = ops.paged_decode_attention(q, k, v, table, lens, backend=provider)
    assert _rel(out, want) < 2e-5                       # checked before it is timed
    benchmark(ops.paged_decode_attention, q, k, v, table, lens, backend=provider)


def test_sparse_step(benchmark, cpu_case, provider):
    """ESA's re-selecting step: per-head scores of 4-token sub-block means, head mass and
    selection at 20% with the attention's table, then the attention over it."""
    q, k, v, table, lens, mean = cpu_case
    nblk = torch.full((CPU_B,), CPU_M, dtype=torch.int32)
    budget = math.ceil(0.2 * CPU_M)

    def step(backend):
        sel, count, t, n = ops.score_select_head_mass(
            q, table, nblk, budget, kind="mean", mean=mean, scale=CPU_D ** -0.5, init_window=1,
            local_window=4, seq_lens=lens, block_size=CPU_BS, backend=backend)
        return ops.paged_decode_attention(q, k, v, t, n, backend=backend), sel, count

    want = step("reference")
    got = step(provider)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    assert _rel(got[0], want[0]) < 2e-5
    benchmark(step, provider)


# ---------------------------------------------------------------------------------------------
# script: the H200 figures

HQ, HKV, D, BS = 32, 8, 128, 16
DTYPE = torch.bfloat16
SHAPES = ((8, 32768), (1, 131072))
RATIO = 0.2
INIT_WINDOW, LOCAL_WINDOW = 1, 4
#: ESA's default ``retrieval_stride``: decode steps per scoring + selection.
STRIDE = 8
GROUPS = 4
DEV = "cuda"


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


def make_tables(k):
    """ESA's int8 sub-block means (with scales) and Quest's bf16 bounds of every cache block."""
    from ucm.fast.triton import sparse as tri

    n = k.shape[0]
    ids = torch.arange(n, dtype=torch.int32, device=k.device)
    esa = dict(mean=torch.empty(n, GROUPS, HKV, D, dtype=torch.int8, device=k.device),
               mean_scale=torch.empty(n, GROUPS, HKV, device=k.device))
    quest = {name: torch.empty(n, GROUPS, HKV, D, dtype=DTYPE, device=k.device)
             for name in ("kmin", "kmax")}
    tri.update_block_reprs(k, ids, torch.full_like(ids, BS), **esa, **quest)
    return esa, quest


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    return float((out.float() - want.float()).norm() / want.float().norm())


def close(a, b) -> float:
    """Relative max error over the finite entries (the inf pattern must agree, else inf)."""
    if not torch.equal(torch.isfinite(a), torch.isfinite(b)):
        return float("inf")
    fin = torch.isfinite(b)
    return float((a[fin] - b[fin]).abs().max() / b[fin].abs().max().clamp_min(1e-30))


def identical(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def check(report: dict) -> bool:
    """Triton vs reference on the GPU, fresh random inputs; True when every check passes."""
    from ucm.fast.triton import sparse as tri

    ok = True
    results = []
    for i, (batch, tokens, name) in enumerate([(3, 1008, "ragged small"), (8, 32768, "8 x 32K"),
                                               (1, 131072, "1 x 128K")]):
        q, k, v, table, lens = make_case(batch, tokens, seed=100 + i)
        if name == "ragged small":  # ragged lengths, partial last blocks
            lens = torch.tensor([tokens - 8, 17, tokens // 2 + 1], dtype=torch.int32, device=DEV)
        scale = D ** -0.5
        r = dict(case=name, batch=batch, tokens=tokens)
        errors = {}
        same = {}
        want = ops.paged_decode_attention(q.float(), k.float(), v.float(), table, lens,
                                          backend="reference")
        out = torch.full_like(q, float("nan"))
        tri.paged_decode_attention(q, k, v, table, lens, scale=scale, out=out)
        errors["dense_attention"] = rel_err(out, want) if not torch.isnan(out).any() else 1.0
        nblk = ((lens + BS - 1) // BS).int()
        ids = torch.arange(k.shape[0], device=DEV, dtype=torch.int32)
        full = torch.full_like(ids, BS)
        tabs = {}
        for backend in ("triton", "reference"):
            t = {n: torch.full((k.shape[0], GROUPS, HKV, D), float("nan"), dtype=DTYPE,
                               device=DEV) for n in ("mean", "kmin", "kmax")}
            ops.update_block_reprs(k, ids, full, backend=backend, **t)
            tabs[backend] = t
        # bf16 tables: at most one rounding step (2**-7 relative) apart
        r["tables_max_ulps"] = max(float(((tabs["triton"][n].float() - tabs["reference"][n].float())
                                          .abs() / tabs["reference"][n].float().abs()
                                          .clamp_min(1e-30)).max() * 2 ** 7)
                                   for n in ("mean", "kmin", "kmax"))
        t = tabs["reference"]
        for kind, kw in (("mean", dict(mean=t["mean"])),
                         ("quest", dict(kmin=t["kmin"], kmax=t["kmax"]))):
            for reduce in ("none", "sum"):
                got = ops.score_blocks(q, table, nblk, kind=kind, reduce=reduce, backend="triton",
                                       **kw)
                ref_s = ops.score_blocks(q, table, nblk, kind=kind, reduce=reduce,
                                         backend="reference", **kw)
                errors[f"score_{kind}_{reduce}"] = close(got, ref_s)
        per_head = ops.score_blocks(q, table, nblk, kind="mean", reduce="none",
                                    backend="reference", mean=t["mean"])
        hm_ref = torch.softmax(per_head * scale, -1).mean(1)
        errors["head_mass"] = close(tri.head_mass(per_head, scale), hm_ref)
        budget = max(1, math.ceil(RATIO * int(nblk.max())))
        bud = torch.full_like(nblk, budget)
        width = ops.select_width(table.shape[1], budget, INIT_WINDOW, LOCAL_WINDOW)
        sk = dict(init_window=INIT_WINDOW, local_window=LOCAL_WINDOW)
        sel_r = ops.select_blocks(hm_ref, nblk, budget, backend="reference", **sk)
        stab, slens = ops.sparse_block_table(table, lens, *sel_r, BS, backend="reference")
        # ties: the same scores rounded to 3 significant bits (many equal values)
        coarse = (hm_ref.view(torch.int32) & ~((1 << 21) - 1)).view(torch.float32)
        tie_r = ops.select_blocks(coarse, nblk, budget, backend="reference", **sk)
        # every selection path under the default launch and with the histogram selection at any
        # shape (its searches too): identical to the reference
        for tag, cfg in (("default", tri.LAUNCH),
                         ("hist", tri.LAUNCH.replace(hist_min_blocks=0, hist_max_rows=1 << 20,
                                                     mass_hist_min_blocks=0,
                                                     mass_hist_max_rows=1 << 20)),
                         ("hist_search", tri.LAUNCH.replace(hist_min_blocks=0,
                                                            hist_max_rows=1 << 20,
                                                            mass_hist_min_blocks=0,
                                                            mass_hist_max_rows=1 << 20,
                                                            hist_list=0))):
            kw = dict(sk, width=width, launch=cfg)
            same[f"select_{tag}"] = identical(tri.select_blocks(hm_ref, nblk, bud, **kw), sel_r)
            same[f"select_ties_{tag}"] = identical(tri.select_blocks(coarse, nblk, bud, **kw),
                                                   tie_r)
            same[f"select_table_{tag}"] = identical(tri.select_sparse_table(
                hm_ref, nblk, bud, table, lens, block_size=BS, **kw), (*sel_r, stab, slens))
            got = tri.select_head_mass(per_head, nblk, bud, scale=scale, block_table=table,
                                       seq_lens=lens, block_size=BS, return_mass=True, **kw)
            want_sel = ops.select_blocks(got[-1], nblk, budget, backend="reference", **sk)
            want_t = ops.sparse_block_table(table, lens, *want_sel, BS, backend="reference")
            same[f"head_mass_select_{tag}"] = identical(got[:4], (*want_sel, *want_t))
            errors[f"head_mass_select_{tag}_mass"] = close(got[-1], hm_ref)
        sp_want = ops.paged_decode_attention(q.float(), k.float(), v.float(), stab, slens,
                                             backend="reference")
        out = torch.full_like(q, float("nan"))
        tri.paged_decode_attention(q, k, v, stab, slens, scale=scale, out=out)
        errors["sparse_attention"] = rel_err(out, sp_want) if not torch.isnan(out).any() else 1.0
        errors["folded_table_attention"] = rel_err(
            tri.decode_selected(q, k, v, table, lens, *sel_r, scale=scale), sp_want)
        limits = {n: (1e-2 if "attention" in n else 1e-4 if "mass" in n else 1e-5)
                  for n in errors}
        passed = (all(errors[n] < limits[n] for n in errors) and all(same.values())
                  and r["tables_max_ulps"] <= 1.0)
        r.update(errors=errors, identical=same, passed=passed)
        ok &= passed
        results.append(r)
        print(f"check {name}: {'passed' if passed else 'FAILED'}; "
              + ", ".join(f"{n} {e:.2e}" for n, e in errors.items())
              + "; not identical: " + str([n for n, x in same.items() if not x]), flush=True)
        del k, v
        torch.cuda.empty_cache()
    report["correctness"] = results
    return ok


def bench(fn, graph: bool = False) -> float:
    """Median milliseconds (one CUDA graph's replays with ``graph``)."""
    from triton.testing import do_bench, do_bench_cudagraph

    if graph:
        return float(do_bench_cudagraph(fn, rep=100, return_mode="median"))
    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def sdpa_fastest(qs, kc, vc):
    """(backend name, ms, fn, every backend's ms or error) of the fastest SDPA backend."""
    import warnings

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
        except Exception as exc:  # a backend this build lacks: recorded, not fatal
            found[backend.name] = (None, repr(exc)[:160])
    usable = {n: x for n, x in found.items() if x[0] is not None}
    name = min(usable, key=lambda n: usable[n][0])
    return name, usable[name][0], usable[name][1], {n: x[0] if x[0] is not None else x[1]
                                                   for n, x in found.items()}


def time_shape(batch: int, tokens: int, sweep: bool = False) -> dict:
    """All timings of one shape: dense, SDPA, copy; the sparse parts; the per-step graphs."""
    from ucm.fast.triton import sparse as tri

    q, k, v, table, lens = make_case(batch, tokens, seed=11)
    scale = D ** -0.5
    splits, _ = tri.plan(batch, HKV, table.shape[1] * BS, q.device)
    kv_bytes = 2 * batch * tokens * HKV * D * k.element_size()
    io_bytes = kv_bytes + 2 * q.numel() * q.element_size() + table.numel() * 4
    res = dict(batch=batch, tokens=tokens, kv_bytes_read=kv_bytes, decode_splits=splits)

    def dense_fn():
        return tri.paged_decode_attention(q, k, v, table, lens, scale=scale)

    # (a) dense Triton, (b) SDPA on contiguous K/V, (c) a copy of as many bytes
    dense = bench(dense_fn)
    dense_graph = bench(dense_fn, graph=True)
    kc = k[table.long()].reshape(batch, tokens, HKV, D).transpose(1, 2).contiguous()
    vc = v[table.long()].reshape(batch, tokens, HKV, D).transpose(1, 2).contiguous()
    sdpa_name, sdpa, sdpa_fn, sdpa_all = sdpa_fastest(q[:, :, None, :], kc, vc)
    sdpa_err = rel_err(dense_fn(), sdpa_fn()[:, :, 0])
    del kc, vc
    torch.cuda.empty_cache()
    src = torch.empty(kv_bytes, dtype=torch.uint8, device=DEV).random_(0, 256)
    dst = torch.empty_like(src)
    copy = bench(lambda: dst.copy_(src))
    del src, dst
    torch.cuda.empty_cache()

    # (d) sparse at 20%
    m = table.shape[1]
    nblk = torch.full((batch,), m, dtype=torch.int32, device=DEV)
    esa, quest = make_tables(k)
    budget_n = math.ceil(RATIO * m)
    budget = torch.full((batch,), budget_n, dtype=torch.int32, device=DEV)
    width = ops.select_width(m, budget_n, INIT_WINDOW, LOCAL_WINDOW)
    sk = dict(init_window=INIT_WINDOW, local_window=LOCAL_WINDOW, width=width)
    kinds = {"esa": ("mean", esa), "quest": ("quest", quest)}

    def scorer(method, reduce="none", launch=tri.LAUNCH):
        kind, kw = kinds[method]
        return lambda: tri.score_blocks(q, table, nblk, kind=kind, reduce=reduce, launch=launch,
                                        **kw)

    per_head = scorer("esa")()
    summed = scorer("esa", "sum")()
    mass = tri.head_mass(per_head, scale)
    sel, count, stab, slens = tri.select_sparse_table(mass, nblk, budget, table, lens,
                                                      block_size=BS, **sk)
    parts = {
        "score_esa_per_head": scorer("esa"),
        "score_esa_sum": scorer("esa", "sum"),
        "score_quest_per_head": scorer("quest"),
        "score_quest_sum": scorer("quest", "sum"),
        "head_mass": lambda: tri.head_mass(per_head, scale),
        "select_head_mass_with_table": lambda: tri.select_head_mass(
            per_head, nblk, budget, scale=scale, block_table=table, seq_lens=lens,
            block_size=BS, **sk),
        "score_select_head_mass_with_table": lambda: tri.score_select_head_mass(
            q, table, nblk, budget, kind="mean", scale=scale, seq_lens=lens, block_size=BS,
            **esa, **sk),
        "select_with_table": lambda: tri.select_sparse_table(mass, nblk, budget, table, lens,
                                                             block_size=BS, **sk),
        "select_sum_with_table": lambda: tri.select_sparse_table(summed, nblk, budget, table,
                                                                 lens, block_size=BS, **sk),
        "table": lambda: tri.sparse_block_table(table, lens, sel, count, BS),
        "attention_table": lambda: tri.decode(q, k, v, stab, slens, scale),
        "attention_folded": lambda: tri.decode_selected(q, k, v, table, lens, sel, count,
                                                        scale=scale),
    }
    parts_graph = {name: bench(fn, graph=True) for name, fn in parts.items()}

    def step_fn(method: str, stride: int, variant: str):
        """One graph: one scoring + selection, then ``stride`` attentions (see the module
        docstring for the variants)."""
        kind, kw = kinds[method]

        def steps():
            if variant == "method":
                _, _, t, n = tri.score_select_head_mass(q, table, nblk, budget, kind=kind,
                                                        scale=scale, seq_lens=lens,
                                                        block_size=BS, **kw, **sk)
            elif variant == "method_table":
                chosen, cnt = tri.score_select_head_mass(q, table, nblk, budget, kind=kind,
                                                         scale=scale, **kw, **sk)
                t, n = tri.sparse_block_table(table, lens, chosen, cnt, BS)
            else:  # "sum": scores summed over heads in the scoring kernel, no head mass
                s = tri.score_blocks(q, table, nblk, kind=kind, reduce="sum", **kw)
                _, _, t, n = tri.select_sparse_table(s, nblk, budget, table, lens,
                                                     block_size=BS, **sk)
            for _ in range(stride):
                o = tri.decode(q, k, v, t, n, scale)
            return o
        return steps

    configs = [("esa", STRIDE), ("esa", 1), ("quest", 1)]
    per_step = {}
    for method, stride in configs:
        for variant in ("method", "method_table", "sum"):
            per_step[f"{method}_stride{stride}_{variant}"] = bench(
                step_fn(method, stride, variant), graph=True) / stride
    sel_kv = kv_bytes * budget_n / m
    row_bytes = {"esa": D + 4, "quest": 2 * 2 * D}       # int8 mean + its scale; bf16 bounds
    table_bytes = {x: batch * m * GROUPS * HKV * row_bytes[x] for x in ("esa", "quest")}
    floors = {f"{x}_stride{s}": kv_bytes / (sel_kv + table_bytes[x] / s) for x, s in configs}

    sweeps = {}
    if sweep:  # launch configurations passed explicitly; the defaults are LAUNCH's
        for block_n, warps, stages, per_sm in itertools.product((64, 128), (4, 8), (2, 3),
                                                                (2, 3, 4)):
            cfg = tri.LAUNCH.replace(decode_block_n=block_n, decode_warps=warps,
                                     decode_stages=stages, decode_programs_per_sm=per_sm)
            name = f"bn{block_n}_w{warps}_s{stages}_sm{per_sm}"
            try:
                sweeps[f"dense_{name}"] = bench(lambda: tri.paged_decode_attention(
                    q, k, v, table, lens, scale=scale, launch=cfg), graph=True)
                sweeps[f"attention_table_{name}"] = bench(lambda: tri.paged_decode_attention(
                    q, k, v, stab, slens, scale=scale, launch=cfg), graph=True)
            except Exception as exc:  # e.g. out of shared memory: a configuration, not the run
                sweeps[f"dense_{name}"] = repr(exc)[:200]
        for rows, per_sm, warps in itertools.product((32, 64, 128), (1, 2, 4), (4, 8)):
            cfg = tri.LAUNCH.replace(score_rows=rows, score_programs_per_sm=per_sm,
                                     score_warps=warps)
            sweeps[f"score_esa_rows{rows}_sm{per_sm}_w{warps}"] = bench(
                scorer("esa", launch=cfg), graph=True)

    res.update(
        ms=dict(dense=dense, dense_graph=dense_graph, sdpa=sdpa, copy=copy,
                sparse_parts_graph=parts_graph, sparse_per_step_graph=per_step),
        sweeps_graph_ms=sweeps, stride=STRIDE, groups=GROUPS,
        sdpa_backend=sdpa_name, sdpa_backends_ms=sdpa_all, dense_vs_sdpa_rel_err=sdpa_err,
        sparse_budget_blocks=budget_n, sparse_blocks=m,
        bandwidth_GBps=dict(dense_attention=io_bytes / (dense * 1e-3) / 1e9,
                            copy_read_plus_write=2 * kv_bytes / (copy * 1e-3) / 1e9),
        byte_floor_ratios=floors,
        speedups={f"dense_over_{name}": dense_graph / ms for name, ms in per_step.items()},
    )
    del k, v
    torch.cuda.empty_cache()
    return res


def kernel_resources() -> dict:
    """Registers, spills and shared memory of every compiled sparse kernel (from Triton's
    per-device caches; empty where this Triton keeps them elsewhere)."""
    from ucm.fast.triton.sparse.launch import jitted

    out = {}
    for (_, name, _), fn in jitted().items():
        try:
            for entry in getattr(fn, "device_caches", {}).values():
                cache = entry[0] if isinstance(entry, tuple) else entry
                for kernel in cache.values():
                    meta = getattr(kernel, "metadata", None)
                    out.setdefault(name, []).append(dict(
                        regs=getattr(kernel, "n_regs", None),
                        spills=getattr(kernel, "n_spills", None),
                        shared=getattr(meta, "shared", None),
                        warps=getattr(meta, "num_warps", None)))
        except Exception as exc:  # a diagnostic, not the run
            out[name] = repr(exc)[:200]
    return out


def main() -> int:
    import dataclasses

    import triton

    from ucm.fast.triton import sparse as tri

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--sweep", action="store_true",
                    help="also time decode and scoring launch configurations")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_sparse: the script needs a CUDA device (the CPU part runs under pytest)",
              file=sys.stderr)
        return 2
    report = dict(machine=dict(gpu=torch.cuda.get_device_name(), host=platform.node(),
                               torch=torch.__version__, triton=triton.__version__,
                               sms=torch.cuda.get_device_properties(0).multi_processor_count),
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  shape=dict(q_heads=HQ, kv_heads=HKV, head_dim=D, block_size=BS,
                             dtype=str(DTYPE), sparse_ratio=RATIO, init_window=INIT_WINDOW,
                             local_window=LOCAL_WINDOW, repr_groups=GROUPS,
                             esa_mean_dtype="int8", quest_dtype=str(DTYPE)),
                  launch=dataclasses.asdict(tri.LAUNCH), command=" ".join(sys.argv))
    t0 = time.time()
    if not check(report):
        report["refused"] = "a correctness check failed: no timings, no speedups"
        print("correctness check FAILED: no timings, no speedups", flush=True)
        if args.json:
            write_json(args.json, report, indent=1)
        return 1
    report["timings"] = []
    for batch, tokens in SHAPES:
        report["timings"].append(time_shape(batch, tokens, sweep=args.sweep))
        print(f"timed {batch}x{tokens}", flush=True)
    report["seconds"] = time.time() - t0
    report["kernel_resources"] = kernel_resources()
    if args.json:
        write_json(args.json, report, indent=1)
    print("\nper decode step, graph replays: dense Triton kernel / sparse at 20%; "
          "byte floor = dense bytes / (selected K/V + tables / stride)")
    for r in report["timings"]:
        ms = r["ms"]
        print(f"{r['batch']}x{r['tokens']}: dense {ms['dense_graph'] * 1e3:.1f} us (graph); SDPA "
              f"{ms['sdpa'] * 1e3:.1f} us ({r['sdpa_backend']}); dense bandwidth / copy's "
              f"{r['bandwidth_GBps']['dense_attention'] / r['bandwidth_GBps']['copy_read_plus_write']:.3f}")
        for name, t in ms["sparse_per_step_graph"].items():
            floor = r["byte_floor_ratios"]["_".join(name.split("_")[:2])]
            print(f"   {name:28s} {ms['dense_graph'] / t:5.2f}x ({t * 1e3:6.1f} us; byte floor "
                  f"{floor:.2f}x)")
        print("   parts (graph, us): " + ", ".join(f"{n} {t * 1e3:.1f}"
                                                  for n, t in ms["sparse_parts_graph"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
