"""Launch constants of the sparse kernels and the helpers every family shares.

:class:`LaunchConfig` holds every tuned launch constant; :data:`LAUNCH` is the default that the
ops use. Functions take ``launch=`` to run with another configuration (tests reach small-shape
code paths with it, benchmarks time alternatives with it); nothing rewrites module state.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton

from ucm.fast.triton import interpreting

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class LaunchConfig:
    """Launch constants of the sparse kernels (defaults tuned on the H200 with
    ``benchmarks/bench_sparse.py``). Tile sizes are rounded to powers of two where used."""

    # -- decode attention (split-K) ------------------------------------------------------------
    #: Tokens per inner step of the split kernel.
    decode_block_n: int = 128
    decode_warps: int = 4
    decode_stages: int = 2
    #: Programs aimed at per multiprocessor when choosing the number of slices, rounded down:
    #: as many as fit in one wave (3 at 168 registers and 72 KB of shared memory per program).
    decode_programs_per_sm: int = 3
    #: The fewest tokens per slice.
    decode_min_split_tokens: int = 256
    #: Channels per program of the merge launch: more programs when the batch is small.
    merge_channels: int = 32

    # -- scoring (mean / Quest / Hamming) -------------------------------------------------------
    #: Sub-block rows one mean / Quest program holds per KV head (sets its block tile). 128:
    #: the per-head int8 mean scoring of 2-token sub-blocks took 41.7 / 22.7 us against 46.1 /
    #: 25.0 with 64 (8 x 32K / 1 x 128K, ``bench_sparse_pareto.py --sweep-scoring``), and
    #: 4-token sub-blocks 22.9 / 12.4 against 24.9 / 12.6.
    score_rows: int = 128
    #: The tile shrinks (to 16 rows at least) until the grid has this many programs per
    #: multiprocessor, so that a batch of one request still fills the GPU.
    score_programs_per_sm: int = 2
    score_warps: int = 4
    score_stages: int = 2
    #: Stages of the software-pipelined loop over KV heads (the next heads' summary rows load
    #: while this head's product runs).
    score_loop_stages: int = 3
    #: Code words one Hamming program holds (sets its block tile).
    hamming_tile_elems: int = 8192
    #: Token rows the ``mass`` scoring takes per step (whole blocks: at least one), the blocks
    #: one of its programs walks, its warps and pipeline stages. One warp without pipelining
    #: (``bench_sparse_pareto.py --sweep-mass-scoring`` on an H100): 133.9 / 69.2 us at
    #: 8 x 32K / 1 x 128K, where 4 warps and 2 stages took 170.2 / 90.7.
    score_mass_rows: int = 64
    score_mass_blocks_per_program: int = 64
    score_mass_warps: int = 1
    score_mass_stages: int = 1

    # -- selection ------------------------------------------------------------------------------
    #: Rows up to this many blocks are selected in kernels; longer rows by one ``torch.topk``
    #: (the single-program kernel holds the row in registers, its packed counts 21 bits).
    select_kernel_max_blocks: int = 16384
    #: Warps of the single-program selection, and of rows longer than ``select_long_blocks``.
    select_warps: int = 4
    select_warps_long: int = 8
    select_long_blocks: int = 2048
    #: The histogram selection (three chunk-local launches instead of one program per row) for
    #: batches of at most ``hist_max_rows`` rows of at least ``hist_min_blocks`` blocks: a single
    #: program's passes over one long row are latency-bound. Up to 8 rows (a request's KV heads,
    #: or 8 long requests; ``bench_sparse_pareto.py --sweep-select-rows``): 8 rows of 8,192
    #: blocks 17.3 us against 27.3 with one program per row; 64 rows 67.0 against 27.6.
    hist_min_blocks: int = 4096
    hist_max_rows: int = 8
    #: log2 of the histogram's bins. The bins split the row's [min, max], so only a row whose
    #: blocks crowd a sliver of a wide range overflows the list into the searches.
    hist_bits: int = 12
    #: Blocks per histogram program; per list / emit program.
    hist_tile: int = 64
    hist_span: int = 256
    #: List entries read per step of the searches (a list longer than ``hist_list``).
    hist_chunk: int = 1024
    #: The most candidates in the threshold's bin that are ranked pairwise.
    hist_list: int = 128
    hist_warps: int = 4
    #: The head mass computed by the histogram launch (fused head mass + selection) for batches
    #: of at most ``mass_hist_max_rows`` rows of at least ``mass_hist_min_blocks`` blocks; other
    #: shapes compute the head mass (two launches) then select it.
    mass_hist_min_blocks: int = 4096
    mass_hist_max_rows: int = 8

    # -- head mass and log-sum-exp --------------------------------------------------------------
    #: Entries per step and warps of the one-program-per-row log-sum-exp / bounds launch.
    lse_chunk: int = 4096
    lse_warps: int = 8
    #: In the fused head-mass selection each head's row is cut into parts of this many entries,
    #: one program each (warps ``lse_span_warps``), combined by the histogram launch; a row no
    #: longer than a span takes one program.
    lse_span: int = 1024
    lse_span_warps: int = 4
    #: Two-launch head mass: entries per step of the log-sum-exp program; blocks per program of
    #: the mass launch (halved, down to 16, until ``head_mass_programs_per_sm`` per SM).
    head_mass_chunk: int = 1024
    head_mass_tile: int = 256
    head_mass_programs_per_sm: int = 2
    #: Entries per program of the sparse-table gather.
    table_tile: int = 1024
    #: Pooled per-KV-head budgets: shares one histogram program loads per step (heads x
    #: blocks), the blocks it covers, its warps; bins one scan program takes per step (heads x
    #: bins) and its warps. A level's whole histogram in one scan step, 8 warps each
    #: (``bench_sparse_pareto.py --sweep-pool``: 43.8 us at 8 x 2,048 blocks of 8 heads, where
    #: 4,096 bins a step and 4 warps took 58.5).
    pool_tile_elems: int = 4096
    pool_span: int = 512
    pool_hist_warps: int = 8
    pool_scan_elems: int = 16384
    pool_scan_warps: int = 8

    def replace(self, **changes) -> "LaunchConfig":
        """A copy with ``changes`` (field names as above)."""
        return dataclasses.replace(self, **changes)


#: The configuration the ops run with.
LAUNCH = LaunchConfig()


def pow2(n: int, least: int = 1) -> int:
    """The power of two at or above ``n`` (at least ``least``)."""
    return max(least, triton.next_power_of_2(int(n)))


_jitted: dict = {}


def jit(fn):
    """``triton.jit(fn)``, made on first use so that ``TRITON_INTERPRET`` set before the first
    call is honoured (``triton.jit`` reads it when it decorates). Kernels call no jitted
    helpers, so one process can run them both natively and interpreted."""
    key = (fn.__module__, fn.__name__, interpreting())
    k = _jitted.get(key)
    if k is None:
        k = _jitted[key] = triton.jit(fn)
    return k


def jitted() -> dict:
    """The kernels jitted so far, ``{(module, name, interpreted): JITFunction}`` (benchmarks read
    their compiled resources)."""
    return dict(_jitted)


_sm_counts: dict = {}


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; a small number under the interpreter."""
    if device.type != "cuda":
        return 4
    n = _sm_counts.get(device.index)
    if n is None:
        props = torch.cuda.get_device_properties(device)
        n = _sm_counts[device.index] = props.multi_processor_count
    return n


_hopper: dict = {}


def pdl_launch(device: torch.device) -> dict:
    """Launch keywords for programmatic dependent launch on CUDA devices of compute capability
    9.0 and later (none elsewhere, nor under the interpreter): the kernel starts with
    ``gdc_wait`` (the previous grid has finished and its writes are visible, so stream order is
    kept) then ``gdc_launch_dependents``, and the next launch overlaps its run instead of
    following its end. Used by the decode launches, where it shortens every step."""
    if device.type != "cuda" or interpreting():
        return {}
    ok = _hopper.get(device.index)
    if ok is None:
        ok = _hopper[device.index] = torch.cuda.get_device_capability(device)[0] >= 9
    return {"PDL": True, "launch_pdl": True} if ok else {}

