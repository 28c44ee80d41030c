"""Calibration files for KV compression, measured on a model: the key rounding
(``compression.key_rounding``, :class:`ucm.codecs.KeyRounding`) from the queries a model makes on
sample text.

    from ucm.calibrate import fit_key_rounding_on
    r = fit_key_rounding_on("/path/to/llama-model", [ids_1, ids_2, ...])
    r.save("key_rounding.npz")

or on the command line, ``ucm calibrate --requests sample.jsonl --out key_rounding.npz``.

The model runs in :mod:`ucm.reference.llama` (float32, CPU or the device given): a Llama-
architecture folder with ``config.json`` and ``model.safetensors``. Its queries after the rotary
embedding, the ones that meet the cached keys, give each layer's second moments per KV head
(:func:`ucm.codecs.query_moments`, pooled over the layer's query heads), averaged over every
calibration token. Calibrate on text like the served traffic, not on the text evaluated.
"""
from __future__ import annotations

import os
from typing import Iterable, Sequence

import numpy as np

from ucm.codecs import KeyRounding, fit_key_rounding, query_moments


def query_moments_on(model_path: str, sequences: Iterable[Sequence[int]], *,
                     max_tokens: int = 2048, device: str = "cpu",
                     progress: bool = False) -> list:
    """Per layer, ``[H, D, D]`` float64 second moments of the queries ``model_path`` makes on
    ``sequences`` (token ids; each cut to its first ``max_tokens``), weighted by token."""
    from ucm import progress as bars
    from ucm.reference.llama import Llama

    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"calibration: max_tokens must be an int >= 1, got {max_tokens!r}")
    if not os.path.isfile(os.path.join(str(model_path), "config.json")):
        raise ValueError(f"model {model_path!r}: no config.json (a Llama-architecture Hugging "
                         f"Face folder is expected)")
    try:
        model = Llama.load(str(model_path)).to(device)
    except (KeyError, OSError) as exc:
        raise ValueError(f"model {model_path!r}: not a Llama-architecture checkpoint this "
                         f"reference can run ({type(exc).__name__}: {exc})") from None
    seqs = [list(s)[:max_tokens] for s in sequences]
    if not any(seqs):
        raise ValueError("calibration: no tokens (every sequence is empty)")
    for i, s in enumerate(seqs):
        bad = [t for t in s if not (isinstance(t, (int, np.integer)) and not isinstance(t, bool)
                                    and 0 <= t < model.vocab_size)]
        if bad:
            raise ValueError(f"calibration: sequence {i}: token {bad[0]!r} is not an id of this "
                             f"model's vocabulary (0..{model.vocab_size - 1})")
    sums = [0.0] * model.num_layers
    count = 0

    def observe(layer, q, k, v):                                  # a mean over the N tokens
        sums[layer] = sums[layer] + query_moments(q.cpu().numpy(), model.num_kv_heads) * len(q)

    for s in bars.track([s for s in seqs if s], "calibration", unit="seq", quiet=not progress):
        model.prefill(s, None, None, logits_from=len(s) - 1, observe=observe)
        count += len(s)
    return [x / count for x in sums]


def fit_key_rounding_on(model_path: str, sequences: Iterable[Sequence[int]], *,
                        damp: float = 0.1, max_tokens: int = 2048, device: str = "cpu",
                        progress: bool = False) -> KeyRounding:
    """:func:`ucm.codecs.fit_key_rounding` on the queries ``model_path`` makes on
    ``sequences`` (:func:`query_moments_on`)."""
    return fit_key_rounding(query_moments_on(model_path, sequences, max_tokens=max_tokens,
                                             device=device, progress=progress), damp=damp)

