"""The package's version (one place: pyproject.toml's must match)."""

__version__ = "0.1.0"
