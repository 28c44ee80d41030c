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

import json
import os
from typing import Iterable, Sequence

import numpy as np

from ucm.codecs import KeyRounding, check_damp, fit_key_rounding, query_moments
from ucm.files import open_regular


def check_max_tokens(max_tokens) -> int:
    """``max_tokens`` as an int; ValueError unless an integer >= 1 (not a bool)."""
    if isinstance(max_tokens, (bool, np.bool_)) or not isinstance(max_tokens, (int, np.integer)) \
            or max_tokens < 1:
        raise ValueError(f"calibration: max_tokens must be an int >= 1, got {max_tokens!r}")
    return int(max_tokens)


def _unsupported(config: dict) -> str:
    """Why :mod:`ucm.reference.llama` would compute other queries than the model of
    ``config`` (its config.json) makes, or "" when it runs that model as it is: Llama with the
    default rotary embedding, no biases, SiLU, whole numbers of heads."""
    if config.get("model_type", "llama") != "llama":
        return f"model_type {config['model_type']!r}, expected 'llama'"
    for k in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size",
              "vocab_size") + (("head_dim",) if config.get("head_dim") is not None else ()):
        v = config.get(k)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            return f"config.json {k}: an int >= 1 expected, got {v!r}"
    if config["num_attention_heads"] % config["num_key_value_heads"]:
        return "num_attention_heads is not a multiple of num_key_value_heads"
    for k in ("attention_bias", "mlp_bias"):
        if config.get(k):
            return f"{k} true (the reference has no biases)"
    if config.get("hidden_act", "silu") != "silu":
        return f"hidden_act {config['hidden_act']!r} (the reference runs 'silu')"
    for k in ("rope_scaling", "rope_parameters"):
        rope = config.get(k) or {}
        kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else rope
        if kind not in (None, "default"):
            return f"{k} rope_type {kind!r} (the reference applies the default rotary embedding)"
    theta = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0 \
            or isinstance(config.get("rms_norm_eps"), bool) \
            or not isinstance(config.get("rms_norm_eps"), (int, float)):
        return "config.json needs a positive rope_theta and a number rms_norm_eps"
    return ""


def _weights_unlike_config(model) -> str:
    """The first weight whose shape the model's config does not give, or ""."""
    hq, hk, hd = model.num_q_heads, model.num_kv_heads, model.head_dim
    e = model.hidden
    want = [("model.embed_tokens.weight", model.embed, (model.vocab_size, e)),
            ("lm_head.weight", model.lm_head, (model.vocab_size, e)),
            ("model.norm.weight", model.norm, (e,))]
    for i, w in enumerate(model.layers):
        inter = w["down"].shape[0]
        want += [(f"layer {i} input_layernorm", w["ln1"], (e,)),
                 (f"layer {i} post_attention_layernorm", w["ln2"], (e,)),
                 (f"layer {i} q/k/v_proj", w["qkv"], (e, (hq + 2 * hk) * hd)),
                 (f"layer {i} o_proj", w["o"], (hq * hd, e)),
                 (f"layer {i} gate/up_proj", w["gate_up"], (e, 2 * inter)),
                 (f"layer {i} down_proj", w["down"], (inter, e))]
    for name, t, shape in want:
        if tuple(t.shape) != shape:
            return f"{name} is {list(t.shape)}, its config.json gives {list(shape)}"
    return ""


def load_model(model_path: str, device: str = "cpu"):
    """:class:`ucm.reference.llama.Llama` of the folder ``model_path`` on ``device``; ValueError
    naming the folder when it is not a Llama this reference runs as the model is."""
    from ucm.reference.llama import Llama

    where = f"model {model_path!r}"
    path = os.path.join(str(model_path), "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{where}: no config.json (a Llama-architecture Hugging Face folder is "
                         f"expected)")
    try:
        with open_regular(path, "r", encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError, RecursionError) as exc:
        raise ValueError(f"{where}: config.json is not readable JSON ({exc})") from None
    why = _unsupported(config) if isinstance(config, dict) else "config.json is not a JSON object"
    if not why:
        try:
            model = Llama.load(str(model_path))
            why = _weights_unlike_config(model)
        except (KeyError, OSError, ValueError, TypeError, OverflowError, MemoryError) as exc:
            why = f"{type(exc).__name__}: {exc}" if str(exc) else \
                f"{type(exc).__name__} reading model.safetensors"
    if why:
        raise ValueError(f"{where}: not a Llama-architecture checkpoint this reference can run "
                         f"({why})")
    try:
        return model.to(device)
    except (RuntimeError, AssertionError, TypeError) as exc:    # (no CUDA: AssertionError)
        raise ValueError(f"device {device!r}: {exc}") from None


def query_moments_on(model_path: str, sequences: Iterable[Sequence[int]], *,
                     max_tokens: int = 2048, device: str = "cpu",
                     progress: bool = False) -> list:
    """Per layer, ``[H, D, D]`` float64 second moments of the queries ``model_path`` makes on
    ``sequences`` (token ids; each cut to its first ``max_tokens``), weighted by token."""
    from ucm import progress as bars

    max_tokens = check_max_tokens(max_tokens)
    seqs = []
    for i, s in enumerate([None] if sequences is None else sequences):
        try:
            seqs.append(list(s)[:max_tokens])
        except TypeError:
            what = "sequences" if sequences is None else f"sequence {i}"
            raise ValueError(f"calibration: {what}: token-id sequences expected (a list of lists "
                             f"of ints), got {type(s).__name__}") from None
    if not any(seqs):
        raise ValueError("calibration: no tokens (every sequence is empty)")
    model = load_model(model_path, device)
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
    damp = check_damp(damp)                                 # (before the model runs)
    return fit_key_rounding(query_moments_on(model_path, sequences, max_tokens=max_tokens,
                                             device=device, progress=progress), damp=damp)
