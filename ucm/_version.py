"""The version of ucm, written only here (pyproject.toml reads it)."""
__version__ = "0.1.0"
