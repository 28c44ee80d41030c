#!/usr/bin/env python3
"""Exploration: INT4 keys per channel (KIVI, the INT4 codec's default) with their codes picked by
a key rounding (ucm.codecs.fit_key_rounding on calibration queries) against rounding to nearest,
in evals/kv_sensitivity.py's harness (SmolLM2 float32, teacher-forced KL, top-1 changes)."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

import torch  # noqa: E402

import kv_sensitivity as ks  # noqa: E402
from ucm.reference.compress import dequant4, quant4, quant_asym, round_keys  # noqa: E402

LAYER = [0]
ROUND = {}


def keys_rounded(k):                       # k [T, H, D], one block of one layer
    _, m, s = quant_asym(k[None], 1, 15)
    q = round_keys(k[None], m, s, ROUND["r"], LAYER[0], levels=15)
    return dequant4(q, m, s)[0]


def main():
    from transformers import AutoTokenizer

    from compression_quality import documents, model_query_moments
    from ucm.codecs import fit_key_rounding
    from ucm.models import ensure_smollm2
    path = ensure_smollm2()
    tok = AutoTokenizer.from_pretrained(path)
    _, cal = documents(tok, 16, 1280)
    ROUND["r"] = fit_key_rounding(model_query_moments(path, cal[:8], 1024))
    base = ks._schemes

    def schemes():
        out = base()
        v4 = out["int4"][1]
        out["int4-r"] = (keys_rounded, v4)
        out["k-int4-r"] = (keys_rounded, None)
        return out
    ks._schemes = schemes
    orig = ks._apply
    count = [0]

    def apply(fn, x):
        if fn is keys_rounded:
            LAYER[0] = count[0] % 30
            count[0] += 1
        return orig(fn, x)
    ks._apply = apply
    return ks.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
