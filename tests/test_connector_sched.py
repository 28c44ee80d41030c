"""UCMConnector under a real vLLM 0.32 scheduler, step by step, with no model
(``connector_harness``: the scheduler builds its connector, ``tp`` worker connectors over CPU
caches, a fake forward that writes recognisable K/V and checks every slot attention reads).

Each scenario runs at TP 1 and 2 and ends with :func:`assert_scheduler_empty`. Hits are the
tokens the connector reported to the scheduler (``get_num_new_matched_tokens``) when a request
was admitted; KV correctness is checked by the fake forward on every step (a read of KV from
another prompt, adapter, tenant, rank or of a block whose load failed raises ``KVMismatch``).
A store that holds a prompt gives every token of it but the last (``connector.partial_tail``,
the default, stores the partial last block too), in a new engine as in the same one.
Load failures are injected (``InjectedLoadFaults``): a storage fault cannot be produced
deterministically for real.
"""
import os

import numpy as np
import pytest
import torch

from conftest import require_vllm_module

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

require_vllm_module()

import connector_harness as H  # noqa: E402
from connector_harness import BLOCK, assert_scheduler_empty, expected_hits  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

TPS = [pytest.param(1, id="tp1"), pytest.param(2, id="tp2")]


def _prompt(seed: int, n: int) -> list:
    return np.random.default_rng(seed).integers(100, 30000, size=n).tolist()


@pytest.fixture
def root(tmp_path):
    d = tmp_path / "store"
    d.mkdir()
    return d


def _engine(root, tp, pipeline="memory|posix", connector=None, **kw):
    return H.Engine(H.store_config(root, pipeline, **(connector or {})), tp=tp, **kw)


def _run(root, tp, prompts, **kw):
    """A new engine on ``root`` runs ``prompts`` together and is checked empty and closed;
    returns their :class:`Req` (hits, status)."""
    add = kw.pop("add", {})
    with _engine(root, tp, **kw) as e:
        reqs = e.run_prompts(prompts, **add)
        assert_scheduler_empty(e)
    return reqs


def _finished(r) -> bool:
    return r.status == RequestStatus.FINISHED_LENGTH_CAPPED


# ---------------------------------------------------------------------------------------------
# 1-3: hits


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"),
                                   pytest.param(torch.bfloat16, id="bf16")])
@pytest.mark.parametrize("tp", TPS)
def test_miss_then_hit_in_a_new_engine(root, tp, dtype):
    prompts = [_prompt(1, 84), _prompt(2, 100), _prompt(3, 50)]
    first = _run(root, tp, prompts, dtype=dtype, layers=3)
    assert [(r.local, r.ext) for r in first] == [(0, 0)] * 3
    assert all(_finished(r) and len(r.output) == 2 for r in first)
    second = _run(root, tp, prompts, dtype=dtype, layers=3)
    assert [(r.local, r.ext) for r in second] == [(0, expected_hits(len(p))) for p in prompts]
    assert [r.output for r in second] == [r.output for r in first]


