"""tokenleap's version: the one place it is written (pyproject.toml reads it, as do `--version`,
the server's OpenAPI title and `tokenleap.__version__`)."""

__version__ = "0.1.0"
