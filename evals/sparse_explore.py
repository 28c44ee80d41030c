"""Block-scoring experiments on SmolLM2-135M: which scoring keeps perplexity closest to dense at a
small budget.

A quick, comparable setting (default: 2K context, two documents x 24 teacher-forced tokens,
``sparse_ratio`` 0.2), every variant one batch row of the same
:func:`ucm.reference.llama.run_continuation` run (they share the dense prefill), pooled over
the documents with :func:`evals.sparse_quality.summarize`. Variants:

* ``quest`` / ``esaN`` (ESA re-selecting every N steps; ``esa1`` isolates its scoring) / ``kvstar`` /
  ``esa``, with ``sparse_repr_group`` 0 (no suffix: one summary per block) or ``:g8`` / ``:g4`` /
  ``:g2`` / ``:g1`` (summaries of 8 / 4 / 2 / 1 tokens; a block scores as its best sub-block);
* ``quest-kvhead``: each KV head its own top-``budget`` blocks (harness only: a vLLM request has
  one block table for all heads, so this measures what the shared selection costs);
* ``mean-kvhead``: mean keys (ESA's scoring, every step), each KV head its own blocks;
* ``quest-prev``: the blocks selected at the previous step are scored by the exact attention
  they received then (their estimated total share redistributed by it), the others by the Quest
  bound;
* ``oracle`` (exact block mass) and ``random`` baselines;
* a ``q8`` / ``f8`` suffix after the group (``esa1:g4q8``): the summaries the method scores are
  rounded through 8 bits first, per (block, sub-block, KV head) row scaled by its largest
  magnitude: int8 (means to nearest, Quest's maxima up and minima down, so the bound stays a
  bound) or float8 e4m3. What 8-bit tables would cost in accuracy (harness only: the methods
  keep tables in the cache's dtype).

Run with the project's virtualenv (it has ``tokenizers``)::

    .venv/bin/python evals/sparse_explore.py [--ratio 0.2] [--variants a,b,...]
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ucm.reference import llama as sparse_model  # noqa: E402
from ucm.models import ensure_smollm2  # noqa: E402
from ucm.reference.llama import Llama, run_continuation  # noqa: E402
from evals import argtypes  # noqa: E402
from evals.sparse_quality import corpus_ids, documents, markdown, summarize  # noqa: E402
from ucm.sparse import ops  # noqa: E402
from ucm.sparse.quest import Quest  # noqa: E402

# per-KV-head selections waiting for this layer's attention: batch row -> (tables [Hkv, K],
# lens [Hkv]); filled by QuestPerKVHead.select, consumed by _paged_attention_per_head
_PER_HEAD: dict = {}
_paged_attention = sparse_model.paged_attention


def _paged_attention_per_head(q, k_cache, v_cache, block_table, seq_lens, scale=None, full=None):
    """sparse_model.paged_attention, except that rows with a pending per-KV-head selection
    attend, per KV head, to that head's own blocks (mass averaged over all query heads)."""
    res = _paged_attention(q, k_cache, v_cache, block_table, seq_lens, scale, full)
    if not _PER_HEAD:
        return res
    out, mass = (res[0].clone(), res[1].clone()) if full is not None else (res.clone(), None)
    Hq, Hkv = q.shape[1], k_cache.shape[2]
    rep = Hq // Hkv
    for r, (tabs, lens) in _PER_HEAD.items():
        head_mass = []
        for h in range(Hkv):
            hs = slice(h * rep, (h + 1) * rep)
            args = (q[r:r + 1, hs], k_cache[:, :, h:h + 1], v_cache[:, :, h:h + 1],
                    tabs[h:h + 1], lens[h:h + 1], scale)
            if full is None:
                out[r, hs] = _paged_attention(*args)[0]
            else:
                o, m = _paged_attention(*args, full=(full[0][r:r + 1], full[1][r:r + 1]))
                out[r, hs] = o[0]
                head_mass.append(float(m[0]))
        if mass is not None:
            mass[r] = sum(head_mass) / Hkv
    _PER_HEAD.clear()
    return (out, mass) if full is not None else out


