"""argparse types the harnesses share: a bad count, ratio or list fails when the command line is
parsed, with the usage line and a message naming the option (``argument --docs: expected an
integer >= 1, got 0``), not as a traceback after the model has loaded."""
from __future__ import annotations

import argparse
import json
import os


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def count(minimum: int = 1):
    """An integer ``>= minimum``."""
    def parse(text: str) -> int:
        value = _int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value
    return parse


def number(minimum: float, maximum: float = float("inf"), *, exclusive_min: bool = False):
    """A finite number in ``[minimum, maximum]`` (``(minimum, maximum]`` with ``exclusive_min``)."""
    def parse(text: str) -> float:
        value = _float(text)
        if value < minimum or (exclusive_min and value == minimum) or value > maximum:
            low = "(" if exclusive_min else "["
            high = "]" if maximum != float("inf") else ")"
            raise argparse.ArgumentTypeError(f"expected a number in {low}{minimum:g}, "
                                             f"{maximum:g}{high}, got {value:g}")
        return value
    return parse


def ratio(zero: bool = False):
    """A ratio in ``(0, 1]`` (``[0, 1]`` with ``zero``)."""
    return number(0.0, 1.0, exclusive_min=not zero)


def listed(item):
    """A comma-separated, non-empty list of ``item`` values (``item``: one of the types above)."""
    def parse(text: str) -> list:
        parts = [p.strip() for p in text.split(",")]
        if not text.strip() or any(not p for p in parts):
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        out = []
        for p in parts:
            try:
                out.append(item(p))
            except argparse.ArgumentTypeError as exc:
                if len(parts) == 1:
                    raise
                raise argparse.ArgumentTypeError(f"{exc} (in {text!r})") from None
        return out
    return parse


def names(text: str) -> list:
    """A comma-separated, non-empty list of names."""
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p for p in parts):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of names, got {text!r}")
    return parts


def json_object(text: str) -> dict:
    """A JSON object (ucm options)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object of ucm options, got {text!r}")
    return value


def existing_file(text: str) -> str:
    """A path to a file that exists."""
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"no such file: {text!r}")
    return text


def write_json(path: str, obj, **kw) -> None:
    """``json.dump`` into ``path``, its folder created first."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, **kw)
