"""A small random Llama (2 layers, hidden 48, 6 query / 2 KV heads of 8 channels, vocabulary
97) for tests of code that runs a model: as weights for :class:`ucm.reference.llama.Llama`, or
written as a Hugging Face folder (config.json + model.safetensors)."""
from __future__ import annotations

import json
import math

import torch

HIDDEN, INTER = 48, 64


def weights(layers: int = 2, vocab: int = 97, seed: int = 0, scale: float = 1.0) -> tuple:
    """``(config, weights)`` of a random Llama; ``scale`` multiplies the projections (larger:
    sharper attention)."""
    g = torch.Generator().manual_seed(seed)
    H, I = HIDDEN, INTER
    cfg = {"num_hidden_layers": layers, "num_attention_heads": 6, "num_key_value_heads": 2,
           "hidden_size": H, "head_dim": 8, "vocab_size": vocab, "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0, "intermediate_size": I}
    w = {"model.embed_tokens.weight": torch.randn(vocab, H, generator=g),
         "model.norm.weight": 1 + 0.1 * torch.randn(H, generator=g)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name, shape in (("self_attn.q_proj", (48, H)), ("self_attn.k_proj", (16, H)),
                            ("self_attn.v_proj", (16, H)), ("self_attn.o_proj", (H, 48)),
                            ("mlp.gate_proj", (I, H)), ("mlp.up_proj", (I, H)),
                            ("mlp.down_proj", (H, I))):
            w[p + name + ".weight"] = scale * torch.randn(*shape, generator=g) / math.sqrt(shape[1])
        w[p + "input_layernorm.weight"] = torch.ones(H)
        w[p + "post_attention_layernorm.weight"] = torch.ones(H)
    return cfg, w


def tiny_model(**kw):
    """A :class:`ucm.reference.llama.Llama` of :func:`weights`."""
    from ucm.reference.llama import Llama

    return Llama(*weights(**kw))


def write_llama(d, **kw) -> str:
    """Write :func:`weights` as a Hugging Face folder ``d``; returns its path."""
    cfg, w = weights(**kw)
    header, blobs, off = {}, [], 0
    for name, t in w.items():
        b = t.contiguous().numpy().astype("<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "model.safetensors").write_bytes(len(h).to_bytes(8, "little") + h + b"".join(blobs))
    return str(d)
