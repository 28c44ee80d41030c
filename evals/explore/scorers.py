"""Kept attention mass of per-KV-head block selections by cheap scorers (exploration)."""
import sys, math, torch, itertools
torch.set_num_threads(2)
recs = torch.load(sys.argv[1])
RATIO = float(sys.argv[2]) if len(sys.argv) > 2 else 0.2
BS, D, HQ, HKV = 16, 64, 9, 3
G = HQ // HKV

def forced(n):
    return sorted({0, n - 1, n - 2, n - 3} & set(range(n)))

def select(score, n, k, pool):
    """score [HKV, n] (shares); returns bool mask [HKV, n]."""
    s = score.clone()
    f = torch.tensor(forced(n))
    s[:, f] = float("inf")
    if pool:
        top = torch.topk(s.reshape(-1), HKV * k).indices
        m = torch.zeros(HKV * n, dtype=torch.bool); m[top] = True
        return m.reshape(HKV, n)
    top = torch.topk(s, k, dim=1).indices
    m = torch.zeros(HKV, n, dtype=torch.bool); m.scatter_(1, top, True)
    return m

def shares(per_q):  # per_q [HQ, n] logit-like block scores -> kv-head shares
    return torch.softmax(per_q / math.sqrt(D), -1).reshape(HKV, G, -1).mean(1)

