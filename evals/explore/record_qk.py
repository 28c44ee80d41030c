"""Record SmolLM2 decode queries and keys on long docs (exploration)."""
import sys, os, torch, math
sys.path.insert(0, "/work/main")
from evals.sparse_quality import corpus_ids, documents
from ucm.reference.llama import Llama, run_continuation
from ucm.sparse.base import SparseMethod
from ucm.models import ensure_smollm2

class Rec(SparseMethod):
    name = "rec"
    supports_per_kv_head = True
    def __init__(self, **kw):
        super().__init__({"min_blocks": 16}, **kw)
        self.qs = {}; self.ks = {}
    def attention_begin(self, layer, req_ids, q, k_cache, block_table, seq_lens):
        n = int(seq_lens[0]); bs = self.block_size
        nb = -(-n // bs)
        self.qs.setdefault(layer, []).append(q[0].clone())
        k = k_cache[block_table[0, :nb].long()].reshape(nb * bs, *k_cache.shape[2:])[:n]
        self.ks[layer] = k.clone()
        return None

path = ensure_smollm2(); model = Llama.load(path); ids = corpus_ids(path)
out = sys.argv[1]; ctxs = [int(x) for x in sys.argv[2].split(",")]; ndocs = int(sys.argv[3]); T = int(sys.argv[4])
recs = []
for L in ctxs:
    docs = documents(ids, L, T, ndocs)
    if len(sys.argv) > 5:
        docs = [docs[int(i)] for i in sys.argv[5].split(",")]
    for d, doc in enumerate(docs):
        m = Rec(num_layers=model.num_layers, num_q_heads=model.num_q_heads, num_kv_heads=model.num_kv_heads,
                head_dim=model.head_dim, block_size=16)
        run_continuation(model, doc[:L], doc[L:L + T], [m])
        recs.append({"L": L, "doc": d, "q": {l: torch.stack(v).half() for l, v in m.qs.items()},
                     "k": {l: v.half() for l, v in m.ks.items()}})
        print(L, d, flush=True)
torch.save(recs, out)
