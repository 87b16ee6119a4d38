"""lowlevel's version (also ``lowlevel.__version__``; the same string as pyproject.toml's)."""

__version__ = "0.1.0"