class QuestPerKVHead(Quest):
    """Quest bound, each KV head selecting its own top-``budget`` blocks (harness only)."""

    name = "quest-kvhead"
    kind = "quest"

    def select(self, layer, states, q, k_cache, block_table, seq_lens, num_blocks, budget, tables):
        bound = self.score_per_head(q, block_table, num_blocks, self.kind, tables)  # [b, Hq, M]
        b, Hq, M = bound.shape
        Hkv = self.num_kv_heads
        shares = torch.softmax(bound / math.sqrt(self.head_dim), -1)
        per_kv = shares.reshape(b, Hkv, Hq // Hkv, M).mean(2).reshape(b * Hkv, M)
        sel, count = self.pick(per_kv, num_blocks.repeat_interleave(Hkv),
                               budget.repeat_interleave(Hkv))
        self._last_sel = [sel[r, :int(count[r])].tolist() for r in range(sel.shape[0])]
        tabs, lens = ops.sparse_block_table(block_table.repeat_interleave(Hkv, 0),
                                            seq_lens.repeat_interleave(Hkv), sel, count,
                                            self.block_size)
        for i, st in enumerate(states):
            _PER_HEAD[int(st.req_id[3:])] = (tabs[i * Hkv:(i + 1) * Hkv],
                                             lens[i * Hkv:(i + 1) * Hkv])
        return sel[::Hkv], count[::Hkv]     # KV head 0's selection stands for the row


class MeanPerKVHead(QuestPerKVHead):
    """Mean keys (ESA's scoring), each KV head selecting its own top-``budget`` blocks, re-selected
    every ``stride`` steps; in between each head keeps its selection, extended by the windows
    and the new last block, as ESA does (harness only)."""

    name = "mean-kvhead"
    reprs = ("mean",)
    kind = "mean"
    stride = 1

    def select(self, layer, states, q, k_cache, block_table, seq_lens, num_blocks, budget, tables):
        Hkv = self.num_kv_heads
        due = [i for i, st in enumerate(states)
               if ("kvsel", layer) not in st.extra or st.calls.get(layer, 0) % self.stride == 0]
        if due:
            di = torch.tensor(due)
            sel, count = super().select(layer, [states[i] for i in due], q[di], k_cache,
                                        block_table[di], seq_lens[di], num_blocks[di],
                                        budget[di], tables)
            # super() left the rows' tables in _PER_HEAD under their request numbers; keep the
            # logical selections per head for the steps in between
            for j, i in enumerate(due):
                st = states[i]
                heads = []
                for h in range(Hkv):
                    row = self._last_sel[j * Hkv + h]
                    heads.append(row)
                st.extra[("kvsel", layer)] = heads
        for i, st in enumerate(states):
            if i in due:
                continue
            n = int(num_blocks[i])
            heads = [sorted(set(h).union(self.forced(n))) for h in st.extra[("kvsel", layer)]]
            st.extra[("kvsel", layer)] = heads
            width = max(len(h) for h in heads)
            sel = torch.full((Hkv, width), -1, dtype=torch.int32)
            for h, row in enumerate(heads):
                sel[h, :len(row)] = torch.tensor(row, dtype=torch.int32)
            count = torch.tensor([len(r) for r in heads], dtype=torch.int32)
            tabs, lens = ops.sparse_block_table(block_table[i:i + 1].repeat_interleave(Hkv, 0),
                                                seq_lens[i:i + 1].repeat_interleave(Hkv), sel,
                                                count, self.block_size)
            _PER_HEAD[int(st.req_id[3:])] = (tabs, lens)
        rows = [sorted(st.extra[("kvsel", layer)][0]) for st in states]
        from ucm.sparse.base import pack_selection
        return pack_selection(rows, q.device)     # KV head 0's selection stands for the row


class QuestPrevExact(Quest):
    """Quest, with the previous step's exact attention of its selected blocks (see module)."""

    name = "quest-prev"

    def select(self, layer, states, q, k_cache, block_table, seq_lens, num_blocks, budget, tables):
        est = self.head_mass(self.score_per_head(q, block_table, num_blocks, "quest", tables))
        for i, st in enumerate(states):
            prev = st.extra.get(layer)
            if prev is None:
                continue
            idx, exact = prev
            share = est[i, idx].sum()
            est[i, idx] = exact / exact.sum().clamp(min=1e-30) * share
        sel, count = self.pick(est, num_blocks, budget)
        table, lens = ops.sparse_block_table(block_table, seq_lens, sel, count, self.block_size)
        exact = ops.block_attention_mass(q, k_cache, table, lens)
        for i, st in enumerate(states):
            c = int(count[i])
            st.extra[layer] = (sel[i, :c].long(), exact[i, :c])
        return sel, count


def _round8(x: torch.Tensor, kind: str, fmt: str) -> torch.Tensor:
    """``x`` rounded through 8 bits per last-axis row (scaled by the row's largest magnitude)."""
    xf = x.float()
    if fmt == "f8":
        scale = (xf.abs().amax(-1, keepdim=True) / 448.0).clamp(min=1e-30)
        return ((xf / scale).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)
    scale = (xf.abs().amax(-1, keepdim=True) / 127.0).clamp(min=1e-30)
    r = {"kmax": torch.ceil, "kmin": torch.floor}.get(kind, torch.round)
    return (r(xf / scale).clamp(-127, 127) * scale).to(x.dtype)


def _eight_bit(method, fmt: str):
    """``method`` scoring 8-bit-rounded copies of its summary tables."""
    select = method.select

    def rounded(layer, states, q, k_cache, block_table, seq_lens, num_blocks, budget, tables):
        if tables:
            tables = {k: _round8(v, k, fmt) if k in ("mean", "kmin", "kmax") else v
                      for k, v in tables.items()}
        return select(layer, states, q, k_cache, block_table, seq_lens, num_blocks, budget, tables)
    method.select = rounded
    return method


def build(variant: str, ratio: float, shape: dict):
    """The method of a variant name such as ``quest:g4``, ``esa1:g8``, ``oracle``,
    ``esa1:g4q8``."""
    name, _, opt = variant.partition(":")
    fmt = opt[-2:] if opt[-2:] in ("q8", "f8") else ""
    group = opt[:len(opt) - len(fmt)]
    stride = name.partition("-s")[2] if name.startswith("mean-kvhead") else ""
    if (group and not (group[:1] == "g" and group[1:].isdigit())) or \
            (name.startswith("mean-kvhead") and name != "mean-kvhead" and not stride.isdigit()):
        raise ValueError(f"--variants: cannot read {variant!r} (expected NAME[:gN][q8|f8], "
                         f"NAME one of quest, esaN, kvstar, esa, quest-kvhead, mean-kvhead[-sN], "
                         f"quest-prev, oracle, random)")
    method = _build(name, group, ratio, shape)
    return _eight_bit(method, fmt) if fmt else method


def _build(name: str, opt: str, ratio: float, shape: dict):
    import ucm.sparse

    cfg = {"sparse_method": "esa", "sparse_ratio": ratio, "min_blocks": 16,
           "sparse_repr_group": int(opt.lstrip("g")) if opt else 0}
    if name[:3] == "esa" and name[3:].isdigit():     # esaN: ESA re-selecting every N steps
        return ucm.sparse.create(dict(cfg, retrieval_stride=int(name[3:])), method="esa", **shape)
    if name == "quest-kvhead":
        return QuestPerKVHead(cfg, **shape)
    if name.startswith("mean-kvhead"):        # mean-kvhead[-sN]: re-selected every N steps
        m = MeanPerKVHead(cfg, **shape)
        m.stride = int(name.partition("-s")[2] or 1)
        return m
    if name == "quest-prev":
        return QuestPrevExact(cfg, **shape)
    return ucm.sparse.create(cfg, method=name, **shape)


DEFAULT = ("oracle,quest,quest:g8,quest:g4,quest:g2,esa1,esa1:g8,esa1:g4,kvstar,kvstar:g4,"
           "quest-kvhead,quest-kvhead:g4,quest-prev")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=argtypes.count(16), default=2048,
                   help="context length in tokens (default %(default)s)")
    p.add_argument("--docs", type=argtypes.count(1), default=2,
                   help="documents (default %(default)s)")
    p.add_argument("--tokens", type=argtypes.count(1), default=24,
                   help="teacher-forced tokens per document (default %(default)s)")
    p.add_argument("--ratio", type=argtypes.ratio(), default=0.2,
                   help="sparse_ratio in (0, 1] (default %(default)s)")
    p.add_argument("--variants", type=argtypes.names, default=DEFAULT,
                   help="comma-separated variant names (see the module docstring; default "
                        "%(default)s)")
    p.add_argument("--json", help="write the summary here")
    args = p.parse_args(argv)
    sparse_model.paged_attention = _paged_attention_per_head
    variants = args.variants
    t0 = time.time()
    model = Llama.load(ensure_smollm2())
    ids = corpus_ids(ensure_smollm2())
    shape = dict(num_layers=model.num_layers, num_q_heads=model.num_q_heads,
                 num_kv_heads=model.num_kv_heads, head_dim=model.head_dim, block_size=16)
    try:                 # a bad variant, option or a context past the corpus fails here
        for v in variants:
            build(v, args.ratio, shape)
        documents(ids, args.context, args.tokens, 1)
    except ValueError as exc:
        p.error(str(exc))
    records = []
    for d, doc in enumerate(documents(ids, args.context, args.tokens, args.docs)):
        L, T = args.context, args.tokens
        rows = [None] + [build(v, args.ratio, shape) for v in variants]
        res = run_continuation(model, doc[:L], doc[L:L + T], rows)
        targets = torch.tensor(doc[L + 1:L + T + 1])
        dense_lp = torch.log_softmax(res.dense_logits, -1)
        dense_nll = -dense_lp.gather(1, targets[:, None])[:, 0]
        print(f"doc {d}: {time.time() - t0:.0f} s; dense decode vs prefill max |logit diff| "
              f"{float((res.logits[0] - res.dense_logits).abs().max()):.1e}", flush=True)
        for r, v in enumerate(variants, start=1):
            lp = torch.log_softmax(res.logits[r], -1)
            records.append({
                "method": v, "ratio": args.ratio, "context": L,
                "nll": (-lp.gather(1, targets[:, None])[:, 0]).tolist(),
                "dense_nll": dense_nll.tolist(),
                "agree": (res.logits[r].argmax(-1) == res.dense_logits.argmax(-1)).float().tolist(),
                "kl": (dense_lp.exp() * (dense_lp - lp)).sum(-1).tolist(),
                "mass": res.mass[r].tolist(),
                "kept": (res.blocks[r] / torch.tensor([math.ceil((L + t + 1) / 16)
                                                       for t in range(T)])).tolist()})
    summary = [r for r in summarize(records) if r["context"] != "all"]
    order = {v: i for i, v in enumerate(variants)}
    summary.sort(key=lambda r: order[r["method"]])
    print(markdown(summary))
    print(f"total {time.time() - t0:.0f} s")
    if args.json:
        argtypes.write_json(args.json, {"args": vars(args), "summary": summary}, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
