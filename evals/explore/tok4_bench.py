"""Exploration (issue 20): what a per-step ranking by int4 keys costs on the H200.

Every token's key (or 2-token mean, ``--means 2``) kept in int4, symmetric per (block, KV head,
channel) with a float16 scale; one program per (request, KV head, tile of blocks) dequantizes a
few blocks' keys, takes ``q . k`` for the KV head's query heads in one ``tl.dot`` and writes each
block's log2-sum-exp per query head: ``softmax`` of that over the blocks is each block's exact
attention mass under the int4 keys (the ranking ``evals/explore/tok4.py`` measures for quality).
Selection per KV head through ``select_head_mass`` on ``[B * Hkv, G, M]``, then the sparse
decode over per-KV-head tables. Times, one CUDA graph each (Llama-3-8B decode shape of
bench_sparse.py): the dense kernel, the scoring, the selection, the decode over the selection
(A), the whole step; and ESA's default (stride 4, 2-token int8 means) in the same run.

    PYTHONPATH=. python3 evals/explore/tok4_bench.py --json $OUT/tok4_h200.json
    TRITON_INTERPRET=1 PYTHONPATH=. python evals/explore/tok4_bench.py --cpu   # correctness only
"""
import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "benchmarks"))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

LOG2E = 1.4426950408889634
#: (blocks per inner step, blocks per program, warps) of the scoring launches timed
LAUNCHES = ((4, 64, 4), (8, 64, 4), (8, 64, 8), (4, 128, 4), (8, 128, 8), (2, 32, 4),
            (16, 128, 8))


