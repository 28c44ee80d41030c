"""Progress bars for long work (store verify and clear, model conversion, evals, benchmarks):
tqdm on stderr, as vLLM shows its own, so stdout stays free for results and ``--json``.

``bar(total, what, unit)`` returns a tqdm bar (a context manager; ``update(n)``). It is silent
when ``quiet`` is true or when ``UCM_PROGRESS=0`` is set (logs of unattended runs)."""
from __future__ import annotations

import os
import sys
from typing import Iterable, Optional


def enabled(quiet: bool = False) -> bool:
    return not quiet and os.environ.get("UCM_PROGRESS", "1") != "0"


def bar(total: Optional[int], what: str, unit: str = "it", quiet: bool = False):
    from tqdm import tqdm

    return tqdm(total=total, desc=what, unit=unit, disable=not enabled(quiet), file=sys.stderr,
                dynamic_ncols=True)


def track(items: Iterable, what: str, unit: str = "it", total: Optional[int] = None,
          quiet: bool = False):
    """Iterate ``items`` with a bar (``total`` defaults to ``len(items)`` when it has one)."""
    from tqdm import tqdm

    if total is None and hasattr(items, "__len__"):
        total = len(items)
    return tqdm(items, total=total, desc=what, unit=unit, disable=not enabled(quiet),
                file=sys.stderr, dynamic_ncols=True)
