"""fxopt's version, written once (pyproject.toml reads it; the CLI, the HTML page and saved results show it)."""
__version__ = "0.1.0"