@triton.jit
def _tok4_kernel(q_ptr, codes_ptr, sc_ptr, table_ptr, nblk_ptr, out_ptr, M, per_prog,
                 scale_log2, log2_per,
                 HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                 R: tl.constexpr, NB: tl.constexpr, F32: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // HKV
    h = pid % HKV
    start = tl.program_id(1) * per_prog
    end = tl.minimum(start + per_prog, tl.load(nblk_ptr + b))
    H2: tl.constexpr = D // 2
    g = tl.arange(0, GP)
    c = tl.arange(0, H2)
    gmask = g < G
    qrow = (b * (HKV * G) + h * G + g).to(tl.int64) * D
    qlo = tl.load(q_ptr + qrow[:, None] + c[None, :], mask=gmask[:, None], other=0.0)
    qhi = tl.load(q_ptr + qrow[:, None] + H2 + c[None, :], mask=gmask[:, None], other=0.0)
    if F32:
        qlo = qlo.to(tl.float32)
        qhi = qhi.to(tl.float32)
    else:
        qlo = qlo.to(tl.bfloat16)
        qhi = qhi.to(tl.bfloat16)
    r = tl.arange(0, NB * R)
    rb = r // R
    rt = r % R
    nb = tl.arange(0, NB)
    for j0 in range(start, end, NB):
        jb = j0 + rb
        valid = jb < end
        phys = tl.load(table_ptr + b * M + jb, mask=valid, other=0).to(tl.int64)
        base = phys * HKV + h
        codes = tl.load(codes_ptr + (base * R + rt)[:, None] * H2 + c[None, :],
                        mask=valid[:, None], other=0x88)
        slo = tl.load(sc_ptr + base[:, None] * D + c[None, :], mask=valid[:, None], other=0.0)
        shi = tl.load(sc_ptr + base[:, None] * D + H2 + c[None, :], mask=valid[:, None],
                      other=0.0)
        lo = ((codes & 15).to(tl.int32) - 8).to(tl.float32) * slo.to(tl.float32)
        hi = ((codes >> 4).to(tl.int32) - 8).to(tl.float32) * shi.to(tl.float32)
        if F32:
            logit = tl.dot(lo, tl.trans(qlo), input_precision="ieee") \
                + tl.dot(hi, tl.trans(qhi), input_precision="ieee")
        else:
            logit = tl.dot(lo.to(tl.bfloat16), tl.trans(qlo)) \
                + tl.dot(hi.to(tl.bfloat16), tl.trans(qhi))
        l3 = tl.reshape(logit * scale_log2, [NB, R, GP])
        mx = tl.max(l3, 1)
        s = tl.sum(tl.exp2(l3 - mx[:, None, :]), 1)
        lse = mx + tl.log2(s) + log2_per
        jj = j0 + nb
        optr = out_ptr + (b * (HKV * G) + h * G + g).to(tl.int64)[None, :] * M + jj[:, None]
        tl.store(optr, lse, mask=(jj < end)[:, None] & gmask[None, :])


def quantize_keys(k, means: int):
    """k [n, BS, Hkv, D] -> codes [n, Hkv, BS/means, D/2] uint8 (channel c low nibble, c + D/2
    high; code + 8), scales [n, Hkv, D] float16 (symmetric, per block, head and channel)."""
    n, bs, hkv, d = k.shape
    x = k.float().permute(0, 2, 1, 3)                                  # [n, Hkv, BS, D]
    if means > 1:
        x = x.reshape(n, hkv, bs // means, means, d).mean(3)
    sc = (x.abs().amax(2) / 7).clamp_min(1e-8).half()                   # [n, Hkv, D]
    q = (x / sc.float()[:, :, None]).round().clamp(-7, 7).to(torch.int32) + 8
    codes = (q[..., : d // 2] | (q[..., d // 2:] << 4)).to(torch.uint8).contiguous()
    return codes, sc.contiguous()


def dequant(codes, sc):
    lo = (codes & 15).to(torch.int32) - 8
    hi = (codes >> 4).to(torch.int32) - 8
    return torch.cat([lo, hi], -1).float() * sc.float()[:, :, None]    # [n, Hkv, R, D]


def score_tok4(q, codes, sc, table, nblk, scale, means, nb=4, per_prog=64, out=None,
               warps=4):
    B, HQ, D = q.shape
    _, HKV, R, _ = codes.shape
    M = table.shape[1]
    if out is None:
        out = torch.full((B, HQ, M), float("-inf"), dtype=torch.float32, device=q.device)
    per_prog = max(nb, per_prog // nb * nb)
    grid = (B * HKV, triton.cdiv(M, per_prog))
    _tok4_kernel[grid](q, codes, sc, table, nblk, out, M, per_prog, scale * LOG2E,
                       math.log2(means), HKV=HKV, G=HQ // HKV, GP=max(16, HQ // HKV), D=D,
                       R=R, NB=nb, F32=os.environ.get("TRITON_INTERPRET") == "1",
                       num_warps=warps)
    return out


def score_ref(q, codes, sc, table, scale, means):
    B, HQ, D = q.shape
    _, HKV, R, _ = codes.shape
    kq = dequant(codes, sc)[table.long()]                               # [B, M, Hkv, R, D]
    qg = q.float().reshape(B, HKV, HQ // HKV, D)
    lg = torch.einsum("bhgd,bmhrd->bhgmr", qg, kq) * scale * LOG2E
    return (torch.logsumexp(lg / LOG2E, -1) * LOG2E + math.log2(means)).reshape(B, HQ, -1)


def main(argv=None):
    from bench_sparse import BS, D, HKV, HQ, INIT_WINDOW, LOCAL_WINDOW, SHAPES, bench, make_case
    from ucm.fast.triton import sparse as tri
    from ucm.sparse import ops

    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--cpu", action="store_true", help="interpreter check on a small case")
    ap.add_argument("--ratios", default="0.2,0.3")
    ap.add_argument("--dry", action="store_true", help="the GPU path on a small CPU case "
                    "under the interpreter, untimed")
    args = ap.parse_args(argv)
    dev = "cuda"
    if args.dry:
        SHAPES, dev = ((2, 2048),), "cpu"

        def bench(fn, graph=False):
            fn()
            return 1.0
    scale = D ** -0.5
    G = HQ // HKV
    if args.cpu:
        q, k, v, table, lens = make_case(2, 512, seed=3, dev="cpu")
        M = table.shape[1]
        nblk = torch.full((2,), M, dtype=torch.int32)
        for means in (1, 2):
            codes, sc = quantize_keys(k, means)
            got = score_tok4(q, codes, sc, table, nblk, scale, means, per_prog=8)
            want = score_ref(q, codes, sc, table, scale, means)
            print(f"means {means}: max |err| {float((got - want).abs().max()):.2e} "
                  f"(scores up to {float(want.abs().max()):.1f})")
        return 0
    report = dict(gpu=torch.cuda.get_device_name() if dev == "cuda" else "cpu", shapes={})
    for batch, tokens in SHAPES:
        q, k, v, table, lens = make_case(batch, tokens, seed=11, dev=dev)
        if dev == "cuda":
            torch.cuda.synchronize()
        M = table.shape[1]
        nblk = torch.full((batch,), M, dtype=torch.int32, device=q.device)
        dense = bench(lambda: tri.decode(q, k, v, table, lens, scale), graph=True)
        row = dict(dense_ms=dense, ratios={})
        table_kv = table.repeat_interleave(HKV, 0).contiguous()
        lens_kv = lens.repeat_interleave(HKV)
        nblk_kv = nblk.repeat_interleave(HKV)
        esa_tabs = dict(mean=torch.empty(k.shape[0], BS // 2, HKV, D, dtype=torch.int8,
                                         device=k.device),
                        mean_scale=torch.empty(k.shape[0], BS // 2, HKV, device=k.device))
        ids = torch.arange(k.shape[0], dtype=torch.int32, device=k.device)
        tri.update_block_reprs(k, ids, torch.full_like(ids, BS), **esa_tabs)
        for means in (1, 2):
            codes, sc = quantize_keys(k, means)
            got = score_tok4(q, codes, sc, table, nblk, scale, means)
            want = score_ref(q[:1], codes, sc, table[:1, :512], scale, means)
            err = float((got[:1, :, :512] - want).abs().max())
            row[f"m{means}_score_abs_err"] = err
            out = torch.empty(batch, HQ, M, dtype=torch.float32, device=q.device)
            for nb, pp, w in LAUNCHES:
                t = bench(lambda nb=nb, pp=pp, w=w: score_tok4(
                    q, codes, sc, table, nblk, scale, means, nb=nb, per_prog=pp, out=out,
                    warps=w), graph=True)
                row[f"m{means}_score_nb{nb}_pp{pp}_w{w}_ms"] = t
            print(f"{batch}x{tokens} means {means}: err {err:.1e}; scoring "
                  + ", ".join(f"{kk[3:]} {vv * 1e3:.1f}us" for kk, vv in row.items()
                              if kk.startswith(f"m{means}_score_nb")), flush=True)
        for ratio in [float(x) for x in args.ratios.split(",")]:
            budget_n = math.ceil(ratio * M)
            width = ops.select_width(M, budget_n, INIT_WINDOW, LOCAL_WINDOW)
            sk = dict(init_window=INIT_WINDOW, local_window=LOCAL_WINDOW, width=width)
            budget_kv = torch.full((batch * HKV,), budget_n, dtype=torch.int32, device=q.device)
            budget = torch.full((batch,), budget_n, dtype=torch.int32, device=q.device)
            cell = {}
            for means in (1, 2):
                codes, sc = quantize_keys(k, means)
                best = min(LAUNCHES, key=lambda x: row[f"m{means}_score_nb{x[0]}_pp{x[1]}_w{x[2]}_ms"])
                per_head = torch.empty(batch, HQ, M, dtype=torch.float32, device=q.device)

                def retrieve(means=means, codes=codes, sc=sc, best=best, per_head=per_head):
                    score_tok4(q, codes, sc, table, nblk, scale, means, nb=best[0],
                               per_prog=best[1], out=per_head, warps=best[2])
                    _, _, t, n = tri.select_head_mass(
                        per_head.view(batch * HKV, G, M), nblk_kv, budget_kv,
                        scale=1 / LOG2E, block_table=table_kv, seq_lens=lens_kv,
                        block_size=BS, **sk)
                    return t.view(batch, HKV, -1), n.view(batch, HKV)

                t_sel, n_sel = retrieve()
                # the selection against a float32 reference of the same scores
                mass = torch.softmax(per_head.view(batch * HKV, G, M) / LOG2E, -1).mean(1)
                rs, rc = ops.select_blocks(mass.cpu(), nblk_kv.cpu(), budget_kv.cpu(),
                                           init_window=INIT_WINDOW, local_window=LOCAL_WINDOW,
                                           backend="reference")
                sel_cnt = int(rc.sum())
                got_sets = t_sel.view(batch * HKV, -1).cpu()
                same = 0
                for i in range(batch * HKV):
                    want_b = set(table_kv[i].cpu()[rs[i, :rc[i]].long()].tolist())
                    nb_i = -(-int(n_sel.view(-1)[i]) // BS)
                    same += len(want_b & set(got_sets[i, :nb_i].tolist()))
                agree = same / max(sel_cnt, 1)
                t_score = row[f"m{means}_score_nb{best[0]}_pp{best[1]}_w{best[2]}_ms"]
                t_select = bench(lambda: tri.select_head_mass(
                    per_head.view(batch * HKV, G, M), nblk_kv, budget_kv, scale=1 / LOG2E,
                    block_table=table_kv, seq_lens=lens_kv, block_size=BS, **sk), graph=True)
                t_attn = bench(lambda: tri.decode(q, k, v, t_sel, n_sel, scale), graph=True)

                def step(retrieve=retrieve):
                    t, n = retrieve()
                    return tri.decode(q, k, v, t, n, scale)

                t_step = bench(step, graph=True)
                cell[f"tok4 m{means}"] = dict(score_ms=t_score, select_ms=t_select,
                                              attn_ms=t_attn, step_ms=t_step,
                                              speedup=dense / t_step, agreement=agree,
                                              launch=best)
                print(f"{batch}x{tokens} r{ratio} tok4 m{means}: step {t_step * 1e3:.1f}us "
                      f"({dense / t_step:.2f}x) = score {t_score * 1e3:.1f} + select "
                      f"{t_select * 1e3:.1f} + attn {t_attn * 1e3:.1f}; agreement {agree:.4f}",
                      flush=True)
            # ESA's default in the same run: stride 4, 2-token int8 means, one selection
            def esa_ret():
                _, _, t, n = tri.score_select_head_mass(
                    q, table, nblk, budget, kind="mean", scale=scale, seq_lens=lens,
                    block_size=BS, **esa_tabs, **sk)
                return t, n

            te, ne = esa_ret()
            t_esa_attn = bench(lambda: tri.decode(q, k, v, te, ne, scale), graph=True)
            t_esa_ret = bench(esa_ret, graph=True)

            def esa_step():
                t, n = esa_ret()
                for _ in range(4):
                    o = tri.decode(q, k, v, t, n, scale)
                return o

            t_esa = bench(esa_step, graph=True) / 4
            cell["esa default"] = dict(step_ms=t_esa, speedup=dense / t_esa,
                                       retrieval_ms=t_esa_ret, attn_ms=t_esa_attn)
            print(f"{batch}x{tokens} r{ratio} esa stride 4: {t_esa * 1e3:.1f}us "
                  f"({dense / t_esa:.2f}x); retrieval {t_esa_ret * 1e3:.1f}, attn "
                  f"{t_esa_attn * 1e3:.1f}; dense {dense * 1e3:.1f}", flush=True)
            row["ratios"][str(ratio)] = cell
        report["shapes"][f"{batch}x{tokens}"] = row
        del q, k, v
        if dev == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
