"""Error types a user can cause.

Everything a user can get wrong (an unknown model name, a missing file, a bad sampling
parameter, a prompt longer than the context) raises `TokenleapError`, a `ValueError`
subclass with a message meant to be shown as is. The CLI prints it without a traceback and
exits non-zero; the server turns it into a 4xx.
"""

from __future__ import annotations


class TokenleapError(ValueError):
    """A user-caused error with a message fit to show to the user."""


class ModelNotFoundError(TokenleapError):
    """The model name, path or package could not be resolved to weights."""
