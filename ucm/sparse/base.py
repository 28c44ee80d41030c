"""The sparse-attention method base class: request lifecycle, block representations, budgets.

A :class:`SparseMethod` is driven by an engine hook or a harness (contract in
``docs/sparse.md``)::

    m.request_begin(req_id, prompt_len)          # per request
    m.step_begin()                                # per decode step
    sel = m.attention_begin(layer, req_ids, q, k_cache, block_table, seq_lens)
    m.attention_finished(layer, req_ids)          # per layer
    m.step_end()
    m.request_finished(req_id)                    # frees the request's state

What the base class does, so that a method only has to say how it scores blocks:

* **Which rows are sparse.** A row of ``n = ceil(seq_len / block_size)`` blocks is sparse when
  ``n >= min_blocks`` and its budget ``max(init_window + local_window + 1,
  ceil(sparse_ratio * n))`` is below ``n`` (so ``sparse_ratio = 1.0`` keeps every block), and the
  layer is not one of the first ``sparse_dense_layers``. Other rows keep their own table and
  length; a call where no row is sparse returns ``None``.
* **Representations.** Per layer, tables indexed by physical block id (``mean``, ``kmin``,
  ``kmax``, ``codes``: whichever :attr:`SparseMethod.reprs` names), allocated on first use with
  the cache's number of blocks and device. A request remembers, per layer, how many of its
  leading blocks are done; each call computes the blocks that filled since (one
  :func:`ucm.sparse.ops.update_block_reprs` call for the whole batch). The partial last block is
  always attended, so its representation only matters to methods that set
  :attr:`SparseMethod.partial_reprs` (adaptive: its estimated mass); those recompute it every
  step.
* **Sub-block summaries** (``sparse_repr_group``, methods with :attr:`SparseMethod.sub_blocks`:
  ESA, KVStar, Quest). With a group of ``t`` tokens (a divisor of the block size) the ``mean`` /
  ``kmin`` / ``kmax`` tables hold ``G = block_size // t`` rows per block,
  ``[num_blocks, G, Hkv, D]``, written by one :func:`ucm.sparse.ops.update_block_reprs` call, and
  one :func:`ucm.sparse.ops.score_blocks` call scores a block per head as the maximum over its
  sub-blocks (inside the op): a tighter Quest bound and a sharper mean key. The default is 2;
  ``0`` (or a group >= the block size) keeps one summary per block (``G = 1``).
* **Table dtype.** bfloat16 when the cache is bfloat16 (scoring reads half the bytes; summaries
  are computed in float32 and stored rounded), else float32. ``sparse_repr_dtype`` = ``int8``
  keeps the ``mean`` table as int8 rows with one float32 scale per row (``mean_scale``, from
  :func:`ucm.sparse.ops.update_block_reprs`; half a bfloat16 table's bytes); its default
  ``auto`` does so for a bfloat16 cache on a GPU, where scoring is bound by reading the table.
* **Selection to table.** :meth:`SparseMethod.select` returns logical block indexes (as
  :func:`ucm.sparse.ops.select_blocks` does); :func:`ucm.sparse.ops.sparse_block_table` turns
  them into the table and lengths the attention kernel reads.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

import torch

from ucm.config import Config
from ucm.sparse import ops

REPR_KINDS = ("mean", "kmin", "kmax", "codes", "keys4")


@dataclass
class RequestState:
    """What a method keeps for one live request."""
    req_id: str
    prompt_len: int
    done: dict = field(default_factory=dict)       # layer -> leading blocks with representations
    calls: dict = field(default_factory=dict)      # layer -> sparse attention calls so far
    selection: dict = field(default_factory=dict)  # layer -> last selection (logical indexes)
    extra: dict = field(default_factory=dict)      # method-specific (e.g. recent queries)


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    return value


def _per_kv_head_methods() -> list:
    from ucm.sparse import METHODS  # (the registry imports this module)

    return [name for name, cls in METHODS.items() if cls.supports_per_kv_head]


def as_config(config: Union[Config, Mapping, None]) -> Config:
    """A validated :class:`ucm.Config` from a Config, a dict of options, or None (defaults)."""
    if isinstance(config, Config):
        return config
    if config is None or isinstance(config, Mapping):
        return Config(config)
    raise ValueError(f"config: expected a ucm.Config, a dict of options or None, got "
                     f"{type(config).__name__}")


class SparseMethod:
    """Base class of the sparse-attention methods (see the module docstring).

    Subclasses set :attr:`name` and :attr:`reprs` and implement :meth:`select`."""

    name = "base"
    reprs: tuple = ()  # representation tables the method scores with (subset of REPR_KINDS)
    partial_reprs = False  # also keep the partial last block's representations current
    sub_blocks = False     # honours sparse_repr_group (scores through score_per_head)
    supports_per_kv_head = False   # select() honours per_kv_head (sel [b, Hkv, K], count [b, Hkv])

    @classmethod
    def check_per_kv_head(cls, per_kv_head: bool, key: str = "per_kv_head") -> None:
        """``ValueError`` naming ``key`` when per-KV-head selection is asked of a method that
        selects one set of blocks per request."""
        if per_kv_head and not cls.supports_per_kv_head:
            raise ValueError(f"{key}: the {cls.name!r} method selects one set of blocks per "
                             f"request (supported: {', '.join(_per_kv_head_methods())})")

    def __init__(self, config: Union[Config, Mapping, None] = None, *, num_layers: int,
                 num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 device: Union[str, torch.device] = "cpu", per_kv_head: Optional[bool] = None):
        cfg = as_config(config)
        key = "per_kv_head"
        if per_kv_head is None:   # not given: the configuration's sparse_per_kv_head
            per_kv_head, key = bool(cfg["sparse_per_kv_head"]), "sparse_per_kv_head"
        if not isinstance(per_kv_head, bool):
            raise ValueError(f"per_kv_head: expected a bool, got {per_kv_head!r}")
        self.check_per_kv_head(per_kv_head, key)
        #: each KV head selects its own blocks: attention_begin returns ``[B, Hkv, K]`` tables
        #: and ``[B, Hkv]`` lengths (ucm.sparse.ops.paged_decode_attention takes them; the
        #: vLLM-CPU hook attends such rows with it instead of vLLM's kernel)
        self.per_kv_head = per_kv_head
        self.num_layers = _positive_int(num_layers, "num_layers")
        self.num_q_heads = _positive_int(num_q_heads, "num_q_heads")
        self.num_kv_heads = _positive_int(num_kv_heads, "num_kv_heads")
        self.head_dim = _positive_int(head_dim, "head_dim")
        self.block_size = _positive_int(block_size, "block_size")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_q_heads: {num_q_heads} is not a multiple of num_kv_heads="
                             f"{num_kv_heads} (grouped-query attention)")
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"device: expected a torch device such as 'cpu' or 'cuda:0', got "
                             f"{device!r} ({exc})") from None
        self.config = cfg
        self.sparse_ratio = float(cfg["sparse_ratio"])
        self.min_blocks = int(cfg["min_blocks"])
        self.init_window = int(cfg["init_window"])
        self.local_window = int(cfg["local_window"])
        self.dense_layers = int(cfg["sparse_dense_layers"])
        group = int(cfg["sparse_repr_group"])
        if 0 < group < self.block_size and self.block_size % group:
            raise ValueError(f"sparse_repr_group: {group} does not divide block_size="
                             f"{self.block_size} (expected a divisor of it, or 0 = whole block)")
        sub = 0 < group < self.block_size and self.sub_blocks
        self.repr_group = group if sub else self.block_size
        self.groups = self.block_size // self.repr_group   # summaries per block
        self.step = 0                                 # decode steps begun (step_begin calls)
        self._requests: dict[str, RequestState] = {}
        self._tables: list[Optional[dict]] = [None] * self.num_layers
        self._proj: Optional[torch.Tensor] = None
        if "codes" in self.reprs:
            bits = int(cfg["sparse_hash_bits"])
            gen = torch.Generator().manual_seed(0x5EED)
            self._proj = torch.randn(self.head_dim, bits, generator=gen).to(self.device)

    # lifecycle ------------------------------------------------------------------------------
    def request_begin(self, req_id: str, prompt_len: int) -> None:
        """Start tracking ``req_id`` (a request seen again starts over)."""
        if isinstance(prompt_len, bool) or not isinstance(prompt_len, int) or prompt_len < 0:
            raise ValueError(f"prompt_len: expected an int >= 0, got {prompt_len!r}")
        self._requests[req_id] = RequestState(req_id, prompt_len)

    def request_finished(self, req_id: str) -> None:
        """Forget everything about ``req_id`` (unknown ids are ignored)."""
        self._requests.pop(req_id, None)

    def step_begin(self) -> None:
        self.step += 1

    def step_end(self) -> None:
        """End of a decode step (nothing to do for the built-in methods)."""

    def attention_finished(self, layer: int, req_ids: Sequence[str]) -> None:
        """End of one layer's attention (nothing to do for the built-in methods)."""

    @property
    def live_requests(self) -> int:
        return len(self._requests)

    # budget ---------------------------------------------------------------------------------
    def budget(self, n: int) -> int:
        """Blocks kept for a request of ``n`` blocks (before the adaptive rule, if any)."""
        return max(self.init_window + self.local_window + 1, math.ceil(self.sparse_ratio * n - 1e-9))

    def is_sparse(self, n: int) -> bool:
        return n >= self.min_blocks and self.budget(n) < n

    # representations ------------------------------------------------------------------------
    def repr_dtype(self, cache_dtype: torch.dtype, device=None, kind: str = "kmin") -> torch.dtype:
        """dtype of the ``kind`` table (mean / kmin / kmax) for a cache of ``cache_dtype`` on
        ``device``: ``sparse_repr_dtype`` for ``mean`` (int8 under ``auto`` for a bfloat16 cache
        on a GPU), the cache's precision (bfloat16 or float32) otherwise."""
        floating = torch.bfloat16 if cache_dtype == torch.bfloat16 else torch.float32
        if kind != "mean":
            return floating
        want = self.config["sparse_repr_dtype"]
        if want == "auto":
            gpu = device is not None and torch.device(device).type == "cuda"
            return torch.int8 if gpu and floating == torch.bfloat16 else floating
        return {"int8": torch.int8, "bfloat16": torch.bfloat16, "float32": torch.float32}[want]

    def _layer_tables(self, layer: int, k_cache: torch.Tensor) -> dict:
        """The representation tables of ``layer``, (re)allocated for the cache's block count."""
        tables = self._tables[layer]
        nb, _, hkv, d = k_cache.shape
        dev = k_cache.device
        dtypes = {kind: self.repr_dtype(k_cache.dtype, dev, kind) for kind in self.reprs
                  if kind not in ("codes", "keys4")}
        if tables is None or tables["num_blocks"] != nb or tables["device"] != dev \
                or tables["dtypes"] != dtypes:
            tables = {"num_blocks": nb, "device": dev, "dtypes": dtypes}
            for kind in self.reprs:
                if kind == "codes":
                    tables[kind] = torch.zeros(nb, self.groups, hkv, self._proj.shape[1] // 32,
                                               dtype=torch.int32, device=dev)
                elif kind == "keys4":   # every token's key in int4, a float16 scale per channel
                    tables[kind] = torch.zeros(nb, hkv, self.block_size, d // 2,
                                               dtype=torch.uint8, device=dev)
                    tables["scale4"] = torch.zeros(nb, hkv, d, dtype=torch.float16, device=dev)
                else:
                    tables[kind] = torch.zeros(nb, self.groups, hkv, d, dtype=dtypes[kind],
                                               device=dev)
            if dtypes.get("mean") == torch.int8:   # one float32 scale per int8 row
                tables["mean_scale"] = torch.zeros(nb, self.groups, hkv, dtype=torch.float32,
                                                   device=dev)
            self._tables[layer] = tables
            for st in self._requests.values():   # a new cache: every block is new
                st.done.pop(layer, None)
        return tables

    def _update_reprs(self, layer: int, states: list, k_cache: torch.Tensor, table_rows: list,
                      lens: list) -> dict:
        """Compute the representations of newly filled blocks and of partial last blocks."""
        tables = self._layer_tables(layer, k_cache)
        if self._proj is not None and self._proj.device != k_cache.device:
            self._proj = self._proj.to(k_cache.device)
        bs = self.block_size
        todo: dict[int, int] = {}                     # physical id -> valid tokens
        for st, row, n_tok in zip(states, table_rows, lens):
            full = n_tok // bs
            start = st.done.get(layer, 0)
            for j in range(start, full):
                todo[row[j]] = bs
            st.done[layer] = max(start, full)
            if n_tok % bs and self.partial_reprs:
                todo[row[full]] = n_tok % bs
        if not todo:
            return tables
        dev = k_cache.device
        ids = torch.tensor(list(todo), dtype=torch.int64, device=dev)
        ntok = torch.tensor(list(todo.values()), dtype=torch.int64, device=dev)
        if "keys4" in tables:    # whole blocks only (partial_reprs is off for such methods)
            ops.quantize_token_keys(k_cache, ids, keys4=tables["keys4"],
                                    scale4=tables["scale4"])
        rows = {k: tables[k] for k in ("mean", "kmin", "kmax", "codes", "mean_scale")
                if k in tables}
        if rows:
            ops.update_block_reprs(k_cache, ids, ntok, **rows,
                                   proj=self._proj if "codes" in tables else None)
        return tables

    # the hook -------------------------------------------------------------------------------
    def attention_begin(self, layer: int, req_ids: Sequence[str], q: torch.Tensor,
                        k_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor):
        """Choose the blocks each row attends to in ``layer``: ``None`` (all rows dense) or
        ``(table int32 [B, K], lens int32 [B])`` (dense rows keep their table and length)."""
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer: expected an int in [0, {self.num_layers}), got {layer!r}")
        B = len(req_ids)
        for name, t in (("q", q), ("k_cache", k_cache), ("block_table", block_table),
                        ("seq_lens", seq_lens)):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if q.dim() != 3 or q.shape[0] != B or block_table.dim() != 2 or block_table.shape[0] != B \
                or seq_lens.dim() != 1 or seq_lens.shape[0] != B:
            raise ValueError(f"q, block_table, seq_lens: expected one row per request ({B} req_ids), "
                             f"got shapes {list(q.shape)}, {list(block_table.shape)}, "
                             f"{list(seq_lens.shape)}")
        if tuple(q.shape[1:]) != (self.num_q_heads, self.head_dim):
            raise ValueError(f"q: expected [batch, num_q_heads={self.num_q_heads}, head_dim="
                             f"{self.head_dim}] (the method's shape), got {list(q.shape)}")
        if k_cache.dim() != 4 or tuple(k_cache.shape[1:]) != (self.block_size, self.num_kv_heads,
                                                                self.head_dim):
            raise ValueError(f"k_cache: expected [num_blocks, block_size={self.block_size}, "
                             f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}] (the "
                             f"method's shape), got {list(k_cache.shape)}")
        for name, t in (("block_table", block_table), ("seq_lens", seq_lens)):
            if t.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"{name}: expected dtype torch.int32 or torch.int64, got {t.dtype}")
        if len(set(req_ids)) != B:
            raise ValueError(f"req_ids: each request at most once per call, got {list(req_ids)}")
        states = []
        for rid in req_ids:
            st = self._requests.get(rid)
            if st is None:
                raise ValueError(f"req_ids: request {rid!r} was not begun (call request_begin first)")
            states.append(st)
        bs = self.block_size
        lens = seq_lens.tolist()
        cap = block_table.shape[1] * bs
        for st, n in zip(states, lens):
            if not 1 <= n <= cap:
                raise ValueError(f"seq_lens: request {st.req_id!r} has {n} tokens, expected "
                                 f"[1, {cap}] (at least the token being decoded, at most the "
                                 f"block table's {block_table.shape[1]} blocks of {bs})")
            if n < st.prompt_len:
                raise ValueError(f"seq_lens: request {st.req_id!r} has {n} tokens, fewer than "
                                 f"its prompt ({st.prompt_len}, request_begin)")
        if layer < self.dense_layers:
            return None
        nblocks = [-(-n // bs) for n in lens]
        rows = [i for i, n in enumerate(nblocks) if self.is_sparse(n)]
        if not rows:
            return None
        dev = block_table.device
        ri = torch.tensor(rows, device=dev)
        sub_states = [states[i] for i in rows]
        sub_table = block_table[ri]
        sub_lens = seq_lens[ri]
        n_t = torch.tensor([nblocks[i] for i in rows], dtype=torch.int32, device=dev)
        ops._fail_if({f"block_table: an entry holding a request's tokens lies outside "
                      f"[0, num_blocks={k_cache.shape[0]}) (k_cache's blocks)":
                      ops._ids_used_out_of_range(sub_table, n_t, k_cache.shape[0])})
        tables = None
        if self.reprs:
            width = max(nblocks[i] for i in rows)
            rows_list = sub_table[:, :width].tolist()
            tables = self._update_reprs(layer, sub_states, k_cache, rows_list, [lens[i] for i in rows])
        budget = torch.tensor([self.budget(nblocks[i]) for i in rows], dtype=torch.int32, device=dev)
        picked = self.select(layer, sub_states, q[ri], k_cache, sub_table, sub_lens, n_t, budget,
                             tables)
        sel, count = picked[:2]
        for st in sub_states:
            st.calls[layer] = st.calls.get(layer, 0) + 1
        if len(picked) == 4:  # the selection op also wrote the attention's table
            t_sparse, l_sparse = picked[2:]
        elif sel.dim() == 3:   # per KV head: one table per (row, KV head)
            b_, H_, K_ = sel.shape
            t_sparse, l_sparse = ops.sparse_block_table(
                sub_table.repeat_interleave(H_, 0), sub_lens.repeat_interleave(H_),
                sel.reshape(b_ * H_, K_), count.reshape(-1), bs)
            t_sparse, l_sparse = t_sparse.reshape(b_, H_, K_), l_sparse.reshape(b_, H_)
        else:
            t_sparse, l_sparse = ops.sparse_block_table(sub_table, sub_lens, sel, count, bs)
        if len(rows) == B:
            return t_sparse, l_sparse
        dense_width = max(n for i, n in enumerate(nblocks) if i not in set(rows))
        width = max(t_sparse.shape[-1], dense_width)
        heads = () if sel.dim() == 2 else (sel.shape[1],)
        out_table = torch.zeros(B, *heads, width, dtype=torch.int32, device=dev)
        dense_part = block_table[:, :dense_width]
        out_table[..., :dense_width] = dense_part[:, None] if heads else dense_part
        out_table[ri] = 0
        out_table[ri, ..., :t_sparse.shape[-1]] = t_sparse
        out_lens = seq_lens[:, None].repeat(1, *heads) if heads else seq_lens.clone()
        out_lens[ri] = l_sparse
        return out_table, out_lens

    def select(self, layer: int, states: list, q: torch.Tensor, k_cache: torch.Tensor,
               block_table: torch.Tensor, seq_lens: torch.Tensor, num_blocks: torch.Tensor,
               budget: torch.Tensor, tables: Optional[dict]):
        """Logical blocks for the sparse rows: ``(sel int32 [b, K], count int32 [b])`` as
        :func:`ucm.sparse.ops.select_blocks` returns them (increasing, padded with -1, the
        windows and the last block included), optionally followed by the attention's ``(table,
        lens)`` for them when the selection op made it (:func:`ucm.sparse.ops.sparse_block_table`
        of the selection). ``tables`` holds this layer's representations."""
        raise NotImplementedError

    # helpers for subclasses -----------------------------------------------------------------
    def pick(self, scores: torch.Tensor, num_blocks: torch.Tensor, budget: torch.Tensor):
        """Top blocks by ``scores [b, M]`` with this method's windows."""
        return ops.select_blocks(scores.float().contiguous(), num_blocks, budget,
                                 init_window=self.init_window, local_window=self.local_window)

    def pick_by_mass(self, per_head: torch.Tensor, num_blocks: torch.Tensor, budget: torch.Tensor):
        """``pick(head_mass(per_head), ...)`` as one op (:func:`ucm.sparse.ops.select_head_mass`:
        on CUDA the head mass and the selection run fused, over the whole GPU for long rows)."""
        return ops.select_head_mass(per_head.float().contiguous(), num_blocks, budget,
                                    scale=1.0 / math.sqrt(self.head_dim),
                                    init_window=self.init_window, local_window=self.local_window)

    def score_pick_by_mass(self, q: torch.Tensor, block_table: torch.Tensor,
                           num_blocks: torch.Tensor, budget: torch.Tensor, kind: str,
                           tables: dict, channel_mask: Optional[torch.Tensor] = None,
                           seq_lens: Optional[torch.Tensor] = None):
        """``pick_by_mass(score_per_head(...), ...)`` as one op
        (:func:`ucm.sparse.ops.score_select_head_mass`); with ``seq_lens`` also the attention's
        table and lengths, ``(sel, count, table, lens)``."""
        fold = {} if seq_lens is None else dict(seq_lens=seq_lens, block_size=self.block_size)
        return ops.score_select_head_mass(q, block_table, num_blocks, budget, kind=kind,
                                          channel_mask=channel_mask,
                                          scale=1.0 / math.sqrt(self.head_dim),
                                          init_window=self.init_window,
                                          local_window=self.local_window,
                                          **self.score_tables(kind, tables), **fold)

    def score_per_head(self, q: torch.Tensor, block_table: torch.Tensor, num_blocks: torch.Tensor,
                       kind: str, tables: dict, channel_mask: Optional[torch.Tensor] = None):
        """Per-head block scores ``[b, Hq, M]`` (one :func:`ucm.sparse.ops.score_blocks` call,
        ``kind`` "mean" or "quest"): the maximum over the block's sub-block summaries."""
        return ops.score_blocks(q, block_table, num_blocks, kind=kind, channel_mask=channel_mask,
                                reduce="none", **self.score_tables(kind, tables))

    @staticmethod
    def score_tables(kind: str, tables: dict) -> dict:
        """The tables a ``kind`` ("mean" or "quest") scoring call takes, as keyword arguments
        (an int8 ``mean`` with its ``mean_scale``)."""
        if kind != "mean":
            return {"kmin": tables["kmin"], "kmax": tables["kmax"]}
        return {"mean": tables["mean"], "mean_scale": tables.get("mean_scale")}

    def pick_per_kv_head(self, scores: torch.Tensor, num_blocks: torch.Tensor,
                         budget: torch.Tensor):
        """Top blocks of each KV head by ``scores [b, Hkv, M]``: ``(sel [b, Hkv, K],
        count [b, Hkv])``, the windows and the budget per KV head."""
        b, H, M = scores.shape
        sel, count = self.pick(scores.reshape(b * H, M), num_blocks.repeat_interleave(H),
                               budget.repeat_interleave(H))
        return sel.reshape(b, H, -1), count.reshape(b, H)

    def kv_head_mass(self, per_head: torch.Tensor) -> torch.Tensor:
        """:meth:`head_mass` per KV head: ``[b, Hkv, M]``, the shares of attention averaged over
        each KV head's query heads."""
        b, Hq, M = per_head.shape
        shares = torch.softmax(per_head / math.sqrt(self.head_dim), dim=-1)
        return shares.reshape(b, self.num_kv_heads, Hq // self.num_kv_heads, M).mean(2)

    def head_mass(self, per_head: torch.Tensor) -> torch.Tensor:
        """Block scores from per-head logit estimates ``[b, Hq, M]`` (``-inf`` past a request's
        blocks): a softmax over the blocks per query head (scale ``head_dim ** -0.5``), averaged
        over heads, i.e. each block's estimated share of the attention. Unlike a plain sum over
        heads, a head with large query norms cannot drown the others, and every head's ranking
        counts in proportion to how concentrated its attention is."""
        return torch.softmax(per_head / math.sqrt(self.head_dim), dim=-1).mean(1)

    def forced(self, n: int) -> list:
        """Logical blocks every selection of a request of ``n`` blocks keeps."""
        keep = set(range(min(self.init_window, n)))
        keep.update(range(max(0, n - self.local_window), n))
        keep.add(n - 1)
        return sorted(keep)


def pack_selection(rows: Sequence[Sequence[int]], device) -> tuple:
    """``(sel int32 [b, K], count int32 [b])`` from increasing lists of logical indexes."""
    width = max(len(r) for r in rows)
    sel = torch.full((len(rows), width), -1, dtype=torch.int32)
    for i, r in enumerate(rows):
        sel[i, :len(r)] = torch.tensor(r, dtype=torch.int32)
    count = torch.tensor([len(r) for r in rows], dtype=torch.int32)
    return sel.to(device), count.to(device)
