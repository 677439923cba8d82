"""Errors in the OpenAI API's shape: `{"error": {"message", "type", "param", "code"}}`, which the
official clients turn into their own exceptions (BadRequestError, RateLimitError, ...)."""
from __future__ import annotations

from typing import Dict, Optional

#: the error type of each status class, as OpenAI's API names them
_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
          413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
          501: "invalid_request_error", 503: "server_error"}


class APIError(Exception):
    """A request the server refuses or could not serve, with the field it concerns (`param`)."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[Dict[str, str]] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    @property
    def outcome(self) -> str:
        """How `specdec_requests_total` counts a request that ended with this error."""
        return {429: "rejected", 499: "cancelled"}.get(self.status, "failed" if self.status >= 500 else "invalid")

    @property
    def body(self) -> dict:
        kind = _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def invalid(message: str, param: Optional[str], code: str = "invalid_value") -> APIError:
    """A 400 about one field of the request."""
    return APIError(400, message, param, code)


def server_error(message: str) -> APIError:
    return APIError(500, message, None, "server_error")


__all__ = ["APIError", "invalid", "server_error"]
