"""One error hierarchy. Each error knows its HTTP status, its OpenAI error type and code,
and whether retrying the same call later can succeed."""

from __future__ import annotations

from shared.messages.api import ErrorReply


class MeshserveError(Exception):
    status: int = 500
    error_type: str = "internal_error"
    code: str = "internal_error"
    retryable: bool = False

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        retry_after_s: float | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s
        if code is not None:
            self.code = code

    def to_reply(self) -> ErrorReply:
        return ErrorReply(
            status=self.status,
            code=self.code,
            message=self.message,
            retryable=self.retryable,
            retry_after_s=self.retry_after_s,
            param=self.param,
        )

    def to_openai(self) -> dict:
        """The body an OpenAI client expects: {"error": {message, type, param, code}}."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


class BadRequest(MeshserveError):
    status = 400
    error_type = "invalid_request_error"
    code = "invalid_request"


class Unauthorized(MeshserveError):
    status = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


class NotFound(MeshserveError):
    status = 404
    error_type = "invalid_request_error"
    code = "not_found"


class Conflict(MeshserveError):
    status = 409
    error_type = "invalid_request_error"
    code = "conflict"


class PayloadTooLarge(MeshserveError):
    status = 413
    error_type = "invalid_request_error"
    code = "payload_too_large"


class RateLimited(MeshserveError):
    status = 429
    error_type = "rate_limit_error"
    code = "rate_limited"
    retryable = True


class Unavailable(MeshserveError):
    """No capacity within the deadline, or a peer is gone. Retry after retry_after_s."""

    status = 503
    error_type = "service_unavailable"
    code = "unavailable"
    retryable = True


class Internal(MeshserveError):
    status = 500
    error_type = "internal_error"
    code = "internal_error"


_BY_STATUS: dict[int, type[MeshserveError]] = {
    cls.status: cls
    for cls in (
        BadRequest,
        Unauthorized,
        NotFound,
        Conflict,
        PayloadTooLarge,
        RateLimited,
        Unavailable,
    )
}


def from_reply(reply: ErrorReply) -> MeshserveError:
    """Rebuild the domain error a peer sent over the bus."""
    cls = _BY_STATUS.get(reply.status, Internal)
    return cls(reply.message, param=reply.param, retry_after_s=reply.retry_after_s, code=reply.code)
