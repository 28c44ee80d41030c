"""Triton kernels (GPU fast paths). Imported only when an op selects them; :func:`status` is the
registry's availability probe. Without a GPU the kernels still run on CPU tensors through the
Triton interpreter when ``TRITON_INTERPRET=1`` is set (tests, small shapes).
"""
from __future__ import annotations

import importlib.util
import os


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def prepare_interpreter() -> bool:
    """Import Triton so that its kernels can later run on CPU tensors (``TRITON_INTERPRET=1``,
    tests and CPU benchmarks): Triton builds its standard library when first imported, for the
    interpreter only if the variable is set at that moment. The variable is restored afterwards.
    Nothing happens when Triton is missing or already imported; True when it was imported here."""
    import sys

    if "triton" in sys.modules or importlib.util.find_spec("triton") is None:
        return False
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language  # noqa: F401
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved
    return True


def status() -> tuple[bool, str]:
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed"
    if importlib.util.find_spec("torch") is None:
        return False, "torch is not installed"
    import torch
    import triton

    if torch.cuda.is_available():
        return True, f"triton {triton.__version__} on {torch.cuda.get_device_name()}"
    if interpreting():
        return True, f"triton {triton.__version__} interpreter (TRITON_INTERPRET=1, CPU tensors)"
    return False, "no CUDA device (TRITON_INTERPRET=1 runs the kernels on CPU tensors)"
