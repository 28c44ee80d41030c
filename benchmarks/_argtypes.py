"""The argparse types of the benchmark scripts: those of ``evals/argtypes.py`` (one copy for
both), so a bad count fails when the command line is parsed, naming the option."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from evals.argtypes import count, listed, names, number, write_json  # noqa: E402


def counts(text: str) -> list:
    """Comma-separated integers >= 1."""
    return listed(count(1))(text)


__all__ = ["count", "counts", "names", "number", "write_json"]
