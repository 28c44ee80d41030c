"""Selection quality at 32K-128K tokens from SmolLM2's own queries, keys and values.

SmolLM2-135M stops at 8K tokens, so the perplexity harness (``evals/sparse_quality.py``) cannot
reach the lengths the speed figures are measured at. This script records what one real 8K
context gives a few of SmolLM2's layers (keys and values of every position before RoPE, and the
queries of teacher-forced decode steps after it), then builds longer contexts from them and
runs each sparse method on them through its real code (``ucm.sparse.create`` and
``attention_begin``, the Triton ops on a GPU), step by step as a decode would:

    # CPU (needs the model): writes benchmarks/results/sparse_longctx_record.pt (about 35 MB)
    .venv/bin/python evals/sparse_longctx.py record
    # any device (the H200 for the figures):
    PYTHONPATH=. python3 evals/sparse_longctx.py measure --json benchmarks/results/sparse_longctx_h200.json

**Longer contexts.** The 8K context's keys and values are tiled to ``N`` tokens (position ``p``
holds the token of position ``p mod 8192``) and rotated with SmolLM2's RoPE at their new
positions; the decode steps' own keys follow at ``N, N + 1, ...`` and their queries are rotated
at those positions. So the contents are real SmolLM2 activations and the positions are those of
a long context; what is not real is the text (it repeats) and the model's behaviour past its
training length (queries were computed from an 8K history).

**Metrics** per (method, length, ratio), over the recorded layers and steps: the exact softmax
mass of the attended tokens (averaged over query heads; 1.0 = dense), the relative L2 error of
the attention output against dense attention over the whole context, and the worst step's
error. The ``oracle`` baseline keeps the blocks of largest exact mass (shared over heads).
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from evals import argtypes  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORD = os.path.join(REPO, "benchmarks", "results", "sparse_longctx_record.pt")
LAYERS = (1, 6, 11, 16, 21, 26)
BS = 16
#: method names as the quality harness spells them (evals.sparse_model.method_variant)
METHODS = ("esa:g4+s8", "esa:g2+s1", "esa:g2+s2", "esa:g2+s4", "quest", "quest:kvhead+g2",
           "oracle")


def rotate(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """RoPE (the rotate-half form SmolLM2 uses) of ``x [N, H, D]`` at positions ``pos [N]``."""
    ang = pos.to(torch.float64)[:, None] * inv_freq.to(torch.float64)[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    cos, sin = ang.cos().float()[:, None, :], ang.sin().float()[:, None, :]
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


# ---------------------------------------------------------------------------------------------
# record (CPU, the model)

@torch.inference_mode()
def record(context: int, steps: int, offset: int, out: str) -> None:
    from ucm.reference.llama import Llama, _rms_norm
    from evals.sparse_quality import corpus_ids
    from ucm.models import ensure_smollm2

    path = ensure_smollm2()
    model = Llama.load(path)
    ids = corpus_ids(path)[offset:offset + context + steps]
    if len(ids) < context + steps:
        raise SystemExit(f"the corpus has no {context + steps} tokens after offset {offset}")
    n = len(ids)
    pos = torch.arange(n)
    Hq, Hkv, D = model.num_q_heads, model.num_kv_heads, model.head_dim
    h = model.embed[torch.tensor(ids)]
    layers = {}
    for li, layer in enumerate(model.layers):
        x = _rms_norm(h, layer["ln1"], model.eps)
        q, k, v = (x @ layer["qkv"]).split([Hq * D, Hkv * D, Hkv * D], dim=-1)
        q, k, v = q.reshape(n, Hq, D), k.reshape(n, Hkv, D), v.reshape(n, Hkv, D)
        if li in LAYERS:
            layers[li] = dict(k=k.half().clone(), v=v.half().clone(),
                              q=q[context:].half().clone())
        qr, kr = model._rope(q, pos), model._rope(k, pos)
        h = model._finish_layer(layer, h, model._causal(qr, kr, v))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    torch.save(dict(layers=layers, context=context, steps=steps, offset=offset,
                    inv_freq=model.inv_freq.float(), num_q_heads=Hq, num_kv_heads=Hkv,
                    head_dim=D), out)
    print(f"recorded layers {list(layers)} of a {context}-token context + {steps} steps "
          f"-> {out} ({os.path.getsize(out) / 2**20:.1f} MiB)")


# ---------------------------------------------------------------------------------------------
# measure (any device)

def extended(rec: dict, layer: int, length: int, dev, dtype):
    """(q [T, Hq, D], k [length + T, Hkv, D], v) of ``layer`` at context ``length``, RoPE
    applied at the new positions (see the module docstring)."""
    L, T = rec["context"], rec["steps"]
    x = rec["layers"][layer]
    src = torch.cat([torch.arange(length) % L, L + torch.arange(T)])
    pos = torch.arange(length + T)
    inv = rec["inv_freq"]
    k = rotate(x["k"].float()[src].to(dev), pos.to(dev), inv.to(dev))
    v = x["v"].float()[src].to(dev)
    q = rotate(x["q"].float().to(dev), (length + torch.arange(T)).to(dev), inv.to(dev))
    return q.to(dtype), k.to(dtype), v.to(dtype)


def dense_steps(q, k, v, length: int, scale: float) -> list:
    """Per decode step ``t`` (context ``length + t + 1``): the dense output [Hq, D] and the
    per-head probabilities [Hq, n], float32."""
    Hq, Hkv = q.shape[1], k.shape[1]
    kk = k.float().repeat_interleave(Hq // Hkv, 1)                # [N, Hq, D]
    vv = v.float().repeat_interleave(Hq // Hkv, 1)
    out = []
    for t in range(q.shape[0]):
        n = length + t + 1
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[t].float(), kk[:n]) * scale, -1)
        out.append((torch.einsum("hn,nhd->hd", p, vv[:n]), p))
    return out, vv


def run_method(name: str, ratio: float, rec: dict, data: dict, length: int, dev, dtype) -> dict:
    """One method at one ratio over every recorded layer and step (one request per layer)."""
    from evals.sparse_model import method_variant

    Hq, Hkv, D, T = rec["num_q_heads"], rec["num_kv_heads"], rec["head_dim"], rec["steps"]
    total = length + T
    M = math.ceil(total / BS)
    rep = Hq // Hkv
    errs, masses = [], []
    for layer, (q, k, v, dense, vv) in data.items():
        k_cache = torch.zeros(M, BS, Hkv, D, dtype=dtype, device=dev)
        k_cache.view(-1, Hkv, D)[:total] = k
        table = torch.arange(M, dtype=torch.int32, device=dev)[None]
        method = method_variant(name, {"sparse_method": "esa", "sparse_ratio": ratio,
                                       "min_blocks": 16},
                                num_layers=1, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D,
                                block_size=BS, device=dev)
        method.request_begin("r", length)
        for t in range(T):
            n = length + t + 1
            out_d, p = dense[t]
            nb = math.ceil(n / BS)
            method.step_begin()
            sel = method.attention_begin(0, ["r"], q[t][None], k_cache, table,
                                         torch.tensor([n], dtype=torch.int32, device=dev))
            method.attention_finished(0, ["r"])
            method.step_end()
            blocks = torch.ones(Hq, nb, dtype=torch.bool, device=dev)
            if sel is not None:
                tab, lens = sel
                blocks = torch.zeros(Hq, nb, dtype=torch.bool, device=dev)
                if tab.dim() == 2:                   # one table for every head: [1, K]
                    blocks[:, tab[0, :math.ceil(int(lens[0]) / BS)].long()] = True
                else:                                # per KV head: [1, Hkv, K]
                    for g in range(Hkv):
                        cnt = math.ceil(int(lens[0, g]) / BS)
                        blocks[g * rep:(g + 1) * rep, tab[0, g, :cnt].long()] = True
            pm = p * blocks.repeat_interleave(BS, 1)[:, :n]
            kept = pm.sum(-1)
            out_s = torch.einsum("hn,nhd->hd", pm / kept[:, None].clamp_min(1e-30), vv[:n])
            errs.append(float((out_s - out_d).norm() / out_d.norm()))
            masses.append(float(kept.mean()))
        method.request_finished("r")
    return dict(method=name, ratio=ratio, length=length, mass_kept=sum(masses) / len(masses),
                output_rel_err=sum(errs) / len(errs), worst_step_err=max(errs),
                steps=len(errs))


def measure(args) -> dict:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    rec = torch.load(args.record)
    lengths, ratios, methods = args.lengths, args.ratios, args.methods
    rows = []
    t0 = time.time()
    for length in lengths:
        data = {}
        for li in rec["layers"]:
            q, k, v = extended(rec, li, length, dev, dtype)
            dense, vv = dense_steps(q, k, v, length, rec["head_dim"] ** -0.5)
            data[li] = (q, k, v, dense, vv)
        for ratio in ratios:
            for name in methods:
                r = run_method(name, ratio, rec, data, length, dev, dtype)
                rows.append(r)
                print(f"{length:7d} ratio {ratio} {name:18s} mass kept {r['mass_kept']:.4f}  "
                      f"output error {r['output_rel_err']:.4f} (worst step "
                      f"{r['worst_step_err']:.3f})", flush=True)
        del data
    return dict(machine=dict(device=str(dev), name=(torch.cuda.get_device_name()
                                                    if dev.type == "cuda" else platform.machine()),
                             torch=torch.__version__, dtype=str(dtype)),
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                record=dict(context=rec["context"], steps=rec["steps"], offset=rec["offset"],
                            layers=list(rec["layers"])),
                command="python evals/sparse_longctx.py measure " + " ".join(sys.argv[2:]),
                rows=rows, seconds=time.time() - t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="record SmolLM2's q/k/v on one 8K context (CPU)")
    r.add_argument("--context", type=argtypes.count(BS), default=8192,
                   help="context tokens (default %(default)s)")
    r.add_argument("--steps", type=argtypes.count(1), default=16,
                   help="teacher-forced decode steps recorded after it (default %(default)s)")
    r.add_argument("--offset", type=argtypes.count(0), default=20000,
                   help="first corpus token (default %(default)s)")
    r.add_argument("--out", default=RECORD, help="default: %(default)s")
    m = sub.add_parser("measure", help="selection quality at longer contexts")
    m.add_argument("--record", default=RECORD, help="what `record` wrote (default: %(default)s)")
    m.add_argument("--lengths", type=argtypes.listed(argtypes.count(BS)),
                   default="8192,32768,131072",
                   help="context lengths in tokens, comma-separated (default %(default)s)")
    m.add_argument("--ratios", type=argtypes.listed(argtypes.ratio()), default="0.2",
                   help="sparse_ratio values in (0, 1], comma-separated (default %(default)s)")
    m.add_argument("--methods", type=argtypes.names, default=",".join(METHODS),
                   help="comma-separated, spelled as in sparse_quality.py (default %(default)s)")
    m.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if args.cmd == "record":
        record(args.context, args.steps, args.offset, args.out)
        return 0
    if not os.path.isfile(args.record):
        m.error(f"--record: no such file {args.record!r} (`sparse_longctx.py record` writes it)")
    try:
        from evals.sparse_model import check_methods

        check_methods(args.methods, args.ratios, {"min_blocks": 16}, num_layers=1, num_q_heads=9,
                      num_kv_heads=3, head_dim=64, block_size=BS)
    except ValueError as exc:
        m.error(str(exc))
    report = measure(args)
    if args.json:
        argtypes.write_json(args.json, report, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
