"""Regenerate tests/vectors/hashing.json from the reference implementation.

Run only when the algorithm is deliberately changed (which changes every block id ever stored):
    python tests/vectors/make_vectors.py > tests/vectors/hashing.json
The MurmurHash3 part is cross-checked in the tests against the independent `mmh3` package and
SMHasher's published verification value.
"""
import json

import numpy as np

from ucm.ids import Namespace
from ucm.reference.hashing import hash_blocks, murmur3_x64_128

murmur = []
for data, seed in [(b"", 0), (b"", 1), (b"hello", 0), (b"hello, world", 0),
                   (b"The quick brown fox jumps over the lazy dog", 0),
                   (bytes(range(16)), 0), (bytes(range(31)), 42), (bytes(range(32)), 0xFFFFFFFF)]:
    murmur.append({"data_hex": data.hex(), "seed": seed, "digest_hex": murmur3_x64_128(data, seed).hex()})

ns_cases = [
    Namespace(model="HuggingFaceTB/SmolLM2-135M-Instruct", dtype="bfloat16", block_size=16),
    Namespace(model="meta-llama/Meta-Llama-3-8B", dtype="bfloat16", block_size=16, kv_layout="vllm_cuda",
              tp_rank=1, tp_size=2, codec="int8", tenant_salt="tenant-a"),
]
namespaces = [{"fields": json.loads(ns.canonical()), "digest_hex": ns.digest().hex()} for ns in ns_cases]

chains = []
for tokens, bs, parent in [(list(range(64)), 16, None), (list(range(1000, 1050)), 16, None),
                           ([49151] * 33, 4, None), (list(range(7 * 5)), 7, "00" * 8 + "ff" * 8),
                           ([0, 1, 2, 4294967295, 5], 1, None)]:
    ns = ns_cases[0]
    par = np.zeros(2, np.uint64) if parent is None else np.frombuffer(bytes.fromhex(parent), "<u8").astype(np.uint64)
    ids = hash_blocks(np.array(tokens, dtype=np.uint32), bs, ns.digest_words(), par)
    chains.append({"namespace": 0, "tokens": tokens, "block_size": bs, "parent_hex": parent,
                   "ids_hex": [r.astype("<u8").tobytes().hex() for r in ids]})

print(json.dumps({"algorithm": "ucm block hash v1 = MurmurHash3_x64_128 chain, see docs/hashing.md",
                  "smhasher_verification": "0x6384BA69",
                  "murmur3_x64_128": murmur, "namespaces": namespaces, "chains": chains}, indent=1))
