"""OpenAI-style API errors: an exception carrying an HTTP status and the error body.

Every failure a client can see is `{"error": {"message", "type", "param", "code"}}` with a 4xx
or 5xx status, the shape the official `openai` client turns into its `APIStatusError`
subclasses (`BadRequestError`, `AuthenticationError`, `NotFoundError`, `RateLimitError`...).
"""

from __future__ import annotations

import re
from typing import Any

from tokenleap.errors import TokenleapError

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "request_cancelled",
    500: "internal_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class APIError(Exception):
    """An error response: status, message, and the OpenAI error fields."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None, type: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "internal_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


_PARAM = re.compile(r"^([a-z_]+) must\b")


def bad_request(exc: TokenleapError | str, param: str | None = None) -> APIError:
    """A 400 from a library validation error; the parameter is read from the message when it
    starts with one ("temperature must be >= 0, ...")."""
    message = str(exc)
    if param is None:
        m = _PARAM.match(message)
        param = m.group(1) if m else None
    return APIError(400, message, param=param)
