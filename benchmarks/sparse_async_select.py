"""How much of the re-selection could hide behind the attention (H200 diagnostic, one run).

At 1 x 128K the attention on a 20% table already reads its bytes as fast as a plain read of as
many contiguous bytes (``sparse_attn_launch.py``), so an ESA stride-8 step can only get faster by
making the re-selection (scoring, head mass, selection, table) cheaper or by running it beside
the attention. This script times, as CUDA graph replays (median, microseconds per decode step):

- ``serial``: what ESA does now: scoring + selection + table, then ``stride`` attentions on it;
- ``overlap_first``: the selection on a second stream beside the first attention (which uses the
  previous selection; the new table is used from the next step on), then ``stride - 1`` more;
- ``overlap_all``: the selection beside all ``stride`` attentions (the most it could hide);
- with ``--groups 4,2``, the serial step on G = 2 bf16 tables too (half the scoring bytes, in a
  step whose attention evicts the table from L2);
- the serial step on int8 G = 4 means with per-row scales (``ops.quantize_rows``; half the
  scoring bytes), its selection checked against the reference's on the same int8 table and
  compared with the bfloat16 table's;
- with ``--select-sweep``, the int8 step over the selection's knobs (per-head log-sum-exp in
  parts ``LSE_SPAN`` and its warps, 16,384 or 4,096 histogram bins), each selection checked
  against the reference's first;
- the dense attention, and a contiguous read (``sum``) of several sizes: the read ceiling as a
  function of bytes, which bounds the sparse attention.

An ESA that applies each new selection one step later is a change of the method (and of its
reference), not made here: these figures say whether it is worth it.

    PYTHONPATH=. python3 benchmarks/sparse_async_select.py [--json PATH] [--groups 4,2] [--select-sweep]
"""
from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.gpu_diag import BS, HKV, D, graph_us as bench, header, make_case, \
    write_json  # noqa: E402
from ucm.fast.triton import sparse as tri  # noqa: E402
from ucm.sparse import ops  # noqa: E402

