"""Shared machinery of the equivalence tests (``tests/test_equiv_*.py``): every registered
implementation of an op must give what the reference gives.

* :func:`implementation_params` lists, from the dispatch registry, one pytest param per
  implementation and tensor device it takes; :func:`runnable` skips (with the probe's reason)
  one that cannot run on this machine, and fails instead in CI (``UCM_REQUIRE_NATIVE=1``), where
  every implementation must run.
* :data:`TOLERANCES` is the one table of ``(atol, rtol)`` per ``(op, dtype)``;
  :func:`assert_equivalent` compares outputs with it and says where they differ and by how much.
* :func:`poisoned` makes the buffers the ops allocate start as garbage (NaN floats, a byte
  pattern elsewhere), so that a read of an element no implementation wrote shows in the output.
  Equivalence tests run the reference and the implementation under different patterns
  (:func:`compare`): an uninitialised value reaching the output then differs between the two.
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
from typing import Any, Callable, Iterable, Optional

import numpy as np
import pytest

from ucm import dispatch

# ---------------------------------------------------------------------------------------------
# implementations

_INTERPRET = "TRITON_INTERPRET"


@contextlib.contextmanager
def _env(name: str, value: Optional[str]):
    saved = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def _takes(impl: dispatch.Impl, sample: Optional[Callable], device: str) -> Optional[str]:
    """How ``impl`` takes arguments on ``device`` (its per-call verifier asked with ``sample``'s):
    "natively", "interpreter" (only through the Triton interpreter: CPU tensors with
    TRITON_INTERPRET=1), or None (not at all)."""
    if impl.verifier is None:
        return "natively"
    args = sample(device) if sample else ()
    with _env(_INTERPRET, None):
        if impl.verifier(*args)[0]:
            return "natively"
    if device == "cpu":
        with _env(_INTERPRET, "1"):
            if impl.verifier(*args)[0]:
                return "interpreter"
    return None


def devices() -> list[str]:
    """Tensor devices of this machine: ``cpu``, and ``cuda`` where torch sees a GPU."""
    out = ["cpu"]
    try:
        import torch

        if torch.cuda.is_available():
            out.append("cuda")
    except ImportError:
        pass
    return out


def implementation_params(op: str, sample: Optional[Callable[[str], tuple]] = None,
                          on: Iterable[str] = ("cpu",)) -> list:
    """pytest params ``(implementation name, device, interpreted)``, ids ``name-device``, for
    every registered implementation of ``op`` and every device in ``on`` whose arguments its
    per-call verifier accepts (``sample(device)`` builds arguments for the verifier). One that
    takes CPU tensors only through the Triton interpreter is ``interpreted`` and marked
    ``triton_interpreter`` (see conftest). Pass the param to :func:`runnable`."""
    params = []
    for impl in dispatch.implementations(op):
        for device in on:
            how = _takes(impl, sample, device)
            if how is None:
                continue
            marks = [pytest.mark.triton_interpreter] if how == "interpreter" else []
            params.append(pytest.param((impl.name, device, how == "interpreter"),
                                       id=f"{impl.name}-{device}", marks=marks))
    return params


def tensor_impls(op: str):
    """``@tensor_impls("op")``: parametrize ``impl`` over the op's implementations on every device
    here, each probed with a torch tensor of that device."""
    import torch

    return pytest.mark.parametrize("impl", implementation_params(
        op, lambda device: (torch.empty(0, device=device),), devices()))


def required_here() -> bool:
    """CI (``UCM_REQUIRE_NATIVE=1``) installs every implementation's dependencies: there an
    implementation that cannot run is a failure, elsewhere a skip."""
    return os.environ.get("UCM_REQUIRE_NATIVE") == "1"


def runnable(op: str, param, monkeypatch) -> tuple[str, str]:
    """``(backend name, device)`` of an :func:`implementation_params` param, ready to call:
    TRITON_INTERPRET set for an interpreted one; skipped (or failed in CI) with its probe's
    reason when it cannot run here."""
    name, device, interpreted = param
    if interpreted:
        monkeypatch.setenv(_INTERPRET, "1")
        dispatch._reset_for_tests()          # probes read TRITON_INTERPRET once, then cache
    [impl] = [i for i in dispatch.implementations(op) if i.name == name]
    ok, why = impl.available(dispatch.detect_platform())
    if not ok:
        message = f"{op}: implementation {name!r} cannot run here: {why}"
        if required_here():
            pytest.fail(message + " (UCM_REQUIRE_NATIVE=1: every implementation must run)",
                        pytrace=False)
        pytest.skip(message)
    return name, device


# ---------------------------------------------------------------------------------------------
# tolerances

EXACT = (0.0, 0.0)
BF16_STEP = 2.0 ** -7     # one bfloat16 rounding step, relative

#: (op, dtype) -> (atol, rtol): got may differ from want by ``atol + rtol * |want|``. ``dtype`` is
#: the dtype of the compared output (a name: "float32", "uint64", ...). Ops that move or hash
#: bytes, index or select are exact; float kernels that sum in another order are not.
TOLERANCES = {
    ("hash_blocks", "uint64"): EXACT,
    ("block_index", "int64"): EXACT, ("block_index", "uint64"): EXACT,
    ("block_index", "uint8"): EXACT,
    ("copy_segments", "uint8"): EXACT,
    ("alloc_aligned", "uint8"): EXACT,
    ("checksum", "uint64"): EXACT,
    ("checksum_units", "uint64"): EXACT,
    ("copy_checksum_units", "uint64"): EXACT,
    ("io_batch", "int64"): EXACT, ("io_batch", "uint64"): EXACT, ("io_batch", "uint8"): EXACT,
    ("open_beneath", "int64"): EXACT,
    ("gather_blocks", "uint8"): EXACT,
    ("scatter_blocks", "uint8"): EXACT,
    ("hash_codes", "int32"): EXACT,
    # mean: float32 sums in another order; kmin/kmax exact; bfloat16 tables: one rounding step
    # of a float32 mean that may differ in its last bit; int8 means: one quantization step
    ("update_block_reprs", "float32"): (1e-6, 1e-6),
    ("update_block_reprs", "bfloat16"): (0.0, BF16_STEP),
    ("update_block_reprs", "int8"): (1.0, 0.0),
    ("update_block_reprs", "int32"): EXACT,
    ("score_blocks", "float32"): (1e-4, 1e-5),
    # int4 token keys: codes and float16 scales bit for bit; their mass logits in float32
    # (bfloat16 products on a GPU for 16-bit queries: tests/test_equiv_sparse.py widens there)
    ("quantize_token_keys", "uint8"): EXACT, ("quantize_token_keys", "float16"): EXACT,
    ("score_token_mass", "float32"): (1e-4, 1e-5),
    ("select_blocks", "int32"): EXACT,
    ("select_head_mass", "int32"): EXACT,
    ("score_select_head_mass", "int32"): EXACT,
    ("pool_head_budgets", "int32"): EXACT,
    ("sparse_block_table", "int32"): EXACT,
    # float32 accumulation either way; the output rounded to the query's dtype
    ("paged_decode_attention", "float32"): (2e-5, 2e-5),
    ("paged_decode_attention", "float16"): (2e-3, 2e-3),
    ("paged_decode_attention", "bfloat16"): (1.6e-2, 1.6e-2),
    # KV codecs: the integer formats byte for byte (payloads, scales, padding, decoded
    # elements) and the ok flags; the learned codec's coefficients (bfloat16 of float32 dot
    # products over head_dim summed in another order) and decoded values (float32 sums over the
    # rank, rounded to the cache's type): one rounding step of the output's type, plus the
    # float32 error of the sums near zero (inputs of magnitude ~1 to 10)
    ("encode", "uint8"): EXACT, ("encode", "bool"): EXACT, ("decode", "uint8"): EXACT,
    ("encode", "bfloat16"): (1e-4, BF16_STEP),
    ("decode", "float32"): (2e-5, 1e-5),
    ("decode", "bfloat16"): (2e-5, BF16_STEP),
    ("decode", "float16"): (2e-5, 2.0 ** -10),
}


def dtype_name(dtype) -> str:
    if isinstance(dtype, str):
        return dtype
    name = str(dtype)
    return name[len("torch."):] if name.startswith("torch.") else np.dtype(dtype).name


def tolerance(op: str, dtype) -> tuple[float, float]:
    key = (op, dtype_name(dtype))
    try:
        return TOLERANCES[key]
    except KeyError:
        raise KeyError(f"no tolerance for {key}: add it to tests/equivalence.py TOLERANCES") from None


# ---------------------------------------------------------------------------------------------
# comparison

def _as_numpy(x) -> np.ndarray:
    if type(x).__module__.startswith("torch"):
        import torch

        t = x.detach().cpu()
        if t.dtype in (torch.bfloat16, torch.float16) or "float8" in str(t.dtype):
            return t.float().numpy()
        return t.numpy()
    return np.asarray(x)


def _where(shape, flat_index: int):
    return tuple(int(i) for i in np.unravel_index(flat_index, shape)) if shape else ()


def _compare_arrays(op: str, got, want, dtype, what: str) -> None:
    label = f"{op}[{dtype_name(dtype)}]{what}"
    for attr in ("dtype", "shape"):
        g, w = getattr(got, attr, None), getattr(want, attr, None)
        if g is not None and w is not None and str(g) != str(w):
            raise AssertionError(f"{label}: {attr} {g} differs from the reference's {w}")
    atol, rtol = tolerance(op, dtype)
    g, w = _as_numpy(got), _as_numpy(want)
    if g.shape != w.shape:
        raise AssertionError(f"{label}: shape {g.shape} differs from the reference's {w.shape}")
    if g.size == 0:
        return
    if g.dtype.names:                       # structured (io_batch ops): field by field, exact
        for f in g.dtype.names:
            _compare_arrays(op, g[f], w[f], dtype, f"{what}[{f!r}]")
        return
    if g.dtype.kind not in "fc" and not (atol or rtol):
        bad = g != w
        if bad.any():
            first = int(np.flatnonzero(bad)[0])
            raise AssertionError(f"{label}: {int(bad.sum())} of {g.size} elements differ (exact); "
                                 f"first at {_where(g.shape, first)}: got {g.flat[first]!r}, "
                                 f"want {w.flat[first]!r}")
        return
    g64, w64 = g.astype(np.float64), w.astype(np.float64)
    # non-finite values: never NaN (a poisoned or uninitialised value: no op here makes NaN from
    # finite input) and infinities exactly where the reference has them
    nan = np.isnan(g64) | np.isnan(w64)
    inf_mismatch = (np.isinf(g64) | np.isinf(w64)) & ~(g64 == w64)
    finite = np.isfinite(g64) & np.isfinite(w64)
    with np.errstate(invalid="ignore"):                       # inf - inf where not finite
        diff = np.where(finite, np.abs(g64 - w64), 0.0)
    limit = atol + rtol * np.abs(np.where(finite, w64, 0.0))
    over = finite & (diff > limit)
    bad = nan | inf_mismatch | over
    if not bad.any():
        return
    lines = [f"{label}: {int(bad.sum())} of {g.size} elements outside atol={atol:g}, rtol={rtol:g}"]
    if nan.any():
        i = int(np.flatnonzero(nan)[0])
        lines.append(f"NaN at {_where(g.shape, i)} (got {g64.flat[i]}, want {w64.flat[i]}); "
                     f"{int(nan.sum())} NaN positions (an uninitialised read?)")
    if inf_mismatch.any():
        i = int(np.flatnonzero(inf_mismatch)[0])
        lines.append(f"non-finite mismatch at {_where(g.shape, i)}: got {g64.flat[i]}, "
                     f"want {w64.flat[i]}")
    if over.any():
        i = int(np.argmax(np.where(over, diff, -1.0)))
        rel = diff / np.maximum(np.abs(w64), np.finfo(np.float64).tiny)
        j = int(np.argmax(np.where(over, rel, -1.0)))
        lines.append(f"max abs error {diff.flat[i]:.3g} at {_where(g.shape, i)} (got "
                     f"{g64.flat[i]!r}, want {w64.flat[i]!r}); max rel error {rel.flat[j]:.3g} at "
                     f"{_where(g.shape, j)} (got {g64.flat[j]!r}, want {w64.flat[j]!r})")
    raise AssertionError("\n  ".join(lines))


def assert_equivalent(op: str, got, want, dtype, what: str = "") -> None:
    """Assert ``got`` (an implementation's output) equals ``want`` (the reference's) within
    :data:`TOLERANCES` ``[(op, dtype)]``: tensors, arrays, scalars, and tuples / lists / dicts
    of them (compared element by element, the position named in the message)."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), \
            f"{op}{what}: keys {sorted(got)} differ from the reference's {sorted(want)}"
        for k in want:
            assert_equivalent(op, got[k], want[k], dtype, f"{what}[{k!r}]")
        return
    if isinstance(want, (tuple, list)):
        assert isinstance(got, (tuple, list)) and len(got) == len(want), \
            f"{op}{what}: {len(got) if isinstance(got, (tuple, list)) else type(got).__name__} " \
            f"outputs, the reference gives {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_equivalent(op, g, w, dtype, f"{what}[{i}]")
        return
    if want is None or isinstance(want, (bool, int, float, str)):
        if isinstance(want, float) and isinstance(got, float):
            atol, rtol = tolerance(op, dtype)
            assert math.isclose(got, want, rel_tol=rtol, abs_tol=atol), \
                f"{op}[{dtype_name(dtype)}]{what}: got {got!r}, want {want!r}"
            return
        assert got == want, f"{op}[{dtype_name(dtype)}]{what}: got {got!r}, want {want!r}"
        return
    _compare_arrays(op, got, want, dtype, what)


# ---------------------------------------------------------------------------------------------
# poisoning

_lock = threading.Lock()
_active: Optional["Poison"] = None


class Poison:
    """One garbage pattern: floats NaN, bool ``byte & 1``, everything else the byte ``byte``
    repeated (0xA5: int32 -1515870811, uint8 165, ...)."""

    def __init__(self, byte: int):
        self.byte = byte

    def fill(self, x):
        """Fill a fresh tensor / array with the pattern in place and return it."""
        if type(x).__module__.startswith("torch"):
            import torch

            if x.numel() == 0:
                return x
            if x.is_floating_point():
                x.fill_(float("nan"))
            elif x.dtype == torch.bool:
                x.fill_(bool(self.byte & 1))
            elif x.is_contiguous():
                x.view(-1).view(torch.uint8).fill_(self.byte)
            else:
                x.fill_(int.from_bytes(bytes([self.byte]) * x.element_size(), "little",
                                       signed=x.dtype.is_signed))
            return x
        if x.size == 0:
            return x
        if x.dtype.kind == "f":
            x.fill(np.nan)
        elif x.dtype.kind == "b":
            x.fill(bool(self.byte & 1))
        elif x.flags.c_contiguous:
            x.reshape(-1).view(np.uint8).fill(self.byte)
        else:
            x[...] = np.frombuffer(bytes([self.byte]) * x.dtype.itemsize, dtype=x.dtype)[0]
        return x


WANT, GOT = Poison(0xA5), Poison(0x5A)
_ORIG: dict[str, Callable] = {"np.empty": np.empty, "np.empty_like": np.empty_like}


def _from_ucm() -> bool:
    """Whether the allocator's caller (two frames up: past the wrapper) is ucm code."""
    name = sys._getframe(2).f_globals.get("__name__", "")
    return name == "ucm" or name.startswith("ucm.")


def _wrap(key: str):
    orig = _ORIG[key]

    def alloc(*args, **kwargs):
        out = orig(*args, **kwargs)
        poison = _active
        if poison is not None and kwargs.get("out") is None and _from_ucm():
            poison.fill(out)
        return out

    alloc.__wrapped__ = orig
    return alloc


@contextlib.contextmanager
def poisoned(poison: Poison = WANT):
    """While active, ``np.empty`` / ``np.empty_like`` / ``torch.empty`` / ``torch.empty_like``
    called from ucm code return buffers filled with ``poison``'s pattern (other callers: torch,
    Triton's interpreter, the tests, are untouched). Buffers allocated in C (the native engine)
    or inside Numba-compiled code are not seen (ucm's Numba kernels receive their outputs from
    Python wrappers; :func:`dirty_heap` covers the native allocator). Not reentrant."""
    global _active
    with _lock:
        if _active is not None:
            raise RuntimeError("poisoned() is not reentrant")
        _active = poison
        targets = [(np, "empty"), (np, "empty_like")]
        if "torch" in sys.modules:
            import torch

            _ORIG.setdefault("torch.empty", torch.empty)
            _ORIG.setdefault("torch.empty_like", torch.empty_like)
            targets += [(torch, "empty"), (torch, "empty_like")]
        saved = [(mod, attr, getattr(mod, attr)) for mod, attr in targets]
        for mod, attr in targets:
            setattr(mod, attr, _wrap(f"{mod.__name__.replace('numpy', 'np')}.{attr}"))
    try:
        yield poison
    finally:
        with _lock:
            for mod, attr, fn in saved:
                setattr(mod, attr, fn)
            _active = None


def dirty_heap(nbytes: int, byte: int = 0xA5, count: int = 4) -> None:
    """Allocate, fill with ``byte`` and free a few C-heap blocks of ``nbytes``: the allocator
    hands such freed blocks out again, so a native buffer that is not initialised starts with
    the pattern instead of zeros."""
    import ctypes

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(nbytes) for _ in range(count)]
    for p in blocks:
        if p:
            ctypes.memset(p, byte, nbytes)
    for p in blocks:
        if p:
            libc.free(p)


def compare(op: str, run: Callable[[str], Any], backend: str, dtype,
            check: Optional[Callable[[Any, Any], None]] = None) -> Any:
    """Run ``run(backend_name)`` for the reference under one poison pattern and for ``backend``
    under the other, and assert the results equivalent (``check(got, want)`` instead when
    given). Buffers ``run`` passes in are the test's: it fills them the same way both times
    (a sentinel where the op must leave them alone, NaN where it must write). Returns the
    reference's result."""
    with poisoned(WANT):
        want = run("reference")
    with poisoned(GOT):
        got = run(backend)
    if check is not None:
        check(got, want)
    else:
        assert_equivalent(op, got, want, dtype)
    return want
