"""Value parsers of the option table (:mod:`ucm.config`): ``(raw value, from_text) -> value``,
raising :class:`BadValue` with a description of what is accepted. ``from_text``: the value comes
from text (an environment variable), where ``"true"`` is a boolean and ``"4096"`` an integer."""
from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Callable

_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2,
               "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
               "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


class BadValue(ValueError):
    """A value an option cannot take; its text describes what the option accepts."""


def _bool(v, text):
    if isinstance(v, bool):
        return v
    if text and isinstance(v, str):
        s = v.strip().lower()
        if s in ("1", "true", "yes", "on"):
            return True
        if s in ("0", "false", "no", "off"):
            return False
    raise BadValue("a boolean (true/false)")


def _int(v, text):
    if isinstance(v, bool):
        raise BadValue("an integer")
    if isinstance(v, int):
        return v
    if text and isinstance(v, str) and re.fullmatch(r"\s*[-+]?\d+\s*", v):
        return int(v)
    raise BadValue("an integer")


def _float(v, text):
    if isinstance(v, bool):
        raise BadValue("a number")
    try:
        if isinstance(v, (int, float)):
            f = float(v)
        elif text and isinstance(v, str):
            f = float(v)
        else:
            raise BadValue("a number")
    except OverflowError:  # an int beyond a float's range
        raise BadValue("a finite number") from None
    except ValueError:
        raise BadValue("a number") from None
    if not math.isfinite(f):
        raise BadValue("a finite number")
    return f


def _str(v, text):
    if isinstance(v, str):
        return v
    raise BadValue("a string")


_MAX_SIZE = 2**63 - 1  # the int64 the native engine and the on-disk counters hold


def _size(v, text):
    """Bytes: an int, or a string like ``"64GiB"``, ``"1.5GB"``, ``"4096"``."""
    n = _size_value(v)
    if n > _MAX_SIZE:
        raise BadValue(f"a size of at most {_MAX_SIZE} bytes (8 EiB)")
    return n


def _size_value(v):
    if isinstance(v, bool):
        raise BadValue("a size in bytes (int or '64GiB')")
    if isinstance(v, int):
        return v
    if isinstance(v, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", v, re.ASCII)
        if m and m.group(2).lower() in _SIZE_UNITS:
            unit = _SIZE_UNITS[m.group(2).lower()]
            exact = Fraction(m.group(1)) * unit  # exact: '2.01kB' is 2010 bytes, not 2009
            if unit == 1 and exact.denominator != 1:
                raise BadValue("a whole number of bytes (a fraction needs a unit: '1.5KiB')")
            return int(exact)
    raise BadValue("a size in bytes (int or a string such as '64GiB', '500MB')")


def _str_list(v, text):
    if isinstance(v, str):
        items = [s.strip() for s in v.split(",")] if text or "," in v else [v]
        return [s for s in items if s]
    if isinstance(v, (list, tuple)) and all(isinstance(s, str) for s in v):
        return list(v)
    raise BadValue("a list of strings (or a comma-separated string)")


def _int_list(v, text):
    if isinstance(v, str):
        try:
            v = [int(s) for s in v.replace(",", " ").split()]
        except ValueError:
            raise BadValue("a list of integers (or a comma-separated string of them)") from None
    if isinstance(v, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool)
                                            for x in v):
        return list(v)
    raise BadValue("a list of integers (or a comma-separated string of them)")


PARSERS: dict[str, Callable] = {"bool": _bool, "int": _int, "float": _float, "str": _str,
                                 "size": _size, "list[str]": _str_list, "list[int]": _int_list}
