"""Numba decorator with the project's hygiene rules.

* ``cache=True`` only when ``NUMBA_CACHE_DIR`` is set (opt-in: caching fails in read-only
  installs and can miss edits in imported modules).
* ``nogil=True`` is passed per function; never ``parallel=True`` (engines call from threads).
"""
import os

import numba

_CACHE = bool(os.environ.get("NUMBA_CACHE_DIR"))


def njit(*args, **kwargs):
    kwargs.setdefault("cache", _CACHE)
    if args and callable(args[0]) and len(args) == 1:
        return numba.njit(**kwargs)(args[0])
    return numba.njit(*args, **kwargs)
