"""What the block-id read-back added to SparseMethod.attention_begin costs on CUDA (exploration).

The default ESA method at ratio 0.2, Llama-3-8B decode shape (32 query heads on 8 KV heads of
128, 16-token blocks), 8 x 32K tokens. Each decode step calls attention_begin for every layer;
time per call with the check as shipped, and with the check's tensor replaced by a Python False
(no read-back), in the same process, alternating, and the dense Triton decode kernel beside.
"""
import json
import sys
import time

import torch

import ucm.sparse
from ucm.sparse import ops

B, T, HQ, HKV, D, BS, LAYERS = 8, 32768, 32, 8, 128, 16, 4


def run(steps: int) -> float:
    m = ucm.sparse.create({"sparse_method": "esa", "sparse_ratio": 0.2, "sparse_dense_layers": 0}, num_layers=LAYERS,
                          num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, block_size=BS,
                          device="cuda")
    nb = T // BS
    k = torch.randn(B * nb + 64, BS, HKV, D, device="cuda", dtype=torch.bfloat16)
    table = torch.arange(B * nb, device="cuda", dtype=torch.int32).view(B, nb)
    ids = [f"r{i}" for i in range(B)]
    for r in ids:
        m.request_begin(r, T - 1)
    lens = torch.full((B,), T - 1, device="cuda", dtype=torch.int32)
    q = torch.randn(B, HQ, D, device="cuda", dtype=torch.bfloat16)
    for layer in range(LAYERS):          # the prompt's summaries
        m.attention_begin(layer, ids, q, k, table, lens)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for s in range(steps):
        for layer in range(LAYERS):
            m.attention_begin(layer, ids, q, k, table, lens)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (steps * LAYERS) * 1e6


def main():
    shipped = ops._ids_used_out_of_range
    run(4)
    res = {"with_check_us": [], "without_check_us": []}
    for _ in range(5):
        ops._ids_used_out_of_range = shipped
        res["with_check_us"].append(run(16))
        ops._ids_used_out_of_range = lambda *a: False
        res["without_check_us"].append(run(16))
    ops._ids_used_out_of_range = shipped
    w, wo = min(res["with_check_us"]), min(res["without_check_us"])
    res["ratio_with_over_without"] = w / wo
    res["device"] = torch.cuda.get_device_name()
    print(json.dumps(res, indent=1))
    if len(sys.argv) > 1:
        json.dump(res, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
