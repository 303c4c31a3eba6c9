"""An error answer in any dialect: its kind, message and the headers clients act on. The status
and the envelope come from the Rust encoders (`Dialect`), the same ones a failing stream uses."""

from __future__ import annotations

from mlxgate._native import Dialect, ErrorKind


class ApiError(Exception):
    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        *,
        retry_after_s: int | None = None,
        should_retry: bool | None = None,
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.retry_after_s = retry_after_s
        self.should_retry = should_retry
        self.code = code
        self.param = param

    def status(self, dialect: Dialect) -> int:
        return dialect.error_status(self.kind)

    def headers(self) -> list[tuple[bytes, bytes]]:
        out = []
        if self.retry_after_s is not None:
            out.append((b"retry-after", str(self.retry_after_s).encode()))
        if self.should_retry is not None:
            out.append((b"x-should-retry", b"true" if self.should_retry else b"false"))
        return out

    def body(self, dialect: Dialect, *, stream: bool = False) -> bytes:
        """The envelope as a response body, or (`stream`) as the last frames of a stream."""
        return dialect.error_reply(
            self.kind, self.message, param=self.param, code=self.code, stream=stream
        )


def invalid(message: str, *, param: str | None = None) -> ApiError:
    return ApiError(ErrorKind.INVALID_REQUEST, message, should_retry=False, param=param)
