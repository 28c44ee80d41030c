"""What ucm's SGLang backend needs to know of SGLang, without importing it: the host pool's
pages as :class:`ucm.KVLayout` views, SGLang's page keys as ucm block ids, and the namespace.

**Pages.** SGLang's HiCache host pool keeps KV in one ``kv_buffer`` in one of four layouts
(``MHATokenToKVPoolHost``; MLA pools have no leading K/V dimension)::

    layer_first        [2, layers, tokens, heads, dim]      MLA: [layers, tokens, 1, dim]
    page_first         [2, tokens, layers, heads, dim]      MLA: [tokens, layers, 1, dim]
    page_first_direct  [2, pages, layers, page, heads, dim] MLA: [pages, layers, page, 1, dim]
    page_head          [2, pages, heads, page, layers, dim]

:func:`page_views` cuts it into views with the page dimension first, in the order of SGLang's
own flat page (``get_data_page(i, flat=True)``): a staged ucm block is byte for byte that flat
page, so pages written through the generic ``set`` and the zero-copy ``batch_set_v1`` are one
format, and either path reads what the other wrote.

**Keys.** SGLang names a page by the SHA-256 of its tokens chained over the pages before it (64
hex digits). Its ucm id is the first 16 bytes of that hash XOR the namespace digest: a hash
that is already cryptographic needs no second one, and two namespaces map one key to different
ids. A key that is not 64 hex digits has no id (a miss, never another page).

**Namespace** (:func:`namespace`): the model, the KV dtype, the page size, the layout and the
shard this rank holds (TP rank and size; for MLA, whose ranks hold the same KV, none; pipeline
and context-parallel ranks when used). Deployments of another shape never share blocks.
"""
from __future__ import annotations

import re
from typing import Optional

import numpy as np

from ucm.ids import Namespace
from ucm.murmur import murmur3_x64_128

LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
_HEX64 = re.compile(r"[0-9a-fA-F]{64}\Z")


def is_mla(host) -> bool:
    """An MLA host pool (one latent buffer, no K/V pair)."""
    return not hasattr(host, "k_buffer") or getattr(host, "kv_lora_rank", None) is not None


