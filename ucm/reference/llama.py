"""A small, readable pure-PyTorch Llama forward (SmolLM2 and any model of its architecture) with
a paged KV cache: the reference model of the sparse-attention accuracy harness (the AutoTuner's
sparse stage, ``evals/sparse_quality.py``, ``evals/sparse_retrieval.py``).

Float32 on CPU. Weights are read from a Hugging Face folder's ``model.safetensors``, parsed with
plain ``torch`` (no ``safetensors`` package needed). Architecture: token embedding, N x (RMSNorm,
GQA attention with RoPE, RMSNorm, SiLU-gated MLP), final RMSNorm, LM head (tied to the embedding
when the checkpoint has none).

API::

    from ucm.reference.llama import Llama, run_continuation

    model = Llama.load(path)                     # float32, CPU
    model.num_layers, model.num_q_heads, model.num_kv_heads, model.head_dim, model.vocab_size

    logits = model.forward(ids)                  # plain causal forward, no cache: [N, vocab]

    cache = model.new_cache(num_blocks, block_size=16)   # PagedKVCache: cache.k[l], cache.v[l]
                                                         # [num_blocks, block_size, Hkv, D]
    logits = model.prefill(ids, cache, block_ids, logits_from=0)
        # dense prefill of positions 0..N-1 into the physical blocks block_ids (in order); logits
        # of positions logits_from..N-1 only
    logits = model.decode(ids, cache, block_table, seq_lens, attend=None)
        # one token per row b at position seq_lens[b] - 1 (its K/V are written into the cache
        # first, as in vLLM); attend(layer, q, k_cache, v_cache, block_table, seq_lens) is called
        # per layer and returns None (attend densely) or (table, lens), the sparse block table
        # the row attends to (ucm.sparse's SparseMethod.attention_begin has this shape);
        # decode(..., mass=True) -> (logits, exact attention mass kept [num_layers, B])

    res = run_continuation(model, context_ids, continuation_ids, methods)
        # one dense prefill of context + continuation (the dense reference logits), then the
        # continuation tokens teacher-forced step by step, one batch row per entry of `methods`
        # (None = dense, or a SparseMethod); returns a Continuation: logits [rows, T, vocab]
        # (step t predicts the token after continuation[t]), dense_logits [T, vocab] of the same
        # positions, attention mass kept [rows, T], attended blocks [rows, T].

Decode attention (:func:`paged_attention`) is a masked softmax over the physical cache: a row
sees exactly the tokens of the blocks in its table (the last listed block up to ``seq_len``), the
same mathematics as a paged attention kernel on the table, and it is checked against
``ucm.sparse.ops.paged_decode_attention`` in ``tests/test_sparse_methods.py``.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

__all__ = ["Llama", "PagedKVCache", "Continuation", "paged_attention", "run_continuation",
           "load_safetensors"]

_ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}

Attend = Callable[..., Optional[tuple]]


def load_safetensors(path: str) -> dict[str, torch.Tensor]:
    """Read a ``.safetensors`` file (8-byte header length, JSON header, raw little-endian data)
    into float32 tensors."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        data = bytearray(f.read())
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        t = torch.frombuffer(data, dtype=_ST_DTYPES[info["dtype"]], count=(end - start) //
                             _ST_DTYPES[info["dtype"]].itemsize, offset=start)
        out[name] = t.reshape(info["shape"]).to(torch.float32)
    return out


@dataclass
class PagedKVCache:
    """Per-layer paged K and V: ``k[l], v[l]: [num_blocks, block_size, Hkv, D]`` float32."""
    k: list
    v: list

    @property
    def block_size(self) -> int:
        return self.k[0].shape[1]

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[0]


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _token_mask(block_table: torch.Tensor, seq_lens: torch.Tensor, used: int, bs: int) -> torch.Tensor:
    """bool ``[B, used * bs]``: the physical token slots a row's table covers (every listed block
    full except the last, which holds ``seq_len`` mod block size tokens)."""
    B, M = block_table.shape
    lens = seq_lens.to(torch.long)
    nblk = (lens + bs - 1) // bs
    idx = torch.arange(M)
    listed = idx[None, :] < nblk[:, None]
    count = torch.where(idx[None, :] < (nblk - 1)[:, None], bs, lens[:, None] - (nblk - 1)[:, None] * bs)
    count = torch.where(listed, count, 0)
    table = torch.where(listed, block_table.to(torch.long), 0)
    per_block = torch.zeros(B, used, dtype=torch.long)
    per_block.scatter_add_(1, table, count)
    return (torch.arange(bs)[None, None, :] < per_block[:, :, None]).reshape(B, used * bs)


