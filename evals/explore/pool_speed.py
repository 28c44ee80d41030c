"""Exploration: PyTorch formulations of pool_head_budgets on the GPU (both Pareto shapes)."""
import sys, os, json
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import torch
from triton.testing import do_bench_cudagraph
from ucm.reference.sparse import pool_head_budgets, forced_mask

def topk_version(shares, nblk, budget, cap, iw, lw, per_n):
    B, H, M = shares.shape
    forced = forced_mask(nblk, M, iw, lw)
    j = torch.arange(M, device=shares.device)[None, :]
    free = (j < nblk.long()[:, None]) & ~forced
    f = forced.sum(1)
    s = torch.where(free[:, None, :], shares, float("-inf"))
    room = cap * per_n - 3   # static (uniform budget): windows count 3 here
    top = torch.topk(s, room, dim=2, sorted=False).values             # [B, H, room]
    extra = H * (per_n - 3)
    thr = torch.topk(top.reshape(B, -1), extra, dim=1, sorted=False).values.min(1).values
    counts = (top >= thr[:, None, None]).sum(2)
    return torch.minimum(counts + f[:, None], nblk.long()[:, None]).to(torch.int32)

out = {"gpu": torch.cuda.get_device_name()}
for B, M in ((8, 2048), (1, 8192)):
    H = 8
    g = torch.Generator(device="cuda").manual_seed(0)
    shares = torch.softmax(torch.randn(B, H, M, device="cuda", generator=g) * 3, -1)
    nblk = torch.full((B,), M, dtype=torch.int32, device="cuda")
    per_n = -(-2 * M // 10)
    budget = torch.full((B,), per_n, dtype=torch.int32, device="cuda")
    a = pool_head_budgets(shares, nblk, budget, cap=2, init_window=1, local_window=2)
    b = topk_version(shares, nblk, budget, 2, 1, 2, per_n)
    t_a = do_bench_cudagraph(lambda: pool_head_budgets(shares, nblk, budget, cap=2, init_window=1, local_window=2))
    t_b = do_bench_cudagraph(lambda: topk_version(shares, nblk, budget, 2, 1, 2, per_n))
    t_sm = do_bench_cudagraph(lambda: torch.softmax(shares, -1))
    out[f"{B}x{M}"] = dict(reference_ms=t_a, topk_ms=t_b, softmax_ms=t_sm, same=bool(torch.equal(a, b)))
    print(B, M, out[f"{B}x{M}"], flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
