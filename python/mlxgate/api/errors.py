"""An error answer in any dialect: its kind, message and the headers clients act on. The status
and the envelope come from the Rust encoders (`Dialect`), the same ones a failing stream uses.
The registry's errors (an unknown model, one that cannot load or fit) are worded here too."""

from __future__ import annotations

from mlxgate._native import Dialect, ErrorKind
from mlxgate.registry import ModelError, ModelTooLarge, NoRoom, UnknownModel


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


def api_error(error: ApiError | ModelError) -> ApiError:
    """What to answer for `error`: an ApiError as it is; the registry's errors as the HTTP errors
    clients act on (a 404 a client should not retry, a 529/503 to retry after)."""
    match error:
        case ApiError():
            return error
        case UnknownModel(in_body=True):
            message = str(error)
            return ApiError(
                ErrorKind.NOT_FOUND,
                message,
                code="model_not_found",
                param="model",
                should_retry=False,
            )
        case UnknownModel():
            return ApiError(ErrorKind.NOT_FOUND, str(error), code="model_not_found")
        case ModelTooLarge():
            return ApiError(ErrorKind.INVALID_REQUEST, str(error), should_retry=False)
        case NoRoom():
            return ApiError(ErrorKind.OVERLOADED, str(error), retry_after_s=error.retry_after_s)
        case _:
            return ApiError(ErrorKind.UNAVAILABLE, str(error))
