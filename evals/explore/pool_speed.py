"""Exploration: pool_head_budgets on the GPU, the Triton kernel (a sweep of its warps and tile)
against the PyTorch reference, both Pareto shapes; exact equality checked."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import torch  # noqa: E402
from triton.testing import do_bench_cudagraph  # noqa: E402

from ucm.fast.triton import sparse as tri  # noqa: E402
from ucm.reference.sparse import pool_head_budgets as ref  # noqa: E402

out = {"gpu": torch.cuda.get_device_name()}
for B, M in ((8, 2048), (1, 8192), (4, 8192)):
    H = 8
    g = torch.Generator(device="cuda").manual_seed(0)
    shares = torch.softmax(torch.randn(B, H, M, device="cuda", generator=g) * 3, -1)
    ties = torch.randint(0, 5, (B, H, M), device="cuda", generator=g).float()
    nblk = torch.full((B,), M, dtype=torch.int32, device="cuda")
    per = -(-2 * M // 10)
    budget = torch.full((B,), per, dtype=torch.int32, device="cuda")
    kw = dict(cap=2, init_window=1, local_window=4)
    row = {"reference_ms": do_bench_cudagraph(lambda: ref(shares, nblk, budget, **kw))}
    for w in (4, 8, 16):
        for te in (2048, 4096):
            cfg = tri.LAUNCH.replace(pool_warps=w, pool_tile_elems=te)
            same = all(torch.equal(tri.pool_head_budgets(x, nblk, budget, launch=cfg, **kw),
                                   ref(x, nblk, budget, **kw)) for x in (shares, ties))
            row[f"w{w}_t{te}"] = do_bench_cudagraph(
                lambda cfg=cfg: tri.pool_head_budgets(shares, nblk, budget, launch=cfg, **kw)) \
                if same else "differs"
    out[f"{B}x{M}"] = row
    print(B, M, {k: (round(v * 1e3, 1) if isinstance(v, float) else v) for k, v in row.items()},
          flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