def _used_blocks(*tables: torch.Tensor) -> int:
    return max(int(t.max()) for t in tables) + 1


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_table: torch.Tensor, seq_lens: torch.Tensor,
                    scale: Optional[float] = None, full: Optional[tuple] = None):
    """Decode attention of ``q [B, Hq, D]`` over the blocks listed in ``block_table [B, M]``
    (``seq_lens [B]`` tokens: every listed block full except the last one) -> ``[B, Hq, D]``.

    Computed as one masked softmax over the physical blocks the batch uses, so rows sharing
    context blocks read them once. With ``full = (dense_table, dense_lens)`` it also returns the
    exact attention mass (under dense attention) of the attended tokens, averaged over query
    heads: ``(out, mass [B])``."""
    B, Hq, D = q.shape
    _, bs, Hkv, _ = k_cache.shape
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    used = _used_blocks(block_table) if full is None else _used_blocks(block_table, full[0])
    keys = k_cache[:used].reshape(used * bs, Hkv, D)
    vals = v_cache[:used].reshape(used * bs, Hkv, D)
    qg = q.reshape(B, Hkv, Hq // Hkv, D).to(torch.float32)
    scores = torch.einsum("bkgd,nkd->bkgn", qg, keys) * scale
    if block_table.dim() == 3:   # one table per KV head ([B, Hkv, M], lengths [B, Hkv])
        mask = _token_mask(block_table.reshape(B * Hkv, -1), seq_lens.reshape(-1), used,
                           bs).reshape(B, Hkv, 1, used * bs)
    else:
        mask = _token_mask(block_table, seq_lens, used, bs)[:, None, None, :]
    out = torch.einsum("bkgn,nkd->bkgd", torch.softmax(scores.masked_fill(~mask, float("-inf")), -1),
                       vals).reshape(B, Hq, D).to(q.dtype)
    if full is None:
        return out
    dense_mask = _token_mask(full[0], full[1], used, bs)[:, None, None, :]
    dense = torch.softmax(scores.masked_fill(~dense_mask, float("-inf")), -1)
    return out, (dense * mask).sum(-1).mean(dim=(1, 2))


class Llama:
    """A Llama-architecture model in float32, weights as plain tensors."""

    def __init__(self, config: dict, weights: dict[str, torch.Tensor]):
        self.config = config
        self.num_layers = config["num_hidden_layers"]
        self.num_q_heads = config["num_attention_heads"]
        self.num_kv_heads = config["num_key_value_heads"]
        self.hidden = config["hidden_size"]
        self.head_dim = config.get("head_dim") or self.hidden // self.num_q_heads
        self.vocab_size = config["vocab_size"]
        self.eps = config["rms_norm_eps"]
        theta = config.get("rope_theta") or config["rope_parameters"]["rope_theta"]
        self.inv_freq = 1.0 / theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64)
                                         / self.head_dim)
        self.embed = weights["model.embed_tokens.weight"]
        self.lm_head = weights.get("lm_head.weight", self.embed)
        self.norm = weights["model.norm.weight"]
        self.layers = []
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            w = {n[len(p):]: t for n, t in weights.items() if n.startswith(p)}
            # one matmul for q, k and v; one for gate and up
            self.layers.append({
                "ln1": w["input_layernorm.weight"], "ln2": w["post_attention_layernorm.weight"],
                "qkv": torch.cat([w["self_attn.q_proj.weight"], w["self_attn.k_proj.weight"],
                                  w["self_attn.v_proj.weight"]]).t().contiguous(),
                "o": w["self_attn.o_proj.weight"].t().contiguous(),
                "gate_up": torch.cat([w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"]]).t().contiguous(),
                "down": w["mlp.down_proj.weight"].t().contiguous(),
            })

    @classmethod
    def load(cls, path: str) -> "Llama":
        """Load from a Hugging Face folder (``config.json`` + ``model.safetensors``)."""
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
        return cls(config, load_safetensors(os.path.join(path, "model.safetensors")))

    # pieces ---------------------------------------------------------------------------------
    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [N, H, D]`` at positions ``pos [N]``."""
        ang = pos.to(torch.float64)[:, None] * self.inv_freq[None, :]
        ang = torch.cat([ang, ang], dim=-1)
        cos, sin = ang.cos().to(x.dtype)[:, None, :], ang.sin().to(x.dtype)[:, None, :]
        return x * cos + _rotate_half(x) * sin

    def _qkv(self, layer: dict, h: torch.Tensor, pos: torch.Tensor):
        x = _rms_norm(h, layer["ln1"], self.eps)
        qkv = x @ layer["qkv"]
        Hq, Hkv, D = self.num_q_heads, self.num_kv_heads, self.head_dim
        q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
        q = self._rope(q.reshape(-1, Hq, D), pos)
        k = self._rope(k.reshape(-1, Hkv, D), pos)
        return q, k, v.reshape(-1, Hkv, D)

    def _finish_layer(self, layer: dict, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        h = h + attn.reshape(h.shape[0], -1) @ layer["o"]
        gate, up = (_rms_norm(h, layer["ln2"], self.eps) @ layer["gate_up"]).chunk(2, dim=-1)
        return h + (F.silu(gate) * up) @ layer["down"]

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return _rms_norm(h, self.norm, self.eps) @ self.lm_head.t()

    def _causal(self, q, k, v) -> torch.Tensor:
        """Causal GQA attention of N tokens: q [N, Hq, D], k/v [N, Hkv, D] -> [N, Hq, D]."""
        rep = self.num_q_heads // self.num_kv_heads
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.repeat_interleave(rep, 1).transpose(0, 1)[None],
            v.repeat_interleave(rep, 1).transpose(0, 1)[None], is_causal=True)
        return out[0].transpose(0, 1)

    # public ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, ids: Sequence[int], logits_from: int = 0) -> torch.Tensor:
        """Plain causal forward over ``ids`` (no cache) -> logits ``[N - logits_from, vocab]``
        of positions ``logits_from..N-1``."""
        return self.prefill(ids, None, None, logits_from=logits_from)

    def to(self, device) -> "Llama":
        """Move the weights to ``device`` (in place; returns self). Prefill runs there."""
        move = lambda t: t.to(device)  # noqa: E731
        self.embed, self.lm_head, self.norm = move(self.embed), move(self.lm_head), move(self.norm)
        self.inv_freq = move(self.inv_freq)
        self.layers = [{k: move(t) for k, t in layer.items()} for layer in self.layers]
        return self

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def new_cache(self, num_blocks: int, block_size: int = 16) -> PagedKVCache:
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        dev = self.device
        return PagedKVCache([torch.zeros(shape, device=dev) for _ in range(self.num_layers)],
                            [torch.zeros(shape, device=dev) for _ in range(self.num_layers)])

    @torch.inference_mode()
    def prefill(self, ids: Sequence[int], cache: Optional[PagedKVCache],
                block_ids: Optional[Sequence[int]], logits_from: int = 0,
                observe: Optional[Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]]
                = None) -> torch.Tensor:
        """Dense causal forward of ``ids`` at positions ``0..N-1``; with a cache, the K/V of
        token ``i`` go to block ``block_ids[i // block_size]``, slot ``i % block_size``. Returns
        the logits of positions ``logits_from..N-1`` (the LM head is skipped for the others).
        ``observe(layer, q, k, v)``: called per layer with its queries ``[N, Hq, D]`` and keys
        ``[N, Hkv, D]`` after the rotary embedding and values ``[N, Hkv, D]`` (calibration:
        :mod:`ucm.calibrate`)."""
        dev = self.device
        ids = torch.as_tensor(ids, dtype=torch.long, device=dev)
        n = ids.shape[0]
        pos = torch.arange(n, device=dev)
        if cache is not None:
            bs = cache.block_size
            if block_ids is None or len(block_ids) * bs < n:
                raise ValueError(f"block_ids: need at least {math.ceil(n / bs)} blocks for {n} tokens")
            phys = torch.as_tensor(list(block_ids), dtype=torch.long, device=dev)[pos // bs]
        h = self.embed[ids]
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, h, pos)
            if observe is not None:
                observe(li, q, k, v)
            if cache is not None:
                cache.k[li][phys, pos % bs] = k
                cache.v[li][phys, pos % bs] = v
            h = self._finish_layer(layer, h, self._causal(q, k, v))
        return self._logits(h[logits_from:])

    @torch.inference_mode()
    def decode(self, ids: Sequence[int], cache: PagedKVCache, block_table: torch.Tensor,
               seq_lens: torch.Tensor, attend: Optional[Attend] = None, mass: bool = False):
        """One decode step for a batch: row ``b`` feeds token ``ids[b]`` at position
        ``seq_lens[b] - 1``; its K/V are written into the cache, then each layer calls
        ``attend(layer, q, k_cache, v_cache, block_table, seq_lens)`` (None or a sparse
        ``(table, lens)``) and attends to the chosen blocks. Returns logits ``[B, vocab]``, and
        with ``mass=True`` also the exact attention mass of the attended tokens per layer and
        row ``[num_layers, B]`` (1.0 for dense)."""
        ids = torch.as_tensor(ids, dtype=torch.long)
        bs = cache.block_size
        pos = seq_lens.to(torch.long) - 1
        phys = block_table.to(torch.long).gather(1, (pos // bs)[:, None])[:, 0]
        kept = torch.ones(self.num_layers, len(ids))
        h = self.embed[ids]
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, h, pos)
            cache.k[li][phys, pos % bs] = k
            cache.v[li][phys, pos % bs] = v
            sel = attend(li, q, cache.k[li], cache.v[li], block_table, seq_lens) if attend else None
            if sel is None:
                attn = paged_attention(q, cache.k[li], cache.v[li], block_table, seq_lens)
            elif mass:
                attn, kept[li] = paged_attention(q, cache.k[li], cache.v[li], sel[0], sel[1],
                                                 full=(block_table, seq_lens))
            else:
                attn = paged_attention(q, cache.k[li], cache.v[li], sel[0], sel[1])
            h = self._finish_layer(layer, h, attn)
        logits = self._logits(h)
        return (logits, kept) if mass else logits


# ---------------------------------------------------------------------------------------------
# teacher-forced continuation with sparse methods

@dataclass
class Continuation:
    """Result of :func:`run_continuation` (``R`` rows = methods, ``T`` continuation steps).

    ``logits [R, T, vocab]``: logits of step ``t``, i.e. the prediction of the token after
    ``continuation[t]``; ``dense_logits [T, vocab]``: the same positions from one dense prefill
    of context + continuation; ``mass [R, T]``: exact attention mass of the attended blocks,
    averaged over layers and query heads (1.0 for dense rows); ``blocks [R, T]``: attended
    blocks per layer, averaged over layers."""
    logits: torch.Tensor
    dense_logits: torch.Tensor
    mass: torch.Tensor
    blocks: torch.Tensor


@torch.inference_mode()
def run_continuation(model: Llama, context: Sequence[int], continuation: Sequence[int],
                     methods: Sequence, *, block_size: int = 16, measure_mass: bool = True,
                     decode_threads: Optional[int] = 1) -> Continuation:
    """Prefill ``context + continuation`` densely once (L + T tokens: the dense reference
    logits), then feed ``continuation[t]`` at position ``L + t`` for ``t = 0..T-1``, one batch
    row per entry of ``methods`` (``None`` = dense; otherwise a :class:`ucm.sparse.SparseMethod`;
    one instance may serve several rows, as one request each). Each step is a real decode step:
    the token's K/V are written to the row's own blocks, then the method chooses the blocks
    each layer attends to, its state (stride, recent queries) evolving step by step.

    Rows share the full context blocks; the partially filled last context block and the blocks
    of the continuation are private per row (copied / allocated), so rows never see each other's
    tokens. ``measure_mass`` records the exact attention mass of the attended blocks.

    The decode steps run with ``decode_threads`` torch threads (restored afterwards; None keeps
    the current setting): their operations are small, and on a shared 2-core machine two
    threads made them about 10x slower than one (OpenMP barriers)."""
    context, continuation = list(context), list(continuation)
    L, T, R, bs = len(context), len(continuation), len(methods), block_size
    if L < 1 or T < 1 or R < 1:
        raise ValueError("context, continuation and methods must not be empty")
    full_ctx = L // bs
    shared = math.ceil((L + T) / bs)                                   # blocks of the prefill
    tail = math.ceil((L + T) / bs) - full_ctx                          # private blocks per row
    cache = model.new_cache(shared + R * tail, bs)
    dense_logits = model.prefill(context + continuation, cache, list(range(shared)), logits_from=L)
    table = torch.zeros(R, full_ctx + tail, dtype=torch.int32)
    table[:, :full_ctx] = torch.arange(full_ctx, dtype=torch.int32)
    for r in range(R):
        own = shared + r * tail
        table[r, full_ctx:] = torch.arange(own, own + tail, dtype=torch.int32)
        if L % bs:  # the row's copy of the partial block (slots past L are rewritten before use)
            for li in range(model.num_layers):
                cache.k[li][own] = cache.k[li][full_ctx]
                cache.v[li][own] = cache.v[li][full_ctx]

    groups: dict[int, tuple] = {}                                      # id(method) -> (m, rows)
    for r, m in enumerate(methods):
        if m is not None:
            groups.setdefault(id(m), (m, []))[1].append(r)
    req = [f"row{r}" for r in range(R)]
    for m, rows in groups.values():
        for r in rows:
            m.request_begin(req[r], L)

    logits = torch.empty(R, T, model.vocab_size)
    mass = torch.ones(R, T)
    blocks = torch.zeros(R, T)
    step_blocks = torch.zeros(R)

    def attend(layer, q, k_cache, v_cache, bt, sl):
        out_table, out_lens = bt.clone(), sl.clone()
        changed = False
        for m, rows in groups.values():
            ri = torch.tensor(rows)
            ids = [req[r] for r in rows]
            sel = m.attention_begin(layer, ids, q[ri], k_cache, bt[ri], sl[ri])
            if sel is not None:
                t_sel, l_sel = sel
                if t_sel.dim() == 3 and out_table.dim() == 2:   # per-KV-head tables: all rows
                    H = t_sel.shape[1]
                    out_table = out_table[:, None].repeat(1, H, 1)
                    out_lens = out_lens[:, None].repeat(1, H)
                out_table[ri] = 0
                if t_sel.dim() == 2 and out_table.dim() == 3:
                    t_sel, l_sel = t_sel[:, None], l_sel[:, None]
                out_table[ri, ..., :t_sel.shape[-1]] = t_sel.to(torch.int32)
                out_lens[ri] = l_sel.to(torch.int32)
                changed = True
            m.attention_finished(layer, ids)
        kept = ((out_lens.to(torch.long) + bs - 1) // bs).float()
        step_blocks.add_(kept.mean(1) if kept.dim() == 2 else kept)
        return (out_table, out_lens) if changed else None

    def step(t: int) -> None:
        for m, _ in groups.values():
            m.step_begin()
        step_blocks.zero_()
        lens = torch.full((R,), L + t + 1, dtype=torch.int32)
        out = model.decode([continuation[t]] * R, cache, table, lens, attend, mass=measure_mass)
        for m, _ in groups.values():
            m.step_end()
        if measure_mass:
            logits[:, t], kept = out
            mass[:, t] = kept.mean(0)
        else:
            logits[:, t] = out
            mass[:, t] = float("nan")
        blocks[:, t] = step_blocks / model.num_layers

    threads = torch.get_num_threads()
    if decode_threads is not None:
        torch.set_num_threads(decode_threads)
    try:
        for t in range(T):
            step(t)
    finally:
        torch.set_num_threads(threads)
    for m, rows in groups.values():
        for r in rows:
            m.request_finished(req[r])
    return Continuation(logits, dense_logits, mass, blocks)

