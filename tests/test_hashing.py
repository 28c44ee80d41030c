"""Block hashing: standard MurmurHash3_x64_128, published vectors, stable across processes,
clear errors for bad input (implementations against the reference: test_equiv_foundation.py)."""
import json
import os
import struct

import numpy as np
import pytest

import ucm
from ucm.murmur import murmur3_x64_128
from conftest import impls_of, run_python
from services import require_module


@pytest.fixture(scope="module")
def mmh3():
    """The independent MurmurHash3 (a test extra): a failure in CI (UCM_REQUIRE_SERVICES=1)
    when missing, a skip of the two tests that use it elsewhere (the GPU machine)."""
    return require_module("mmh3")

VECTORS = json.load(open(os.path.join(os.path.dirname(__file__), "vectors", "hashing.json")))
NS = ucm.Namespace(model="HuggingFaceTB/SmolLM2-135M-Instruct", dtype="bfloat16", block_size=16)


def test_smhasher_verification_value():
    # SMHasher's VerificationTest: hash keys {0}, {0,1}, ... with seed 256-i, hash the
    # concatenation; the first 4 bytes little-endian are the published 0x6384BA69.
    key, hashes = bytearray(256), b""
    for i in range(256):
        key[i] = i
        hashes += murmur3_x64_128(bytes(key[:i]), 256 - i)
    assert struct.unpack("<I", murmur3_x64_128(hashes, 0)[:4])[0] == 0x6384BA69


@pytest.mark.parametrize("n", list(range(0, 49)) + [100, 1000])
def test_murmur_matches_independent_mmh3(n, mmh3):
    data = os.urandom(n)
    for seed in (0, 1, 0xFFFFFFFF):
        assert murmur3_x64_128(data, seed) == mmh3.hash_bytes(data, seed, x64arch=True)


def test_murmur_published_vectors():
    for v in VECTORS["murmur3_x64_128"]:
        assert murmur3_x64_128(bytes.fromhex(v["data_hex"]), v["seed"]).hex() == v["digest_hex"]


def test_namespace_vectors():
    for v in VECTORS["namespaces"]:
        ns = ucm.Namespace(**v["fields"])
        assert ns.digest().hex() == v["digest_hex"]


@pytest.mark.parametrize("backend", impls_of("hash_blocks"))
def test_chain_vectors(backend):
    ns = ucm.Namespace(**VECTORS["namespaces"][0]["fields"])
    for c in VECTORS["chains"]:
        parent = bytes.fromhex(c["parent_hex"]) if c["parent_hex"] else None
        ids = ucm.hash_blocks(c["tokens"], ns.digest(), c["block_size"], parent, backend=backend)
        assert ucm.id_hex(ids) == c["ids_hex"]


def test_chain_definition_with_mmh3(mmh3):
    """id_i = MurmurHash3(namespace || id_{i-1} || uint32 LE tokens), computed by mmh3."""
    tokens = np.arange(5 * 16 + 3, dtype=np.uint32) * 7919 % 49152
    ids = ucm.hash_blocks(tokens, NS)
    prev = bytes(16)
    for i in range(5):
        prev = mmh3.hash_bytes(NS.digest() + prev + tokens[16 * i:16 * (i + 1)].astype("<u4").tobytes())
        assert prev == ucm.id_bytes(ids[i:i + 1])[0]


def test_token_containers_hash_alike(rng):
    """A list, an int64 array and a strided view of the same ids give the same chain."""
    lst = rng.integers(0, 49152, 64).tolist()
    assert np.array_equal(ucm.hash_blocks(lst, NS), ucm.hash_blocks(np.array(lst, np.int64), NS))
    strided = np.arange(128, dtype=np.int64)[::2]  # non-contiguous
    assert np.array_equal(ucm.hash_blocks(strided, NS), ucm.hash_blocks(strided.copy(), NS))


