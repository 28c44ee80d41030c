"""Fast implementations (``numba``, ``native``, ``triton``), imported only when an op selects
them. This module holds what the registry asks before importing one: whether it can run here
(the probes) and whether it takes a given call's tensors (the device checks)."""
from __future__ import annotations

import importlib.util
import os


def numba_status() -> tuple[bool, str]:
    if importlib.util.find_spec("numba") is None:
        return False, "numba is not installed"
    import numba

    jit = "JIT disabled by NUMBA_DISABLE_JIT" if os.environ.get("NUMBA_DISABLE_JIT") == "1" else "jit"
    return True, f"numba {numba.__version__} ({jit})"


def native_status() -> tuple[bool, str]:
    from ucm.fast import native

    return native.status()


def triton_status() -> tuple[bool, str]:
    from ucm.fast import triton

    return triton.status()


def device_of(args, kwargs):
    """The device of the first tensor among a call's arguments (None: no tensor): what the
    ops' verifiers hand to :func:`triton_takes` / :func:`cpu_takes`."""
    for value in list(args) + list(kwargs.values()):
        if hasattr(value, "device") and hasattr(value, "dtype"):
            return value.device
    return None


def triton_takes(device) -> tuple[bool, str]:
    """The Triton kernels take CUDA tensors (CPU tensors through the interpreter)."""
    kind = getattr(device, "type", None)
    if kind == "cuda":
        return True, "CUDA tensors"
    if kind == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return True, "CPU tensors through the Triton interpreter (TRITON_INTERPRET=1)"
    return False, f"tensors on {device} (the Triton kernels take CUDA tensors)"


def cpu_takes(device) -> tuple[bool, str]:
    """The native engine moves host memory only."""
    if getattr(device, "type", None) == "cpu":
        return True, "CPU tensors"
    return False, f"tensors on {device} (this implementation moves CPU tensors only)"
