"""ucm — Unified Cache Management for LLM inference engines.

Persist KV blocks in storage tiers (pinned memory, local or shared filesystems) and reuse them,
attend sparsely during long decodes; integrate with vLLM through its KV-connector API. Every
compute op has a readable
reference and a fast implementation chosen by one dispatcher (``backend="fast"|"reference"``,
``ucm.set_backend``, ``UCM_BACKEND``); ``ucm.backend_info()`` says which runs and why.
"""
from __future__ import annotations

import logging
import os
import warnings

from ucm.config import OPTIONS, PRESETS, Config
from ucm.dispatch import (BackendUnavailableError, backend_info, detect_platform, get_backend,
                          set_backend)
from ucm.ids import Namespace, as_ids, id_bytes, id_hex
from ucm.ops import BlockIndex, alloc_aligned, copy_ranges, copy_segments, hash_blocks
from ucm.transfer import KVLayout, gather_blocks, scatter_blocks

from ucm._version import __version__

__all__ = [
    "BackendUnavailableError", "BlockIndex", "Config", "Namespace", "OPTIONS", "PRESETS",
    "alloc_aligned", "as_ids", "backend_info", "copy_ranges", "copy_segments", "detect_platform",
    "get_backend", "hash_blocks", "id_bytes", "id_hex", "set_backend",
]
__all__ += ["KVLayout", "gather_blocks", "scatter_blocks"]

logging.getLogger("ucm").addHandler(logging.NullHandler())
if os.environ.get("UCM_LOG_LEVEL"):  # also where no one configured logging (engine processes)
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s [pid %(process)d] %(message)s"))
    logging.getLogger("ucm").addHandler(_handler)
    logging.getLogger("ucm").setLevel(os.environ["UCM_LOG_LEVEL"].upper())


def _check_native() -> None:
    from ucm.fast import native

    ok, reason = native.status()
    if ok:
        return
    if os.environ.get("UCM_REQUIRE_NATIVE") == "1":
        raise ImportError(f"ucm: UCM_REQUIRE_NATIVE=1 but the native engine is unusable: {reason}")
    warnings.warn(f"ucm: native engine unavailable, byte movers use the Python reference "
                  f"({reason})", RuntimeWarning, stacklevel=3)


_check_native()
