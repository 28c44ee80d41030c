"""Block keys of vLLM requests (``ucm.integration.vllm.keys``), the store's generation, the
``evict_failed_loads`` patch and the refusal of a store the scheduler cannot see.

Real vLLM ``Request`` objects (LoRA, cache_salt, multimodal features, prompt embeds), real
stores on disk. The engine-level behaviour (hits, isolation, failed loads, reset through a real
vLLM scheduler) is in ``test_connector_sched.py``.
"""
import os

import numpy as np
import pytest
import torch

from conftest import require_vllm_module

pytestmark = [pytest.mark.vllm]

require_vllm_module()

from vllm import SamplingParams  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

import ucm  # noqa: E402
from ucm.ids import Namespace  # noqa: E402
from ucm.integration.vllm import keys  # noqa: E402
from ucm.store import open_store  # noqa: E402

BS = 16
NS = Namespace(model="m", dtype="bfloat16", block_size=BS)
TAIL = bytes(range(16))


def _req(tokens, rid="r", **kw):
    return Request(rid, list(tokens), SamplingParams(max_tokens=1), None, **kw)


def _ids(req, n, generation=0):
    return keys.RequestKeys(req, NS, generation, TAIL).full(req, n)


TOKS = list(range(100, 100 + 4 * BS + 5))


def test_plain_requests_keep_the_plain_chain():
    """Generation 0, no LoRA/salt/multimodal: the ids of every earlier ucm (stores stay valid)."""
    got = _ids(_req(TOKS), 4)
    want = ucm.hash_blocks(np.asarray(TOKS[:4 * BS]), NS)
    assert np.array_equal(got, want)
    # computed incrementally (as the scheduler does) the same
    k = keys.RequestKeys(_req(TOKS), NS, 0, TAIL)
    r = _req(TOKS)
    k.full(r, 1)
    k.full(r, 3)
    assert np.array_equal(k.full(r, 4), want)


@pytest.mark.parametrize("kw", [
    {"lora_request": LoRARequest("ad", 1, "/a")},
    {"cache_salt": "tenant-a"},
])
def test_request_wide_keys_separate_every_block(kw):
    plain, other = _ids(_req(TOKS), 4), _ids(_req(TOKS, **kw), 4)
    assert not (plain[:, None, :] == other[None, :, :]).all(-1).any()


def test_lora_name_and_path_and_salts_each_separate():
    a = _ids(_req(TOKS, lora_request=LoRARequest("ad", 1, "/a")), 2)
    assert np.array_equal(a, _ids(_req(TOKS, lora_request=LoRARequest("ad", 7, "/a")), 2))  # int id: no
    assert not np.array_equal(a, _ids(_req(TOKS, lora_request=LoRARequest("ad", 1, "/b")), 2))
    assert not np.array_equal(a, _ids(_req(TOKS, lora_request=LoRARequest("bd", 1, "/a")), 2))
    s = _ids(_req(TOKS, cache_salt="x"), 2)
    assert np.array_equal(s, _ids(_req(TOKS, cache_salt="x"), 2))
    assert not np.array_equal(s, _ids(_req(TOKS, cache_salt="y"), 2))


def test_generation_separates_every_block():
    g0, g1, g2 = (_ids(_req(TOKS), 4, g) for g in (0, 1, 2))
    assert not (g0 == g1).all(-1).any() and not (g1 == g2).all(-1).any()


def _mm(identifier, offset, length):
    return MultiModalFeatureSpec(data=None, modality="image", identifier=identifier,
                                 mm_position=PlaceholderRange(offset=offset, length=length))


def test_multimodal_items_key_the_blocks_they_touch():
    """Same placeholder tokens, different images: the blocks from the image on differ, the
    blocks before it are shared (as in vLLM's prefix cache)."""
    toks = [7] * (4 * BS)
    a = _ids(_req(toks, mm_features=[_mm("img-a", BS + 3, 20)]), 4)
    b = _ids(_req(toks, mm_features=[_mm("img-b", BS + 3, 20)]), 4)
    same = _ids(_req(toks, mm_features=[_mm("img-a", BS + 3, 20)]), 4)
    moved = _ids(_req(toks, mm_features=[_mm("img-a", BS + 4, 20)]), 4)
    plain = _ids(_req(toks), 4)
    assert np.array_equal(a, same)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[0], plain[0])
    for other in (b, moved, plain):
        assert not (a[1:] == other[1:]).all(-1).any()


def test_prompt_embeds_key_each_block():
    e = torch.arange(3 * BS * 4, dtype=torch.float32).reshape(3 * BS, 4)
    toks = [0] * (3 * BS)
    a = _ids(_req(toks, prompt_embeds=e), 3)
    e2 = e.clone()
    e2[BS + 1, 0] += 1  # one value in block 1 differs
    b = _ids(_req(toks, prompt_embeds=e2), 3)
    assert np.array_equal(a[0], b[0])
    assert not (a[1:] == b[1:]).all(-1).any()
    # partial tails are not stored for such requests
    assert keys.RequestKeys(_req(toks, prompt_embeds=e), NS, 0, TAIL).tail(_req(toks, prompt_embeds=e), 1, 3) is None