def page_views(host) -> list:
    """The host pool's ``kv_buffer`` as views ``[pages, ...]`` in flat-page order (module doc).
    ValueError naming the layout when it is not one ucm knows, or when the buffer's shape does
    not match it."""
    layout = getattr(host, "layout", None)
    if layout not in LAYOUTS:
        raise ValueError(f"SGLang host pool layout {layout!r}: ucm supports {list(LAYOUTS)}")
    buf, ps = host.kv_buffer, int(host.page_size)
    mla = is_mla(host)
    pairs = [buf] if mla else list(buf.unbind(0))           # (K, V) or the latent buffer
    want = 4 if layout in ("layer_first", "page_first") else 5
    if any(p.dim() != want for p in pairs) or (not mla and buf.shape[0] != 2):
        raise ValueError(f"SGLang host pool: kv_buffer of shape {list(buf.shape)} is not the "
                         f"{'MLA' if mla else 'MHA'} {layout} layout")
    if mla and layout == "page_head":
        raise ValueError("SGLang host pool layout 'page_head' has no MLA form")
    views = []
    for p in pairs:
        if layout == "layer_first":                          # [layers, tokens, ...]
            if p.shape[1] % ps:
                raise ValueError(f"SGLang host pool: {p.shape[1]} tokens are not whole pages "
                                 f"of {ps}")
            views += [p[layer].unflatten(0, (p.shape[1] // ps, ps))
                      for layer in range(p.shape[0])]
        elif layout == "page_first":                         # [tokens, layers, ...]
            if p.shape[0] % ps:
                raise ValueError(f"SGLang host pool: {p.shape[0]} tokens are not whole pages "
                                 f"of {ps}")
            views.append(p.unflatten(0, (p.shape[0] // ps, ps)))
        else:                                                # [pages, ...]
            views.append(p)
    return views


def page_indices(host_indices, page_size: int, n_pages: int,
                 num_pages: Optional[int] = None) -> Optional[np.ndarray]:
    """Page numbers of ``n_pages`` pages given as SGLang's token indices (``page_size`` per
    page: a page boundary and the tokens after it, in order); None when they are not that, or
    name a page outside ``[0, num_pages)`` (when given). :func:`page_indices_why` says why."""
    return page_indices_why(host_indices, page_size, n_pages, num_pages)[0]


def page_indices_why(host_indices, page_size: int, n_pages: int,
                     num_pages: Optional[int] = None) -> tuple:
    """``(pages, "")`` as :func:`page_indices`, or ``(None, reason)``: what is wrong with
    ``host_indices``, for the error message."""
    try:
        idx = np.asarray(host_indices.cpu() if hasattr(host_indices, "cpu") else host_indices)
    except Exception as exc:        # e.g. a sequence of unequal rows
        return None, f"not an array of token indices ({exc})"
    if page_size < 1:
        return None, f"page size {page_size}"
    if idx.ndim != 1:
        shape = f" of shape {list(idx.shape)}" if idx.ndim else ""
        return None, (f"expected a 1-D tensor of token indices, got "
                      f"{type(host_indices).__name__}{shape}")
    if len(idx) != n_pages * page_size:
        return None, (f"{len(idx)} token indices for {n_pages} pages of {page_size} tokens")
    if idx.size and idx.dtype.kind not in "iu":
        return None, f"token indices of dtype {idx.dtype}, not integers"
    tokens = idx.astype(np.int64).reshape(n_pages, page_size)
    first = tokens[:, 0]
    if len(first) and ((first < 0).any() or (first % page_size).any()
                       or (tokens != first[:, None] + np.arange(page_size)).any()):
        return None, f"not whole pages of {page_size} tokens (a page boundary, then in order)"
    pages = first // page_size
    if num_pages is not None and len(pages) and pages.max() >= num_pages:
        return None, f"page {int(pages.max())} beyond the host pool's {num_pages} pages"
    return pages, ""


def key_ids(keys, ns: Namespace, generation: int = 0) -> tuple:
    """``(ids uint64 [n, 2], valid bool [n])``: the ucm id of each SGLang page key (module
    doc) in the namespace's ``generation`` (raising it makes every earlier page a miss); rows
    of invalid keys are zero and must not be used."""
    n = len(keys)
    raw = np.zeros((n, 16), dtype=np.uint8)
    valid = np.zeros(n, dtype=bool)
    for i, k in enumerate(keys):
        if isinstance(k, str) and _HEX64.match(k):
            raw[i] = np.frombuffer(bytes.fromhex(k[:32]), dtype=np.uint8)
            valid[i] = True
    salt = ns.digest_words()
    if generation:
        salt = salt ^ np.frombuffer(murmur3_x64_128(b"ucm-generation\0" + str(int(generation))
                                                    .encode(), 0), dtype="<u8").astype(np.uint64)
    ids = raw.view("<u8").astype(np.uint64) ^ salt[None, :]
    ids[~valid] = 0
    return ids, valid


def namespace(config, host, model: Optional[str] = None, tenant_salt: str = "") -> Namespace:
    """The namespace of one rank's pages (module doc). ``config``: SGLang's
    ``HiCacheStorageConfig``; ``model``: overrides its ``model_name``."""
    model = model or getattr(config, "model_name", None)
    if not model:
        raise ValueError("SGLang storage config has no model_name and the backend config no "
                         "'model': the namespace needs one (pages of two models must not mix)")
    mla = bool(getattr(config, "is_mla_model", False))
    shape = [f"sglang-{host.layout}"]
    if is_mla(host):
        shape.append(f"mla{host.kv_buffer.shape[-1]}")      # latent + rope width
    else:
        shape.append(f"h{host.head_num}x{host.head_dim}")
    shape.append(f"l{host.layer_num}")
    for name in ("pp", "attn_cp", "dcp"):
        size = int(getattr(config, f"{name}_size", 1) or 1)
        if size > 1:
            shape.append(f"{name}{int(getattr(config, f'{name}_rank'))}of{size}")
    tp_rank, tp_size = (0, 1) if mla else (int(config.tp_rank), int(config.tp_size))
    return Namespace(model=str(model), dtype=str(host.dtype).replace("torch.", ""),
                     block_size=int(host.page_size), kv_layout="/".join(shape),
                     tp_rank=tp_rank, tp_size=tp_size, tenant_salt=tenant_salt)
