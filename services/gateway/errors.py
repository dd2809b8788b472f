"""The one error type of the gateway's API and its OpenAI body.

Every failure a client can see is an `ApiError`: an HTTP status plus the OpenAI error body
`{"error": {"message", "type", "param", "code"}}`. The NATS API sends the same body with
the status in the `Spillway-Error` header.
"""

from __future__ import annotations

from typing import Any

from spillway.shared.protocol import ErrorInfo

# OpenAI's error `type` for each status class it uses.
_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
    503: "service_unavailable",
    504: "timeout",
}
# 429 and 503 tell the client when to try again (RFC 9110 Retry-After, in seconds).
RETRY_AFTER_S = {429: 1, 503: 1}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        error_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or _TYPE_BY_STATUS.get(status, "server_error")

    @property
    def retry_after(self) -> str | None:
        seconds = RETRY_AFTER_S.get(self.status)
        return str(seconds) if seconds is not None else None

    def headers(self) -> dict[str, str]:
        """The response headers an error carries beside its body."""
        return {"Retry-After": self.retry_after} if self.retry_after else {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    @classmethod
    def from_info(cls, info: ErrorInfo) -> ApiError:
        """An error another service reported; its own `type` wins for 400s."""
        error_type = info.type if info.status == 400 and info.type != "server_error" else None
        return cls(info.status, info.message, info.param, info.code, error_type)


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)
