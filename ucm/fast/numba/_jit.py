"""Numba decorator with the project's hygiene rules.

* Compiled code is cached on disk, so a process that starts (each vLLM worker and engine core
  does) loads ucm's kernels instead of compiling them again (measured on the 2-core VM: the
  memory tier's warm-up took 4 s compiling, 0.5 s loading). The cache lives in one directory per
  digest of this package's sources (``$UCM_JIT_CACHE`` or ``$XDG_CACHE_HOME/ucm/jit`` /
  ``~/.cache/ucm/jit``, then ``<digest>/``): numba itself invalidates a cached function only when
  its own file changes, not when a jitted function it calls from another file does; with the
  digest any edit of any file here starts a fresh directory. ``UCM_JIT_CACHE=off``, or a
  directory that cannot be written, compiles in every process as numba does by default.
* Only ucm's functions use that directory (the locator declines every other file), and other
  numba users in the process keep numba's own rules.
* ``nogil=True`` is passed per function; never ``parallel=True`` (engines call from threads).
"""
from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from typing import Optional

import numba
from numba.core import caching

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _sources_digest() -> str:
    h = hashlib.blake2b(digest_size=10)
    h.update(f"numba {numba.__version__} python {sys.version_info[:3]}".encode())
    for name in sorted(os.listdir(_PACKAGE_DIR)):
        if name.endswith(".py"):
            with open(os.path.join(_PACKAGE_DIR, name), "rb") as f:
                h.update(name.encode() + b"\0" + f.read() + b"\0")
    return h.hexdigest()


def _cache_root() -> Optional[str]:
    """The directory of this package's compiled code, created and writable; None: no cache."""
    env = os.environ.get("UCM_JIT_CACHE", "").strip()
    if env.lower() in ("off", "0", "false", "no"):
        return None
    if env:
        base = env
    else:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = os.path.join(xdg, "ucm", "jit")
    path = os.path.join(os.path.abspath(base), _sources_digest())
    try:
        os.makedirs(path, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError:
        return None
    return path


# numba's list of cache locators (named CacheImpl from 0.61, _CacheImpl before): without it
# ucm's functions are not cached rather than cached by numba's own per-file rules
_IMPL = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl", None)
_LOCATOR_BASE = getattr(caching, "_CacheLocator", None)
_ROOT = _cache_root() if _IMPL is not None and _LOCATOR_BASE is not None else None


class _UcmLocator(_LOCATOR_BASE or object):
    """numba cache locator for the functions of this package only: one directory per sources
    digest (the stamp is the digest, so freshness does not depend on file times)."""

    def __init__(self, py_func, py_file):
        self._lineno = py_func.__code__.co_firstlineno
        self._path = _ROOT

    def get_cache_path(self):
        return self._path

    def get_source_stamp(self):
        return os.path.basename(self._path)

    def get_disambiguator(self):
        return str(self._lineno)

    @classmethod
    def from_function(cls, py_func, py_file):
        if _ROOT is None or os.path.dirname(os.path.abspath(py_file)) != _PACKAGE_DIR:
            return None
        return cls(py_func, py_file)


if _ROOT is not None and _UcmLocator not in _IMPL._locator_classes:
    _IMPL._locator_classes.insert(0, _UcmLocator)


def njit(*args, **kwargs):
    kwargs.setdefault("cache", _ROOT is not None)
    if args and callable(args[0]) and len(args) == 1:
        return numba.njit(**kwargs)(args[0])
    return numba.njit(*args, **kwargs)
