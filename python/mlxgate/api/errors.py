"""API errors and their two envelopes: Anthropic's and OpenAI's, with the status codes each uses."""

from __future__ import annotations

from typing import Any, Literal

import orjson

from mlxgate.engine import AdmissionError, PromptTooLong, QueueFull

Dialect = Literal["anthropic", "openai"]

ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class ApiError(Exception):
    """An error answer: `status` and `message`, plus the headers clients act on."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        retry_after_s: int | None = None,
        should_retry: bool | None = None,
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s
        self.should_retry = should_retry
        self.code = code
        self.param = param

    @classmethod
    def from_admission(cls, exc: AdmissionError, dialect: Dialect) -> ApiError:
        if isinstance(exc, QueueFull):
            # Anthropic clients retry 529 overloaded; OpenAI clients know 503.
            status = 529 if dialect == "anthropic" else 503
            return cls(status, str(exc), retry_after_s=exc.retry_after_s)
        if isinstance(exc, PromptTooLong):
            return cls(
                400, str(exc), should_retry=False, code="context_length_exceeded", param="messages"
            )
        return cls(exc.status, str(exc))

    def headers(self) -> list[tuple[bytes, bytes]]:
        out = []
        if self.retry_after_s is not None:
            out.append((b"retry-after", str(self.retry_after_s).encode()))
        if self.should_retry is not None:
            out.append((b"x-should-retry", b"true" if self.should_retry else b"false"))
        return out

    def body(self, dialect: Dialect) -> dict[str, Any]:
        if dialect == "openai":
            error_type = OPENAI_TYPES.get(
                self.status, "server_error" if self.status >= 500 else "invalid_request_error"
            )
            return {
                "error": {
                    "message": self.message,
                    "type": error_type,
                    "param": self.param,
                    "code": self.code,
                }
            }
        return {
            "type": "error",
            "error": {
                "type": ANTHROPIC_TYPES.get(self.status, "api_error"),
                "message": self.message,
            },
        }

    def event(self, dialect: Dialect) -> bytes:
        """The error as the last SSE frame of a stream whose headers are already sent."""
        data = orjson.dumps(self.body(dialect))
        if dialect == "openai":
            return b"data: " + data + b"\n\ndata: [DONE]\n\n"
        return b"event: error\ndata: " + data + b"\n\n"


def invalid(message: str) -> ApiError:
    return ApiError(400, message, should_retry=False)
