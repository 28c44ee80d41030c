"""Shared pieces of the one-run GPU diagnostics (``sparse_diag_attention.py``,
``sparse_attn_launch.py``, ``sparse_async_select.py``, ``sparse_select_costs.py``): the
Llama-3-8B decode shape and random paged case of :mod:`benchmarks.bench_sparse`, graph timing in
microseconds, a trivial kernel, the report's header and its JSON file."""
from __future__ import annotations

import json
import os
import sys
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from benchmarks.bench_sparse import BS, D, HKV, HQ, bench, make_case  # noqa: E402

__all__ = ["BS", "D", "HKV", "HQ", "make_case", "graph_us", "noop_kernel", "header", "write_json"]


def graph_us(fn) -> float:
    """Median microseconds of a CUDA graph replay of ``fn``."""
    return 1e3 * bench(fn, graph=True)


@triton.jit
def noop_kernel(x_ptr):
    """One store per program: what a launch costs with nothing to do."""
    pid = tl.program_id(0)
    tl.store(x_ptr + pid, pid)


def header(**extra) -> dict:
    """The start of a report: the GPU and the library versions, then ``extra``."""
    return {"gpu": torch.cuda.get_device_name(), "triton": triton.__version__,
            "torch": torch.__version__, **extra}


def write_json(path: Optional[str], report: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
