"""Exploration (issue 20): launch constants of ``score_token_mass`` on the device, both Pareto
shapes, and the parts of a ``mass`` per-KV-head step (scoring, selection, sparse decode) at 0.2.

    PYTHONPATH=. python3 evals/explore/mass_sweep.py $OUT/mass_sweep.json
"""
import itertools
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "benchmarks"))

import torch  # noqa: E402

from bench_sparse import BS, D, HKV, HQ, INIT_WINDOW, LOCAL_WINDOW, SHAPES, bench, make_case  # noqa: E402
from ucm.fast.triton import sparse as tri  # noqa: E402
from ucm.sparse import ops  # noqa: E402


def main(out_path):
    report = {"gpu": torch.cuda.get_device_name()}
    scale = D ** -0.5
    for batch, tokens in SHAPES:
        q, k, v, table, lens = make_case(batch, tokens, seed=11)
        torch.cuda.synchronize()
        M = table.shape[1]
        n = k.shape[0]
        nblk = torch.full((batch,), M, dtype=torch.int32, device=q.device)
        keys4 = torch.empty(n, HKV, BS, D // 2, dtype=torch.uint8, device=q.device)
        scale4 = torch.empty(n, HKV, D, dtype=torch.float16, device=q.device)
        tri.quantize_token_keys(k, torch.arange(n, dtype=torch.int32, device=q.device),
                                keys4=keys4, scale4=scale4)
        want = tri.score_token_mass(q, table, nblk, keys4=keys4, scale4=scale4, scale=scale)
        rows = {}
        for r, bpp, w in itertools.product((32, 64, 128), (16, 64), (4, 8)):
            cfg = tri.LAUNCH.replace(score_mass_rows=r, score_mass_blocks_per_program=bpp,
                                     score_mass_warps=w)
            try:
                got = tri.score_token_mass(q, table, nblk, keys4=keys4, scale4=scale4,
                                           scale=scale, launch=cfg)
                if not torch.allclose(got, want, atol=1e-3, rtol=1e-3):
                    rows[f"r{r}_b{bpp}_w{w}"] = "differs"
                    continue
                rows[f"r{r}_b{bpp}_w{w}"] = bench(lambda cfg=cfg: tri.score_token_mass(
                    q, table, nblk, keys4=keys4, scale4=scale4, scale=scale, launch=cfg),
                    graph=True)
            except Exception as exc:  # noqa: BLE001  (a configuration that does not fit)
                rows[f"r{r}_b{bpp}_w{w}"] = repr(exc)[:100]
        timed = {a: b for a, b in rows.items() if isinstance(b, float)}
        best = sorted(timed, key=timed.get)[:5]
        dense = bench(lambda: tri.decode(q, k, v, table, lens, scale), graph=True)
        copy_src = torch.empty(keys4.numel() + 2 * scale4.numel(), dtype=torch.uint8,
                               device=q.device)
        copy_dst = torch.empty_like(copy_src)
        t_copy = bench(lambda: copy_dst.copy_(copy_src), graph=True)
        parts = {}
        per_head = want
        for ratio in (0.2, 0.3):
            budget_n = math.ceil(ratio * M)
            sk = dict(init_window=INIT_WINDOW, local_window=LOCAL_WINDOW,
                      width=ops.select_width(M, budget_n, INIT_WINDOW, LOCAL_WINDOW))
            nk = nblk.repeat_interleave(HKV)
            bk = torch.full((batch * HKV,), budget_n, dtype=torch.int32, device=q.device)
            tk = table.repeat_interleave(HKV, 0)
            lk = lens.repeat_interleave(HKV)

            def select():
                return tri.select_head_mass(per_head.view(batch * HKV, HQ // HKV, M), nk, bk,
                                            scale=scale, block_table=tk, seq_lens=lk,
                                            block_size=BS, **sk)

            _, _, t, nn = select()
            t, nn = t.view(batch, HKV, -1), nn.view(batch, HKV)
            parts[str(ratio)] = dict(
                select_ms=bench(select, graph=True),
                attn_ms=bench(lambda: tri.decode(q, k, v, t, nn, scale), graph=True))
        key = f"{batch}x{tokens}"
        report[key] = dict(scoring_ms=rows, best=best, dense_ms=dense,
                           copy_table_bytes_ms=t_copy, parts=parts,
                           table_bytes=copy_src.numel())
        print(f"{key}: scoring best " + ", ".join(f"{a} {timed[a] * 1e3:.1f}us" for a in best)
              + f"; a device copy of the table's bytes {t_copy * 1e3:.1f}us; dense "
              f"{dense * 1e3:.1f}us; parts " + json.dumps({r: {a: round(b * 1e3, 1) for a, b in
                                                              p.items()} for r, p in
                                                          parts.items()}), flush=True)
        del q, k, v, keys4, scale4
        torch.cuda.empty_cache()
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