def sub_means(kb, g):  # kb [n, BS, HKV, D] -> [n, BS//g, HKV, D]
    n = kb.shape[0]
    return kb.reshape(n, BS // g, g, HKV, D).mean(2)

def qexp(q):  # [HQ, D] -> per kv head view [HKV, G, D]
    return q.reshape(HKV, G, D)

def mean_score(q, means):  # means [n, S, HKV, D] -> [HQ, n]
    s = torch.einsum("hgd,nshd->hgns", qexp(q), means)
    return s.amax(-1).reshape(HQ, -1)

def quest_score(q, kb, g):
    n = kb.shape[0]
    x = kb.reshape(n, BS // g, g, HKV, D)
    kmin, kmax = x.amin(2), x.amax(2)
    qq = qexp(q)[:, :, None, None, :]  # h g 1 1 d
    a = torch.einsum("hgd,nshd->hgnsd", qexp(q), kmin)
    b = torch.einsum("hgd,nshd->hgnsd", qexp(q), kmax)
    return torch.maximum(a, b).sum(-1).amax(-1).reshape(HQ, n)

def lse_tokens(logit_tok, n):  # [HQ, n*BS] (masked -inf) -> [HQ, n]
    return torch.logsumexp(logit_tok.reshape(HQ, n, BS), -1)

def quant(x, bits, dim=-1):
    qm = 2 ** (bits - 1) - 1
    sc = x.abs().amax(dim, keepdim=True).clamp_min(1e-8) / qm
    return (x / sc).round().clamp(-qm, qm) * sc

def calib(layer, skip):
    """Other documents' keys and queries of a layer: per kv head key PCA and q-whitened PCA."""
    ks = torch.cat([r["k"][layer].float() for i, r in enumerate(recs) if i != skip])     # [N, HKV, D]
    qs = torch.cat([r["q"][layer].float() for i, r in enumerate(recs) if i != skip])     # [T, HQ, D]
    out = {}
    for h in range(HKV):
        kh = ks[:, h]
        _, _, V = torch.linalg.svd(kh, full_matrices=False)
        qh = qs[:, h * G:(h + 1) * G].reshape(-1, D)
        C = qh.T @ qh / qh.shape[0] + 1e-4 * torch.eye(D) * (qh.pow(2).mean())
        e, U = torch.linalg.eigh(C)
        W = U @ torch.diag(e.clamp_min(1e-12).sqrt()) @ U.T        # C^1/2
        Wi = U @ torch.diag(e.clamp_min(1e-12).rsqrt()) @ U.T
        _, _, V2 = torch.linalg.svd(kh @ W, full_matrices=False)   # PCA of whitened keys
        d = qh.pow(2).mean(0).sqrt()                                 # diagonal weighting
        _, _, V3 = torch.linalg.svd(kh * d, full_matrices=False)
        out[h] = (V, W, Wi, V2, d, V3)
    return out

def run(variants):
    tot = {v: [0.0, 0] for v in variants}
    for ri, rec in enumerate(recs):
        L = rec["L"]
        for layer in sorted(rec["k"]):
            K = rec["k"][layer].float()          # [N, HKV, D]
            Q = rec["q"][layer].float()          # [T, HQ, D]
            T = Q.shape[0]
            cal = calib(layer, ri) if any(v.startswith(("xpca", "wpca", "dpca")) for v in variants) else None
            # PCA basis per kv head from the context keys (calibration at prefill)
            Kc = K[:L]
            pca = {}
            for h in range(HKV):
                U, S, V = torch.linalg.svd(Kc[:, h] - 0, full_matrices=False)
                pca[h] = V  # rows = principal dirs
            for t in range(int(sys.argv[4]) if len(sys.argv) > 4 else 0, T, 2):
                N = L + t + 1
                n = -(-N // BS)
                k = max(4, math.ceil(RATIO * n - 1e-9))
                if k >= n:
                    continue
                q = Q[t]
                Kp = torch.zeros(n * BS, HKV, D); Kp[:N] = K[:N]
                valid = torch.arange(n * BS) < N
                logit = torch.einsum("hgd,thd->hgt", qexp(q), Kp).reshape(HQ, -1) / math.sqrt(D)
                logit = logit.masked_fill(~valid, float("-inf"))
                p = torch.softmax(logit, -1)
                bm = p.reshape(HQ, n, BS).sum(-1).reshape(HKV, G, n).mean(1)   # [HKV, n] exact mass
                kb = Kp.reshape(n, BS, HKV, D)
                # sub-block summaries only over full blocks: last block partial -> forced anyway
                cache = {}
                for v in variants:
                    name, pool = v.split("|")
                    pool = pool == "pool"
                    if name == "oracle":
                        sc = bm
                    elif name.startswith("lag"):   # lagN: exact kv-head mass under the query of step t-N
                        lag = int(name[3:])
                        qo = Q[max(0, t - lag)]
                        lo = torch.einsum("hgd,thd->hgt", qexp(qo), Kp).reshape(HQ, -1) / math.sqrt(D)
                        lo = lo.masked_fill(~valid, float("-inf"))
                        sc = torch.softmax(lo, -1).reshape(HQ, n, BS).sum(-1).reshape(HKV, G, n).mean(1)
                    elif name.startswith("mean"):
                        g = int(name.split("_")[1][1:])
                        means = sub_means(kb, g)
                        if "_i8" in name:
                            means = quant(means, 8)
                        if "_i4" in name:
                            means = quant(means, 4)
                        if "_pca" in name:
                            r = int(name.split("_pca")[1])
                            means = torch.stack([means[:, :, h] @ pca[h][:r].T @ pca[h][:r] for h in range(HKV)], 2)
                        sc = shares(mean_score(q, means))
                    elif name.startswith("quest"):
                        g = int(name.split("_")[1][1:])
                        sc = shares(quest_score(q, kb, g))
                    elif name.startswith("sparq"):
                        r = int(name.split("_")[1])
                        qq = q.clone()
                        if "kv" in name:   # channels shared by the kv head's query heads
                            agg = qq.abs().reshape(HKV, G, D).sum(1)
                            idx = agg.topk(r, -1).indices.repeat_interleave(G, 0)
                        else:
                            idx = None
                        idx = qq.abs().topk(r, -1).indices if idx is None else idx
                        mask = torch.zeros_like(qq).scatter_(1, idx, 1.0)
                        qr = qq * mask
                        # SparQ temperature: sqrt(D * |q_r|_1/|q|_1)
                        temp = torch.sqrt(D * (qr.abs().sum(-1) / qq.abs().sum(-1)))[:, None]
                        Kq = quant(Kp, 8) if name.endswith("i8") else Kp
                        lt = torch.einsum("hgd,thd->hgt", qexp(qr), Kq).reshape(HQ, -1) / temp
                        lt = lt.masked_fill(~valid, float("-inf"))
                        sc = torch.softmax(lse_tokens(lt, n), -1).reshape(HKV, G, n).mean(1)
                    elif name.startswith("static"):   # static_R[_i8][_qk|_k]: fixed channels per kv head
                        parts = name.split("_"); r = int(parts[1])
                        kst = K[:L].abs().mean(0)                       # [HKV, D]
                        q0 = Q[0].abs().reshape(HKV, G, D).mean(1)       # step-0 query only
                        stat = kst * q0 if "qk" in parts else kst
                        idx = stat.topk(r, -1).indices                  # [HKV, r]
                        mask = torch.zeros(HKV, D).scatter_(1, idx, 1.0)
                        Km = Kp * mask[None]
                        if "i8" in parts:
                            Km = quant(Km, 8)
                        lt = torch.einsum("hgd,thd->hgt", qexp(q), Km).reshape(HQ, -1) / math.sqrt(D)
                        lt = lt.masked_fill(~valid, float("-inf"))
                        sc = torch.softmax(lse_tokens(lt, n), -1).reshape(HKV, G, n).mean(1)
                    elif name.startswith(("xpca", "wpca", "dpca")):
                        r = int(name.split("_")[1])
                        parts = []
                        for h in range(HKV):
                            V, W, Wi, V2, dd, V3 = cal[h]
                            kh = Kp[:, h]
                            if name.startswith("xpca"):
                                P = V[:r].T @ V[:r]; kr = kh @ P
                            elif name.startswith("wpca"):
                                P = V2[:r].T @ V2[:r]; kr = (kh @ W) @ P @ Wi
                            else:
                                P = V3[:r].T @ V3[:r]; kr = ((kh * dd) @ P) / dd
                            parts.append(kr)
                        Kr = torch.stack(parts, 1)
                        if name.endswith("i8"):
                            Kr = quant(Kr, 8)
                        lt = torch.einsum("hgd,thd->hgt", qexp(q), Kr).reshape(HQ, -1) / math.sqrt(D)
                        lt = lt.masked_fill(~valid, float("-inf"))
                        sc = torch.softmax(lse_tokens(lt, n), -1).reshape(HKV, G, n).mean(1)
                    elif name.startswith("pcatok"):
                        r = int(name.split("_")[1])
                        Kr = torch.stack([Kp[:, h] @ pca[h][:r].T @ pca[h][:r] for h in range(HKV)], 1)
                        lt = torch.einsum("hgd,thd->hgt", qexp(q), Kr).reshape(HQ, -1) / math.sqrt(D)
                        lt = lt.masked_fill(~valid, float("-inf"))
                        sc = torch.softmax(lse_tokens(lt, n), -1).reshape(HKV, G, n).mean(1)
                    elif name.startswith("two"):   # two_gC_gF_x: coarse mean gC, keep x*k, fine gF
                        _, gc, gf, x = name.split("_")
                        gc, gf, x = int(gc[1:]), int(gf[1:]), float(x)
                        c = shares(mean_score(q, quant(sub_means(kb, gc), 8)))
                        cand = select(c, n, min(n, math.ceil(x * k)), False)
                        f = shares(mean_score(q, quant(sub_means(kb, gf), 8)))
                        sc = torch.where(cand, f + 1.0, f * 0)   # candidates first
                        sc = torch.where(cand, f, torch.full_like(f, -1.0))
                    m = select(sc, n, k, pool)
                    kept = (bm * m).sum(-1)  # per kv head
                    tot[v][0] += float((1 - kept).sum()); tot[v][1] += HKV
    return {v: a / c for v, (a, c) in tot.items()}

variants = sys.argv[3].split(",")
res = run(variants)
base = res.get("oracle|head")
for v, miss in res.items():
    print(f"{v:28s} missed mass {miss:.4f}" + (f"  x oracle {miss / base:.2f}" if base else ""))
