"""sparse_quality with prototype channel-subset scorers registered (exploration)."""
import sys, math, torch
sys.path.insert(0, "/work/main")
import ucm.sparse
from ucm.sparse.base import SparseMethod


class Channels(SparseMethod):
    """Score each block by the LSE of approximate q.k over its tokens, using r channels."""
    name = "chan"
    supports_per_kv_head = True
    R = 16
    STATIC = False
    I8 = False
    KV = False
    PAIR = False

    def __init__(self, config=None, **shape):
        super().__init__(config, **shape)
        self.static = {}

    def select(self, layer, states, q, k_cache, block_table, seq_lens, num_blocks, budget, tables):
        b, Hq, D = q.shape
        Hkv, G, bs = self.num_kv_heads, Hq // self.num_kv_heads, self.block_size
        M = block_table.shape[1]
        keys = k_cache[block_table.long()].float()          # [b, M, bs, Hkv, D]
        keys = keys.reshape(b, M * bs, Hkv, D)
        if self.I8:   # per (block, head, channel) scale, as a channel-major int8 table keeps it
            kb = keys.reshape(b, M, bs, Hkv, D)
            sc = kb.abs().amax(2, keepdim=True).clamp_min(1e-8) / 127
            keys = ((kb / sc).round() * sc).reshape(b, M * bs, Hkv, D)
        pos = torch.arange(M * bs)
        valid = pos[None] < seq_lens[:, None]
        qf = q.float()
        if self.STATIC:
            if layer not in self.static:
                kst = (keys.abs() * valid[..., None, None]).sum(1) / valid.sum(1)[:, None, None]
                qst = qf.abs().reshape(b, Hkv, G, D).mean(2)
                idx = (kst * qst).mean(0).topk(self.R, -1).indices       # [Hkv, R]
                self.static[layer] = idx.repeat_interleave(G, 0)          # [Hq, R]
            idx = self.static[layer][None].expand(b, -1, -1)
        elif self.KV or self.PAIR:
            a = qf.abs()
            if self.KV:
                a = a.reshape(b, Hkv, G, D).sum(2).repeat_interleave(G, 1)
            if self.PAIR:
                pa = a.reshape(b, Hq, D // 2, 2).sum(-1)
                pi = pa.topk(self.R // 2, -1).indices
                idx = torch.cat([2 * pi, 2 * pi + 1], -1)
            else:
                idx = a.topk(self.R, -1).indices
        else:
            idx = qf.abs().topk(self.R, -1).indices                       # [b, Hq, R]
        mask = torch.zeros_like(qf).scatter_(2, idx, 1.0)
        qr = qf * mask
        if self.STATIC:
            temp = math.sqrt(D)
        else:
            temp = torch.sqrt(D * qr.abs().sum(-1) / qf.abs().sum(-1))[..., None]
        lt = torch.einsum("bhgd,bthd->bhgt", qr.reshape(b, Hkv, G, D), keys).reshape(b, Hq, -1)
        lt = (lt / temp).masked_fill(~valid[:, None], float("-inf"))
        blk = torch.logsumexp(lt.reshape(b, Hq, M, bs), -1)                # [b, Hq, M]
        nvalid = torch.arange(M)[None] < num_blocks[:, None]
        blk = blk.masked_fill(~nvalid[:, None], float("-inf"))
        shares = torch.softmax(blk, -1).reshape(b, Hkv, G, M).mean(2)
        if self.per_kv_head:
            return self.pick_per_kv_head(shares.masked_fill(~nvalid[:, None], float("-inf")),
                                         num_blocks, budget)
        return self.pick(torch.softmax(blk, -1).mean(1).masked_fill(~nvalid, float("-inf")),
                         num_blocks, budget)


for r in (12, 16, 24):
    for kv in (False, True):
        for pair in (False, True):
            nm = f"sq{r}{'kv' if kv else ''}{'p' if pair else ''}i8"
            ucm.sparse.METHODS[nm] = type(nm, (Channels,), dict(name=nm, R=r, KV=kv, PAIR=pair, I8=True))


def variant(name, **kw):
    return type(name, (Channels,), dict(name=name, **kw))

for r in (8, 16, 24, 32):
    for st in (False, True):
        for i8 in (False, True):
            nm = f"{'static' if st else 'sparq'}{r}{'i8' if i8 else ''}"
            ucm.sparse.METHODS[nm] = variant(nm, R=r, STATIC=st, I8=i8)


_BASES = {}

def bases(rank, kind):
    key = (rank, kind)
    if key in _BASES:
        return _BASES[key]
    recs = torch.load("evals/explore/calib.pt")
    out = {}
    for layer in recs[0]["k"]:
        ks = torch.cat([r["k"][layer].float() for r in recs])
        qs = torch.cat([r["q"][layer].float() for r in recs])
        Hkv, D = ks.shape[1], ks.shape[2]
        G = qs.shape[1] // Hkv
        A, B = [], []
        for h in range(Hkv):
            kh = ks[:, h]
            qh = qs[:, h * G:(h + 1) * G].reshape(-1, D)
            if kind == "w":
                C = qh.T @ qh / qh.shape[0]
                C = C + 1e-3 * torch.eye(D) * C.diagonal().mean()
                e, U = torch.linalg.eigh(C)
                W = U @ torch.diag(e.sqrt()) @ U.T
                Wi = U @ torch.diag(e.rsqrt()) @ U.T
            elif kind == "d":
                d = qh.pow(2).mean(0).sqrt() + 1e-6
                W, Wi = torch.diag(d), torch.diag(1 / d)
            else:
                W = Wi = torch.eye(D)
            _, _, V = torch.linalg.svd(kh @ W, full_matrices=False)
            A.append(W @ V[:rank].T)      # keys -> codes   [D, r]
            B.append(Wi @ V[:rank].T)     # queries -> codes [D, r]
        out[layer] = (torch.stack(A), torch.stack(B))
    _BASES[key] = out
    return out


class LowRank(SparseMethod):
    name = "lr"
    supports_per_kv_head = True
    R = 16
    KIND = "w"

    def select(self, layer, states, q, k_cache, block_table, seq_lens, num_blocks, budget, tables):
        b, Hq, D = q.shape
        Hkv, G, bs = self.num_kv_heads, Hq // self.num_kv_heads, self.block_size
        M = block_table.shape[1]
        A, Bm = bases(self.R, self.KIND)[layer]
        keys = k_cache[block_table.long()].float().reshape(b, M * bs, Hkv, D)
        codes = torch.einsum("bthd,hdr->bthr", keys, A)
        sc = codes.abs().amax(-1, keepdim=True).clamp_min(1e-8) / 127
        codes = (codes / sc).round() * sc
        qc = torch.einsum("bhgd,hdr->bhgr", q.float().reshape(b, Hkv, G, D), Bm)
        lt = torch.einsum("bhgr,bthr->bhgt", qc, codes).reshape(b, Hq, -1) / math.sqrt(D)
        valid = torch.arange(M * bs)[None] < seq_lens[:, None]
        lt = lt.masked_fill(~valid[:, None], float("-inf"))
        blk = torch.logsumexp(lt.reshape(b, Hq, M, bs), -1) * math.sqrt(D)
        nvalid = torch.arange(M)[None] < num_blocks[:, None]
        blk = blk.masked_fill(~nvalid[:, None], float("-inf"))
        if self.per_kv_head:
            return self.pick_per_kv_head(self.kv_head_mass(blk), num_blocks, budget)
        return self.pick_by_mass(blk, num_blocks, budget)


for r in (8, 12, 16, 24):
    for kind in ("w", "d", "k"):
        nm = f"lr{kind}{r}"
        ucm.sparse.METHODS[nm] = type(nm, (LowRank,), dict(name=nm, R=r, KIND=kind))

from evals.sparse_quality import main
sys.exit(main(sys.argv[1:]))