G = 4
RATIO, STRIDE, INIT, LOCAL = 0.2, 8, 1, 4


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--groups", default="4", help="sub-block summaries per block to time, e.g. "
                    "4,2 (G = 2 in bf16 reads the bytes of 8-bit G = 4 tables)")
    ap.add_argument("--int8-sweep", action="store_true",
                    help="also time the int8 scoring and step over scoring launch shapes")
    ap.add_argument("--async-sweep", action="store_true",
                    help="also time ESA's step on int8 tables with the table folded into the "
                    "selection, serial and with the asynchronous retrieval (esa_async_retrieval), "
                    "over stream priority and histogram bins")
    ap.add_argument("--select-sweep", action="store_true",
                    help="also time the int8 step over selection knobs (log-sum-exp in parts "
                    "LSE_SPAN, its warps, histogram bins), each checked against the reference")
    args = ap.parse_args()
    dev = "cuda"
    report = header(shapes={}, read_ceiling_us={})
    for mb in (16, 32, 64, 107, 215, 537):
        x = torch.empty(mb * 1000 * 1000 // 2, dtype=torch.bfloat16, device=dev).normal_()
        report["read_ceiling_us"][mb] = us = bench(lambda: x.sum())
        print(f"contiguous read {mb} MB: {us:.1f} us ({mb / us:.2f} TB/s)", flush=True)
        del x
    scale = D ** -0.5
    side = torch.cuda.Stream()
    for batch, tokens in ((1, 131072), (8, 32768)):
        m = tokens // BS
        q, k, v, table, lens = make_case(batch, tokens, seed=5)
        n_phys = k.shape[0]
        nblk = torch.full((batch,), m, dtype=torch.int32, device=dev)
        ids = torch.arange(n_phys, dtype=torch.int32, device=dev)
        means = {}
        for g in (int(x) for x in args.groups.split(",")):
            means[g] = torch.empty(n_phys, g, HKV, D, dtype=torch.bfloat16, device=dev)
            tri.update_block_reprs(k, ids, torch.full_like(ids, BS), mean=means[g])
        mean = means[G]
        budget_n = math.ceil(RATIO * m)
        budget = torch.full((batch,), budget_n, dtype=torch.int32, device=dev)
        width = ops.select_width(m, budget_n, INIT, LOCAL)

        def reselect():
            sel, count = tri.score_select_head_mass(q, table, nblk, budget, kind="mean",
                                                    scale=scale, init_window=INIT,
                                                    local_window=LOCAL, width=width, mean=mean)
            return tri.sparse_block_table(table, lens, sel, count, BS)

        t_prev, n_prev = reselect()            # "the previous step's" selection
        t_new, n_new = reselect()
        want = ops.paged_decode_attention(q.float(), k.float(), v.float(), t_new, n_new,
                                          backend="reference")
        got = tri.decode(q, k, v, t_new, n_new, scale)
        err = float((got.float() - want).norm() / want.norm())
        print(f"{batch}x{tokens}: attention on the selection, rel err {err:.2e}", flush=True)
        if not err < 1e-2:
            return 1

        def attend(t, n, times):
            o = None
            for _ in range(times):
                o = tri.decode(q, k, v, t, n, scale)
            return o

        def serial():
            t, n = reselect()
            return attend(t, n, STRIDE)

        def overlapped(beside: int):
            def run():
                main = torch.cuda.current_stream()
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    t, n = reselect()
                attend(t_prev, n_prev, beside)
                main.wait_stream(side)
                return attend(t, n, STRIDE - beside)
            return run

        dense = bench(lambda: tri.decode(q, k, v, table, lens, scale))
        row = {"dense_us": dense,
               "attention_us": bench(lambda: attend(t_prev, n_prev, 1)),
               "reselect_us": bench(reselect),
               "serial_step_us": bench(serial) / STRIDE,
               "overlap_first_step_us": bench(overlapped(1)) / STRIDE,
               "overlap_all_step_us": bench(overlapped(STRIDE)) / STRIDE}
        row.update({f"dense_over_{k_[:-3]}": dense / v_ for k_, v_ in list(row.items())
                    if k_.endswith("step_us")})
        for g, mg in means.items():   # the serial step on other tables (same selection code)
            if g == G:
                continue

            def serial_g(mg=mg):
                sel, count = tri.score_select_head_mass(
                    q, table, nblk, budget, kind="mean", scale=scale, init_window=INIT,
                    local_window=LOCAL, width=width, mean=mg)
                return attend(*tri.sparse_block_table(table, lens, sel, count, BS), STRIDE)
            row[f"serial_step_g{g}_us"] = us = bench(serial_g) / STRIDE
            row[f"dense_over_serial_step_g{g}"] = dense / us
        # int8 G = 4 means with per-row scales, as the methods keep them (update_block_reprs
        # quantizes the float32 sub-block means; sparse_repr_dtype auto on a GPU)
        qmean = torch.empty(n_phys, G, HKV, D, dtype=torch.int8, device=dev)
        qscale = torch.empty(n_phys, G, HKV, dtype=torch.float32, device=dev)
        tri.update_block_reprs(k, ids, torch.full_like(ids, BS), mean=qmean, mean_scale=qscale)

        def serial_int8():
            sel, count = tri.score_select_head_mass(
                q, table, nblk, budget, kind="mean", scale=scale, init_window=INIT,
                local_window=LOCAL, width=width, mean=qmean, mean_scale=qscale)
            return attend(*tri.sparse_block_table(table, lens, sel, count, BS), STRIDE)
        ref_int8 = ops.score_select_head_mass(q, table, nblk, budget, kind="mean", scale=scale,
                                              init_window=INIT, local_window=LOCAL, mean=qmean,
                                              mean_scale=qscale, backend="reference")
        fast_int8 = tri.score_select_head_mass(q, table, nblk, budget, kind="mean", scale=scale,
                                               init_window=INIT, local_window=LOCAL, width=width,
                                               mean=qmean, mean_scale=qscale)
        bf16_sel = tri.score_select_head_mass(q, table, nblk, budget, kind="mean", scale=scale,
                                              init_window=INIT, local_window=LOCAL, width=width,
                                              mean=mean)
        row["int8_selection_equals_reference"] = bool(
            torch.equal(ref_int8[0], fast_int8[0]) and torch.equal(ref_int8[1], fast_int8[1]))
        row["int8_selection_share_of_bf16"] = float(sum(
            len(set(fast_int8[0][b, :int(fast_int8[1][b])].tolist())
                & set(bf16_sel[0][b, :int(bf16_sel[1][b])].tolist())) / int(bf16_sel[1][b])
            for b in range(batch)) / batch)
        row["serial_step_int8_us"] = us = bench(serial_int8) / STRIDE
        row["dense_over_serial_step_int8"] = dense / us
        def serial_int8_fast():  # the table folded into the selection's last launch
            s_ = tri.score_blocks(q, table, nblk, kind="mean", reduce="none", mean=qmean,
                                  mean_scale=qscale)
            _, _, t_, n_ = tri.select_head_mass(s_, nblk, budget, scale=scale, init_window=INIT,
                                                local_window=LOCAL, width=width,
                                                block_table=table, seq_lens=lens, block_size=BS)
            return attend(t_, n_, STRIDE)
        row["serial_step_int8_fast_us"] = us = bench(serial_int8_fast) / STRIDE
        row["dense_over_serial_step_int8_fast"] = dense / us
        bits = tri.SELECT_HIST_BITS
        tri.SELECT_HIST_BITS = 12                     # 4,096 histogram bins instead of 16,384
        try:
            row["serial_step_int8_fast_bins12_us"] = us = bench(serial_int8_fast) / STRIDE
            row["dense_over_serial_step_int8_fast_bins12"] = dense / us
        finally:
            tri.SELECT_HIST_BITS = bits
        if args.async_sweep:  # what ESA runs now: int8 tables, the table folded in
            fold = dict(seq_lens=lens, block_size=BS)
            high = torch.cuda.Stream(priority=torch.cuda.Stream.priority_range()[1])

            def esa_step(lag: int, stream, splits=None):
                def run():
                    sel_kw = dict(kind="mean", scale=scale, init_window=INIT, local_window=LOCAL,
                                  width=width, mean=qmean, mean_scale=qscale, **fold)
                    if not lag:
                        return attend(*tri.score_select_head_mass(
                            q, table, nblk, budget, **sel_kw)[2:], STRIDE)
                    main = torch.cuda.current_stream()
                    stream.wait_stream(main)
                    with torch.cuda.stream(stream):
                        t, n = tri.score_select_head_mass(q, table, nblk, budget, **sel_kw)[2:]
                    for _ in range(lag):   # beside the retrieval, on fewer slices if asked
                        tri.decode(q, k, v, t_prev, n_prev, scale,
                                   num_splits=None if splits == "beside" else splits,
                                   beside=splits == "beside")
                    main.wait_stream(stream)
                    return attend(t, n, STRIDE - lag)
                return run
            bits = tri.SELECT_HIST_BITS
            for bits_ in (14, 12):
                tri.SELECT_HIST_BITS = bits_
                for name, lag, stream in (("serial", 0, None), ("async", 1, side),
                                          ("async_high", 1, high), ("async_lag2", 2, side)):
                    row[f"esa_{name}_bits{bits_}_step_us"] = us = bench(
                        esa_step(lag, stream)) / STRIDE
                    row[f"dense_over_esa_{name}_bits{bits_}"] = dense / us
            tri.SELECT_HIST_BITS = bits
            default_splits = tri.plan(batch, HKV, t_prev.shape[1] * BS, q.device)[0]
            row["attention_default_splits"] = default_splits
            for splits in (48, 40, 32, 24, 16, 8, "beside"):   # the attention beside the retrieval
                row[f"esa_async_splits{splits}_step_us"] = us = bench(
                    esa_step(1, side, splits)) / STRIDE
                row[f"dense_over_esa_async_splits{splits}"] = dense / us
            row["dense_us_after_async_sweep"] = bench(lambda: tri.decode(q, k, v, table, lens,
                                                                         scale))
        if args.select_sweep:  # selection knobs on the int8 step, "method" path and "fast"
            saved = {name: getattr(tri, name) for name in ("LSE_SPAN", "LSE_SPAN_WARPS",
                                                           "SELECT_HIST_BITS")}
            for span, warps, bits_ in ((0, 8, 14), (2048, 8, 14), (1024, 8, 14), (1024, 4, 14),
                                       (512, 4, 14), (256, 2, 14), (0, 8, 12), (1024, 4, 12),
                                       (512, 4, 12), (256, 2, 12)):
                tri.LSE_SPAN, tri.LSE_SPAN_WARPS, tri.SELECT_HIST_BITS = span, warps, bits_
                key = f"span{span}_warps{warps}_bits{bits_}"
                got = tri.score_select_head_mass(q, table, nblk, budget, kind="mean",
                                                 scale=scale, init_window=INIT,
                                                 local_window=LOCAL, width=width, mean=qmean,
                                                 mean_scale=qscale)
                row[f"sel_{key}_equals_reference"] = ok = bool(
                    torch.equal(ref_int8[0], got[0]) and torch.equal(ref_int8[1], got[1]))
                if not ok:
                    print(f"{key}: selection differs from the reference", flush=True)
                    return 1
                row[f"sel_{key}_step_us"] = bench(serial_int8) / STRIDE
                row[f"sel_{key}_fast_step_us"] = bench(serial_int8_fast) / STRIDE
                row[f"sel_{key}_reselect_us"] = bench(lambda: tri.sparse_block_table(
                    table, lens, *tri.score_select_head_mass(
                        q, table, nblk, budget, kind="mean", scale=scale, init_window=INIT,
                        local_window=LOCAL, width=width, mean=qmean, mean_scale=qscale), BS))
            for name, value in saved.items():
                setattr(tri, name, value)
            row["dense_us_after_sweep"] = bench(lambda: tri.decode(q, k, v, table, lens, scale))
        if args.int8_sweep:  # scoring launch shapes for the int8 table (half the bytes per row)
            saved = (tri.SCORE_ROWS, tri.SCORE_PROGRAMS_PER_SM, tri.SCORE_LOOP_STAGES,
                     tri.SCORE_WARPS)
            for rows_, per_sm, stages, warps in ((64, 2, 3, 4), (128, 1, 3, 4), (256, 1, 3, 4),
                                                 (64, 4, 3, 4), (64, 2, 2, 4), (64, 2, 4, 4),
                                                 (128, 1, 3, 8), (64, 2, 0, 4)):
                (tri.SCORE_ROWS, tri.SCORE_PROGRAMS_PER_SM, tri.SCORE_LOOP_STAGES,
                 tri.SCORE_WARPS) = rows_, per_sm, stages, warps
                key = f"rows{rows_}_persm{per_sm}_stages{stages}_warps{warps}"
                try:
                    row[f"int8_score_{key}_us"] = bench(lambda: tri.score_blocks(
                        q, table, nblk, kind="mean", reduce="none", mean=qmean,
                        mean_scale=qscale))
                    row[f"int8_step_{key}_us"] = bench(serial_int8) / STRIDE
                    row[f"bf16_score_{key}_us"] = bench(lambda: tri.score_blocks(
                        q, table, nblk, kind="mean", reduce="none", mean=mean))
                except Exception as exc:  # a launch shape that does not fit: recorded
                    row[f"int8_{key}_error"] = repr(exc)[:200]
            (tri.SCORE_ROWS, tri.SCORE_PROGRAMS_PER_SM, tri.SCORE_LOOP_STAGES,
             tri.SCORE_WARPS) = saved
        report["shapes"][f"{batch}x{tokens}"] = row
        print(f"{batch}x{tokens}: " + ", ".join(f"{k_} {v_:.2f}" for k_, v_ in row.items()),
              flush=True)
        del k, v, mean, means, qmean, qscale
        torch.cuda.empty_cache()
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