def test_chaining_prefix_and_continuation(rng):
    tokens = rng.integers(0, 49152, 16 * 10)
    full = ucm.hash_blocks(tokens, NS)
    head = ucm.hash_blocks(tokens[:16 * 4], NS)
    assert np.array_equal(full[:4], head)
    tail = ucm.hash_blocks(tokens[16 * 4:], NS, parent=ucm.id_bytes(head[-1:])[0])
    assert np.array_equal(full[4:], tail)
    changed = tokens.copy()
    changed[16 * 3 + 5] += 1  # a change in block 3 changes block 3 and every later id
    other = ucm.hash_blocks(changed, NS)
    assert np.array_equal(other[:3], full[:3])
    assert not (other[3:] == full[3:]).all(axis=1).any()


def test_namespace_separates_everything():
    tokens = list(range(64))
    base = dict(model="m", dtype="bfloat16", block_size=16)
    variants = [dict(base), {**base, "model": "m2"}, {**base, "dtype": "float16"},
                {**base, "kv_layout": "vllm_cpu"}, {**base, "tp_rank": 1, "tp_size": 2},
                {**base, "tp_size": 2}, {**base, "codec": "int8"}, {**base, "tenant_salt": "x"}]
    first_ids = {ucm.id_hex(ucm.hash_blocks(tokens, ucm.Namespace(**v)))[0] for v in variants}
    assert len(first_ids) == len(variants)


def test_identical_across_processes():
    code = ("import ucm, numpy as np; ns = ucm.Namespace('m', 'bfloat16', 16);"
            "t = np.arange(4096) * 31 % 49152;"
            "print(ucm.id_hex(ucm.hash_blocks(t, ns, backend='{b}'))[-1])")
    outs = set()
    for backend in ("reference", "numba"):
        for seed in ("0", "12345"):  # Python's hash() randomisation must not matter
            r = run_python(code.format(b=backend), env={"PYTHONHASHSEED": seed})
            assert r.returncode == 0, r.stderr
            outs.add(r.stdout.strip())
    here = ucm.id_hex(ucm.hash_blocks(np.arange(4096) * 31 % 49152, ucm.Namespace("m", "bfloat16", 16)))[-1]
    assert outs == {here}


BAD = [
    (lambda: ucm.hash_blocks([], NS), "empty"),
    (lambda: ucm.hash_blocks(np.zeros(32, np.float32), NS), "integer"),
    (lambda: ucm.hash_blocks(np.zeros((2, 16), np.int64), NS), "1-D"),
    (lambda: ucm.hash_blocks([1, -1] * 16, NS), r"\[0, 2\*\*32\)"),
    (lambda: ucm.hash_blocks([2**32] * 16, NS), r"\[0, 2\*\*32\)"),
    (lambda: ucm.hash_blocks(["a"] * 16, NS), "integer"),
    (lambda: ucm.hash_blocks([True] * 16, NS), "integer"),
    (lambda: ucm.hash_blocks(range(32), bytes(16)), "block_size is required"),
    (lambda: ucm.hash_blocks(range(32), bytes(16), 0), "block_size"),
    (lambda: ucm.hash_blocks(range(32), bytes(16), -4), "block_size"),
    (lambda: ucm.hash_blocks(range(32), bytes(16), 2.5), "block_size"),
    (lambda: ucm.hash_blocks(range(32), NS, 8), "differs"),
    (lambda: ucm.hash_blocks(range(32), bytes(15), 16), "namespace"),
    (lambda: ucm.hash_blocks(range(32), NS, parent=bytes(17)), "parent"),
    (lambda: ucm.hash_blocks(range(32), NS, parent=[1, 2, 3]), "parent"),
    (lambda: ucm.Namespace("m", "bf16", 0), "block_size"),
    (lambda: ucm.Namespace("m", "bf16", 16, kv_layout=""), "kv_layout"),
    (lambda: ucm.Namespace("m", "bf16", 16, tp_rank=2, tp_size=2), "tp_rank"),
    (lambda: ucm.Namespace("", "bf16", 16), "model"),
]


@pytest.mark.parametrize("backend", impls_of("hash_blocks"))
@pytest.mark.parametrize("i", range(len(BAD)))
def test_bad_input(i, backend):
    fn, match = BAD[i]
    ucm.set_backend(backend)
    with pytest.raises(ValueError, match=match):
        fn()


def test_short_input_has_no_full_blocks():
    assert ucm.hash_blocks(list(range(15)), NS).shape == (0, 2)
