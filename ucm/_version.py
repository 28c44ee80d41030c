"""The version of ucm. It is written once, in ``ucm/VERSION`` (pyproject.toml reads that file
too, so the package metadata and ``ucm.__version__`` cannot disagree)."""
from pathlib import Path

__version__ = Path(__file__).with_name("VERSION").read_text(encoding="ascii").strip()