def test_rank_keys_are_one_rule_for_both_sides():
    ids = ucm.hash_blocks(np.asarray(TOKS[:4 * BS]), NS)
    one = keys.ParallelShape()
    assert keys.rank_ids(ids, 0, one) is ids and keys.all_rank_ids(ids, one) is ids
    tp2 = keys.ParallelShape(tp=2)
    both = keys.all_rank_ids(ids, tp2)
    assert np.array_equal(both[:4], keys.rank_ids(ids, 0, tp2))
    assert np.array_equal(both[4:], keys.rank_ids(ids, 1, tp2))
    assert len({r.tobytes() for r in both}) == 8  # ranks never share a key
    pp2 = keys.ParallelShape(pp=2)  # same world size, other shards: other keys
    assert not (keys.rank_ids(ids, 0, pp2) == keys.rank_ids(ids, 0, tp2)).all(-1).any()
    with pytest.raises(ValueError, match="rank 2"):
        keys.rank_ids(ids, 2, tp2)


def test_worker_rank_drops_the_data_parallel_part():
    class PC:
        tensor_parallel_size, pipeline_parallel_size, prefill_context_parallel_size = 2, 1, 1
        rank = 5  # data-parallel engine 2, tensor rank 1

    class VC:
        parallel_config = PC()

    assert keys.worker_rank(VC()) == 1


# -- the generation --------------------------------------------------------------------------

def test_generation_persists_in_a_posix_root(tmp_path):
    cfg = {"store": {"pipeline": "memory|posix", "posix": {"roots": [str(tmp_path)]}}}
    with open_store(cfg, block_bytes=4096, namespace=NS.digest()) as s:
        assert s.generation() == 0
        assert s.set_generation(3) == 3
        assert s.set_generation(1) == 3  # never lowered
    with open_store(cfg, block_bytes=8192, namespace=NS.digest()) as s:  # any geometry
        assert s.generation() == 3
    other = Namespace(model="other", dtype="bfloat16", block_size=BS)
    with open_store(cfg, block_bytes=4096, namespace=other.digest()) as s:
        assert s.generation() == 0  # per namespace
    ro = {"store": {"pipeline": "posix", "posix": {"roots": [str(tmp_path)], "read_only": True}}}
    with open_store(ro, block_bytes=4096, namespace=NS.digest()) as s:
        assert s.generation() == 3
        with pytest.raises(OSError):
            s.set_generation(4)
    with open_store({"store": {"pipeline": "memory"}}, block_bytes=4096, namespace=NS.digest()) as s:
        assert s.set_generation(2) == 2 and s.generation() == 2  # process-local


def test_generation_file_behind_a_link_is_refused(tmp_path):
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.write_text("9\n")
    cfg = {"store": {"pipeline": "posix", "posix": {"roots": [str(root)]}}}
    with open_store(cfg, block_bytes=4096, namespace=NS.digest()):
        pass
    os.symlink(elsewhere, root / ".ucm" / f"generation.{NS.digest().hex()}")
    with open_store(cfg, block_bytes=4096, namespace=NS.digest()) as s:
        with pytest.raises(ValueError, match="symbolic link"):
            s.generation()
    assert elsewhere.read_text() == "9\n"


# -- a store the scheduler cannot see ---------------------------------------------------------

@pytest.mark.parametrize("pipeline,backend,world,refused", [
    ("memory", "mp", 1, True),            # vLLM-CPU's default: the worker is another process
    ("memory", "ray", 2, True),
    ("memory", "uni", 1, False),          # the worker shares the scheduler's process
    ("memory", "external_launcher", 1, False),
    ("memory", "external_launcher", 2, True),
    ("memory|posix", "mp", 2, False),     # a shared tier: the scheduler sees what workers stored
    ("posix", "mp", 1, False),
])
def test_a_process_local_store_is_refused_when_workers_run_elsewhere(tmp_path, pipeline, backend,
                                                                      world, refused):
    from ucm.config import Config
    from ucm.integration.vllm.scheduler import refuse_unreachable_store

    cfg = Config({"store.pipeline": pipeline, "store.posix.roots": [str(tmp_path)]})
    shape = keys.ParallelShape(tp=world)

    class VC:
        class parallel_config:
            distributed_executor_backend = backend

    if refused:
        with pytest.raises(ValueError, match=r"'store\.pipeline'.*'memory\|posix'"):
            refuse_unreachable_store(cfg, VC(), shape)
    else:
        refuse_unreachable_store(cfg, VC(), shape)
