"""Triton sparse-attention ops: same names and signatures as :mod:`ucm.reference.sparse`; inputs
validated by :mod:`ucm.sparse.ops`, which dispatches to the eleven ops re-exported here. CUDA
tensors, or CPU tensors under ``TRITON_INTERPRET=1`` (set before triton is imported: its standard
library, ``tl.sum`` and friends, is jitted at import).

One module per family:

- :mod:`.attention`: :func:`paged_decode_attention` (split-K), and :func:`decode` /
  :func:`decode_selected` for callers holding validated inputs;
- :mod:`.reprs`: :func:`update_block_reprs` and :func:`hash_codes` (block summaries);
- :mod:`.scoring`: :func:`score_blocks` (mean, Quest, Hamming);
- :mod:`.selection`: :func:`select_blocks`, :func:`select_sparse_table`,
  :func:`sparse_block_table`; :mod:`.histogram`: the selection of one long row;
- :mod:`.tokens`: :func:`quantize_token_keys`, :func:`score_token_mass` (the ``mass``
  method's int4 keys and ranking);
- :mod:`.mass`: :func:`head_mass`, :func:`select_head_mass`,
  :func:`score_select_head_mass`, :func:`pool_head_budgets`;
- :mod:`.launch`: :class:`LaunchConfig` (every launch constant; :data:`LAUNCH` is the
  default) and the helpers the families share.

Every function takes ``launch=`` (a :class:`LaunchConfig`) to run with other launch constants.
"""
from ucm.fast.triton.sparse.attention import decode, decode_selected, paged_decode_attention, plan
from ucm.fast.triton.sparse.mass import head_mass, pool_head_budgets, score_select_head_mass, \
    select_head_mass
from ucm.fast.triton.sparse.launch import LAUNCH, LaunchConfig
from ucm.fast.triton.sparse.reprs import hash_codes, update_block_reprs
from ucm.fast.triton.sparse.scoring import score_blocks
from ucm.fast.triton.sparse.selection import select_blocks, select_sparse_table, \
    sparse_block_table
from ucm.fast.triton.sparse.tokens import quantize_token_keys, score_token_mass

__all__ = ["update_block_reprs", "hash_codes", "score_blocks", "select_blocks",
           "select_head_mass", "score_select_head_mass", "sparse_block_table",
           "paged_decode_attention", "decode", "decode_selected", "select_sparse_table",
           "head_mass", "plan", "LaunchConfig", "LAUNCH", "quantize_token_keys",
           "score_token_mass", "pool_head_budgets"]