MODES = {
    "layerwise": {"layerwise": True},
    "sync-save": {"async_save": False},
    "no-tail": {"partial_tail": False},
    "no-overlap": {"overlap_load": False, "save_during_forward": False},
    "posix-only": {},  # no memory tier (loads never borrowed)
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("tp", TPS)
def test_connector_modes(root, tp, mode):
    """Miss, hit in a new engine and a failed load under the connector's other modes."""
    opts = MODES[mode]
    pipeline = "posix" if mode == "posix-only" else "memory|posix"
    tail = opts.get("partial_tail", True)
    p, q = _prompt(9, 75), _prompt(10, 40)
    _run(root, tp, [p, q], connector=opts, pipeline=pipeline)
    with _engine(root, tp, connector=opts, pipeline=pipeline) as e:
        e.inject_load_faults(lambda row: row.index == 1 and row.req_id == "r2")
        a, b = e.run_prompts([p, q])
        assert a.ext == expected_hits(len(p), tail) and b.ext == expected_hits(len(q), tail)
        assert {(f.rank, f.index) for f in e.injected()} == {(r, 1) for r in range(tp)}
        again = e.run_prompts([q])[0]
        assert again.local + again.ext == expected_hits(len(q), tail)
        assert_scheduler_empty(e)


def test_hits_do_not_depend_on_tp(tmp_path):
    prompts = [_prompt(4, 84), _prompt(5, 37)]
    hits = {}
    for tp in (1, 2):
        d = tmp_path / f"tp{tp}"
        d.mkdir()
        _run(d, tp, prompts)
        hits[tp] = [r.ext for r in _run(d, tp, prompts)]
    assert hits[2] == hits[1] == [expected_hits(len(p)) for p in prompts]


@pytest.mark.parametrize("tp", TPS)
def test_partial_prefix(root, tp):
    p = _prompt(6, 80)
    _run(root, tp, [p])
    with _engine(root, tp) as e:
        q = e.run_prompts([p[:2 * BLOCK] + _prompt(7, 30)])[0]  # shares its first 2 blocks
        assert (q.local, q.ext) == (0, 2 * BLOCK)
        other = e.run_prompts([_prompt(8, 40)])[0]  # shares nothing
        assert (other.local, other.ext) == (0, 0)
        again = e.run_prompts([p])[0]  # its first 2 blocks are in vLLM's cache now
        assert (again.local, again.ext) == (2 * BLOCK, len(p) - 1 - 2 * BLOCK)
        assert_scheduler_empty(e)


@pytest.mark.parametrize("tp", TPS)
def test_prompt_lengths(root, tp):
    lengths = [1, 2, 10, 15, 16, 17, 33]
    prompts = [_prompt(100 + n, n) for n in lengths]
    first = _run(root, tp, prompts)
    assert all(r.ext == 0 and _finished(r) for r in first)
    H.assert_stored(H.store_config(root, "memory|posix"), prompts, tp=tp)


# ---------------------------------------------------------------------------------------------
# 4-5: preemption, aborts


@pytest.mark.parametrize("tp", TPS)
def test_preemption_in_a_small_cache(root, tp):
    prompts = [_prompt(20 + i, 40 + i) for i in range(4)]
    with _engine(root, tp, num_blocks=12) as e:
        reqs = e.run_prompts(prompts, max_tokens=12)
        assert all(_finished(r) and len(r.output) == 12 for r in reqs)
        assert sum(r.request.num_preemptions for r in reqs) > 0, "no preemption happened"
        assert_scheduler_empty(e)
    # every prompt block was stored, preempted requests' included
    H.assert_stored(H.store_config(root, "memory|posix"), prompts, tp=tp)


@pytest.mark.parametrize("prefix_caching", [pytest.param(True, id="prefix-cache"),
                                            pytest.param(False, id="no-prefix-cache")])
@pytest.mark.parametrize("tp", TPS)
def test_saves_landing_late_store_each_block_once(root, tp, prefix_caching):
    """Saves that land several steps after they were planned (a slow tier): a request reaching
    blocks whose save is still in flight (vLLM's prefix cache off or evicted, a preempted request
    recomputing) computes them, as it must (a save in flight is not a hit), but does not plan
    them again. Requests arrive one per step, so no two share the step that first saves a block."""
    a, c = _prompt(25, 8 * BLOCK), _prompt(26, 30 * BLOCK)
    prompts = [a[:8 * BLOCK - 4], a[:7 * BLOCK] + c[:BLOCK - 4], a[:5 * BLOCK + 3],
               c[10 * BLOCK:18 * BLOCK - 9]]
    with _engine(root, tp, num_blocks=20, prefix_caching=prefix_caching) as e:
        e.slow_commits(0.05)
        reqs = []
        for p in prompts:
            reqs.append(e.add(p, max_tokens=12))
            e.step()
        e.run()
        assert all(_finished(r) and len(r.output) == 12 for r in reqs)
        twice = {k: n for k, n in e.planned_saves.items() if n > 1}
        assert not twice, f"{len(twice)} blocks planned for saving more than once"
        assert len(e.planned_saves) >= 7 + 7 + 4  # (a's and c's full prompt blocks, 4 tails)
        assert_scheduler_empty(e)
    H.assert_stored(H.store_config(root, "memory|posix"), prompts, tp=tp)


@pytest.mark.parametrize("tp", TPS)
def test_a_block_evicted_after_its_save_is_saved_again(root, tp):
    """Requests one at a time through a memory tier too small for them: a prompt's blocks are
    evicted by the next ones, so the prompt coming back recomputes them and must store them
    again. Its ids stayed "planned" for SAVING_STEPS steps after their save had landed, so it
    stored nothing and the third time missed again."""
    a, b, c = _prompt(40, 4 * BLOCK + 5), _prompt(41, 4 * BLOCK + 5), _prompt(42, 4 * BLOCK + 5)
    extra = H.store_config(root, "memory|posix")
    extra["buffer_number"] = 8 * tp      # a prompt takes 5 per rank (4 blocks and its tail)
    with H.Engine(extra, tp=tp, prefix_caching=False) as e:
        hits = [e.run_prompts([p])[0].ext for p in (a, b, c)]
        # the posix tier's files collected meanwhile (another engine's budget, an operator)
        for d, sub, files in os.walk(root):
            sub[:] = [x for x in sub if not x.startswith(".")]
            for f in files:
                if not f.startswith("."):
                    os.remove(os.path.join(d, f))
        hits += [e.run_prompts([p])[0].ext for p in (a, a)]
        assert_scheduler_empty(e)
    assert hits[:3] == [0, 0, 0] and hits[3] < expected_hits(len(a)), hits
    assert hits[4] == expected_hits(len(a)), hits


@pytest.mark.parametrize("tp", TPS)
def test_abort_right_after_the_load_step(root, tp):
    p = _prompt(30, 70)
    _run(root, tp, [p])
    with _engine(root, tp) as e:
        r = e.add(p, max_tokens=4)
        e.step()
        assert r.ext == expected_hits(len(p))
        e.abort(r.req_id)
        e.run()
        assert_scheduler_empty(e)
        again = e.run_prompts([p])[0]
        assert again.local + again.ext == len(p) - 1 and _finished(again)
        assert_scheduler_empty(e)


@pytest.mark.parametrize("tp", TPS)
def test_abort_mid_prefill_with_saves_in_flight(root, tp):
    p = _prompt(31, 100)
    with _engine(root, tp, max_num_batched_tokens=32) as e:
        r = e.add(p)
        out = e.step()
        assert out.scheduled == {r.req_id: 32} and r.request.num_computed_tokens == 32
        e.abort(r.req_id)
        e.run()
        assert_scheduler_empty(e)
    (again,) = _run(root, tp, [p])
    assert again.ext in (0, 2 * BLOCK)  # what the aborted request had computed, or nothing
    assert _finished(again)


@pytest.mark.parametrize("tp", TPS)
def test_abort_while_waiting(root, tp):
    big, small = _prompt(32, 150), _prompt(33, 60)
    _run(root, tp, [small])  # the waiting request has a store hit (the connector saw it)
    with _engine(root, tp, num_blocks=12, max_num_batched_tokens=256) as e:
        a = e.add(big, max_tokens=3)
        b = e.add(small)
        e.step()
        assert a.request.status == RequestStatus.RUNNING
        assert b.request.status == RequestStatus.WAITING  # no room for it
        assert b.lookups > 0  # the connector was asked about it
        e.abort(b.req_id)
        e.run()
        assert _finished(a) and b.request.status == RequestStatus.FINISHED_ABORTED
        assert_scheduler_empty(e)


# ---------------------------------------------------------------------------------------------
# 6: failed loads

P_FAIL = 4 * BLOCK + 8  # 4 full blocks and a partial last block (a stored tail)

WHERE = {
    "first": lambda row: row.index == 0,
    "middle": lambda row: row.index == 2,
    "all": lambda row: True,
    "tail": lambda row: row.tail or row.index == 4,
    "shared": lambda row: row.index == 1,
}


@pytest.mark.parametrize("after", ["complete", "abort", "preempt"])
@pytest.mark.parametrize("where", list(WHERE))
@pytest.mark.parametrize("tp", TPS)
def test_failed_load(root, tp, where, after):
    """A load fails at ``where`` (for "middle" on the last rank only); the request then
    completes, is aborted or is preempted; later requests with the same prompt in the same
    engine must never attend to the block that failed, and nothing may leak."""
    p = _prompt(40, P_FAIL)
    q = p[:3 * BLOCK] + _prompt(41, 20)  # shares blocks 0-2 with p
    _run(root, tp, [p])
    with _engine(root, tp, max_num_batched_tokens=256) as e:
        ranks = [tp - 1] if where == "middle" else None
        x = e.add(p, max_tokens=3)
        y = e.add(q, max_tokens=3) if where == "shared" else None
        e.inject_load_faults(lambda row: row.req_id == x.req_id and WHERE[where](row), ranks=ranks)
        out = e.step()
        assert x.ext == expected_hits(len(p))
        assert e.injected() and out.invalid, "no load failed"
        if y is not None:
            assert y.req_id in out.scheduled and y.local == 3 * BLOCK  # on x's blocks, same step
        if after == "abort":
            e.abort(x.req_id)
        elif after == "preempt":
            e.preempt(x.req_id)
        e.run()
        assert x.request.status == (RequestStatus.FINISHED_ABORTED if after == "abort"
                                    else RequestStatus.FINISHED_LENGTH_CAPPED)
        e.clear_load_faults()
        later = e.run_prompts([p] + ([q] if y is not None else []))
        assert all(_finished(r) for r in later)
        assert_scheduler_empty(e)


# ---------------------------------------------------------------------------------------------
# 7-10


@pytest.mark.parametrize("tp", TPS)
def test_six_requests_sharing_a_prefix_in_one_step(root, tp):
    prefix = _prompt(50, 3 * BLOCK)
    prompts = [prefix + _prompt(51 + i, 10 + 3 * i) for i in range(6)]
    for n_engine in range(2):
        with _engine(root, tp, max_num_batched_tokens=512) as e:
            reqs = [e.add(p) for p in prompts]
            out = e.step()
            assert len(out.scheduled) == 6
            e.run()
            assert all(_finished(r) for r in reqs)
            if n_engine == 0:
                assert reqs[0].ext == 0 and all(r.local == 3 * BLOCK for r in reqs[1:])
            else:
                assert reqs[0].ext == expected_hits(len(prompts[0]))
                assert all(r.local + r.ext == r.n - 1 for r in reqs)
            assert_scheduler_empty(e)


@pytest.mark.parametrize("tp", TPS)
def test_producer_then_consumer(root, tp):
    prompts = [_prompt(60, 84), _prompt(61, 23)]
    made = _run(root, tp, prompts, role="kv_producer")
    assert all(r.ext == 0 for r in made)
    used = _run(root, tp, prompts, role="kv_consumer")
    assert [r.ext for r in used] == [expected_hits(len(p)) for p in prompts]
    only_consumed = _prompt(62, 50)
    _run(root, tp, [only_consumed], role="kv_consumer")  # a consumer saves nothing
    (r,) = _run(root, tp, [only_consumed])
    assert r.ext == 0


@pytest.mark.parametrize("tp", TPS)
def test_reset_invalidates_the_store(root, tp):
    p1, p2, p3 = _prompt(70, 84), _prompt(71, 60), _prompt(72, 45)
    with _engine(root, tp) as e:
        e.run_prompts([p1, p2])
        assert e.scheduler.reset_prefix_cache(reset_connector=True) is True
        r1 = e.run_prompts([p1])[0]
        assert (r1.local, r1.ext) == (0, 0)
        e.run_prompts([p3])  # stored after the reset
        assert_scheduler_empty(e)
    r2, r3 = _run(root, tp, [p2, p3])
    assert r2.ext == 0
    assert r3.ext == expected_hits(len(p3))


@pytest.mark.parametrize("tp", TPS)
def test_same_prompt_after_eviction(root, tp):
    p = _prompt(80, 48)
    with _engine(root, tp, num_blocks=16) as e:
        first = e.run_prompts([p])[0]
        for i in range(6):
            e.run_prompts([_prompt(81 + i, 48)])
        again = e.run_prompts([p])[0]
        assert first.ext == 0
        assert again.local == 0, "the prompt was not evicted from vLLM's cache"
        assert again.ext == expected_hits(len(p))
        assert_scheduler_empty(e)


# ---------------------------------------------------------------------------------------------
# 11: isolation


@pytest.mark.parametrize("tp", TPS)
def test_lora_kv_is_never_served_to_plain_requests_and_back(root, tp):
    p1, p2 = _prompt(90, 84), _prompt(91, 60)
    with _engine(root, tp) as e:
        e.run_prompts([p1], lora="adapter-a")
        plain = e.run_prompts([p1])[0]
        assert (plain.local, plain.ext) == (0, 0)
        e.run_prompts([p2])
        adapted = e.run_prompts([p2], lora="adapter-a")[0]
        assert (adapted.local, adapted.ext) == (0, 0)
        other = e.run_prompts([p1], lora="adapter-b")[0]
        assert other.ext == 0
        assert_scheduler_empty(e)
    plain, adapted = _run(root, tp, [p1, p2])
    assert plain.ext == expected_hits(len(p1)) and adapted.ext == expected_hits(len(p2))
    # KV computed under an adapter is stored under that adapter's keys: the adapter hits it
    (again,) = _run(root, tp, [p1], add={"lora": "adapter-a"})
    assert again.ext == expected_hits(len(p1))


@pytest.mark.parametrize("tp", TPS)
def test_tenants_never_share_blocks(root, tp):
    p = _prompt(92, 84)
    with _engine(root, tp) as e:
        a = e.run_prompts([p], salt="tenant-a")[0]
        b = e.run_prompts([p], salt="tenant-b")[0]
        plain = e.run_prompts([p])[0]
        assert a.ext == 0 and (b.local, b.ext) == (0, 0) and (plain.local, plain.ext) == (0, 0)
        assert_scheduler_empty(e)
    (a2,) = _run(root, tp, [p], add={"salt": "tenant-a"})
    (c,) = _run(root, tp, [p], add={"salt": "tenant-c"})
    assert a2.ext == expected_hits(len(p))  # the same tenant hits
    assert c.ext == 0


@pytest.mark.parametrize("tp", TPS)
def test_multimodal_kv_is_isolated_as_in_vllms_prefix_cache(root, tp):
    """An image at tokens 40-59: blocks 0-1 are the same KV with or without it (vLLM shares
    them too), the rest differs; a request with another image never gets them."""
    p = _prompt(93, 84)
    img = [(40, 20, "image-1")]
    with _engine(root, tp, encoder_budget=4096) as e:
        e.run_prompts([p], mm=img)
        plain = e.run_prompts([p])[0]
        assert plain.local + plain.ext in (0, 2 * BLOCK)
        other = e.run_prompts([p], mm=[(40, 20, "image-2")])[0]
        assert other.local + other.ext in (0, 2 * BLOCK)
        assert_scheduler_empty(e)
    with _engine(root, tp, encoder_budget=4096) as e:
        same = e.run_prompts([p], mm=img)[0]
        # the same image hits its full blocks (partial blocks of requests with per-block
        # extra keys are not stored)
        assert same.ext == (len(p) - 1) // BLOCK * BLOCK
        assert_scheduler_empty(e)


# ---------------------------------------------------------------------------------------------
# 12: soak


@pytest.mark.parametrize("tp", TPS)
def test_random_soak(root, tp):
    """300 steps of a seeded random mix: prompts from 8 prefixes with random suffixes, two
    tenants, random aborts, a quarter of the loaded blocks failing (each rank drawing on its
    own), a 16-block cache (preemptions)."""
    rng = np.random.default_rng(1234 + tp)
    prefixes = [_prompt(200 + i, n) for i, n in enumerate([16, 40, 64, 23, 80, 33, 48, 70])]
    fault_rng = np.random.default_rng(99)
    with _engine(root, tp, num_blocks=16, max_num_batched_tokens=64) as e:
        e.inject_load_faults(lambda row: fault_rng.random() < 0.25, once=False)
        live = []
        for _ in range(300):
            if rng.random() < 0.4 and len(live) < 8:
                pre = prefixes[rng.integers(len(prefixes))]
                suffix = _prompt(int(rng.integers(1 << 30)), int(rng.integers(0, 30)))
                salt = "tenant-1" if rng.random() < 0.15 else None
                live.append(e.add(pre + suffix, max_tokens=int(rng.integers(1, 24)),
                                  salt=salt).req_id)
            if live and rng.random() < 0.04:
                req = e.scheduler.requests.get(live[int(rng.integers(len(live)))])
                if req is not None and not req.is_finished():
                    e.abort(req.request_id)
            if e.scheduler.has_requests():
                e.step()
            live = [r for r in live if r in e.scheduler.requests]
        e.clear_load_faults()
        e.run()
        assert_scheduler_empty(e)
        reqs = list(e.reqs.values())
        assert len(e.injected()) > 5, "too few load failures"
        assert sum(r.request.num_preemptions for r in reqs) > 0, "no preemption"
        assert sum(bool(r.ext) for r in reqs) > 10, "too few store hits"
        assert any(r.request.status == RequestStatus.FINISHED_ABORTED for r in reqs)


# ---------------------------------------------------------------------------------------------
# prefetch of queued requests (connector.prefetch, vLLM's on_new_request)


def _memory_tier(engine, rank=0):
    store = engine.workers[rank].core.store
    return store.tiers[0], store


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no-prefetch"])
@pytest.mark.parametrize("tp", TPS)
def test_queued_requests_blocks_move_to_memory_while_they_wait(root, tp, prefetch):
    """A new engine whose blocks are only on disk; one request runs at a time. The requests
    queued behind the first have their blocks promoted into the memory tier before vLLM
    schedules them, so their loads read memory; without prefetch they read the disk."""
    prompts = [_prompt(40 + i, 90) for i in range(3)]
    _run(root, tp, prompts)
    opts = {"prefetch": prefetch}
    with _engine(root, tp, connector=opts, max_num_seqs=1) as e:
        for p in prompts:
            e.add(p, max_tokens=4)
        e.step()  # r1 runs; r2 and r3 wait
        for r in range(tp):
            mem, store = _memory_tier(e, r)
            store.flush()  # (the promotion runs in the background)
            sched = e.connector.sched
            ids = np.concatenate([sched._hashes(sched._state(e.reqs[rid].request), (len(p) - 1) // BLOCK)
                                  for rid, p in zip(("r2", "r3"), prompts[1:])])
            held = mem.lookup(e.workers[r].core.rank_ids(ids))
            assert all(held) if prefetch else not any(held), held
            hinted = e.workers[r].core.metrics.totals().get("ucm_prefetch_hint_blocks_total", 0)
            assert (hinted == len(ids)) if prefetch else hinted == 0
        e.run()
        reqs = [e.reqs[f"r{i}"] for i in (1, 2, 3)]
        assert [r.ext for r in reqs] == [expected_hits(len(p)) for p in prompts]
        assert all(_finished(r) for r in reqs)
        hits = e.workers[0].core.store.stats()["pipeline"]["hits_by_tier"]
        assert_scheduler_empty(e)
    # the queued requests' blocks were found in memory with prefetch, on disk without it
    full = sum(expected_hits(len(p)) // BLOCK for p in prompts[1:])
    assert (hits["memory"] >= full) if prefetch else hits["memory"] < full, hits
