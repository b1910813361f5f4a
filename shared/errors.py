"""One error hierarchy. Each error knows its HTTP status, its OpenAI error type and code,
whether retrying can succeed, and how long to wait first (``retry_after_s``).

Retry decisions are made on the class, never on a code string:

- ``PeerUnreachable``: no answer came (nobody listens, a timeout, the connection is down).
  The peer may have acted on the call: whoever retries elsewhere must first cancel it there.
- ``Refused``: the peer answered that it cannot take the call now (it does not serve that
  model at the moment, is draining, the deadline has passed). It did not act on it.
- ``NoCapacity``: nothing could take the request within its deadline; the client may retry
  after ``retry_after_s``.
- ``InstanceLost``: the instance running a request went away or gave it back (its process
  died, it is shutting down); the request moves to another instance.

Errors cross the bus as ``ErrorReply`` with their class name, and are raised again as the
same class on the other side (``from_reply``).
"""

from __future__ import annotations

from typing import Any, ClassVar

from shared.messages.api import ErrorReply


class MeshserveError(Exception):
    status: ClassVar[int] = 500
    error_type: ClassVar[str] = "internal_error"
    code: str = "internal_error"
    retryable: ClassVar[bool] = False

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
        self.headers: dict[str, str] = {}  # HTTP headers the answer carries (x-ratelimit-*)
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
            kind=type(self).__name__,
        )

    def to_openai(self) -> dict[str, Any]:
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


class Forbidden(MeshserveError):
    status = 403
    error_type = "permission_error"
    code = "forbidden"


class NotFound(MeshserveError):
    status = 404
    error_type = "invalid_request_error"
    code = "not_found"


class MethodNotAllowed(MeshserveError):
    status = 405
    error_type = "invalid_request_error"
    code = "method_not_allowed"


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
    """The service cannot serve the request now; retry after ``retry_after_s``."""

    status = 503
    error_type = "service_unavailable"
    code = "unavailable"
    retryable = True


class PeerUnreachable(Unavailable):
    """No answer from a peer; it may still have acted on the call."""

    code = "peer_unreachable"


class NoResponder(PeerUnreachable):
    """Nobody serves the subject now (every instance gone or restarting): the call reached
    no peer, so none acted on it, and sending it again is safe."""

    code = "no_responder"


class Refused(Unavailable):
    """A peer declined the call without acting on it."""

    code = "refused"


# A TE's Refused when its device's shadow validation says the task would be late or make
# another late (services/task_executor/device_arbiter.py).
DEVICE_BUSY = "device_busy"


class NoCapacity(Unavailable):
    """No instance could take the request within its deadline."""

    code = "no_capacity"


class InstanceLost(Unavailable):
    """The instance running a request is gone or gave it back; it moves elsewhere."""

    code = "instance_lost"


class Deposed(Unavailable):
    """Another member took over what this one was deciding (its lease lapsed): its late write
    was refused by the fencing number, and what it did for it is undone."""

    code = "deposed"


class Internal(MeshserveError):
    status = 500
    error_type = "internal_error"
    code = "internal_error"


class KvTransferFailed(MeshserveError):
    """A disaggregated request's KV did not reach its decode instance (the prefill instance
    failed or vanished, the transfer broke or stalled) and the deployment chose to fail
    rather than recompute (``MESHSERVE_PD_FALLBACK=fail``)."""

    status = 502
    error_type = "server_error"
    code = "kv_transfer_failed"


_ALL: tuple[type[MeshserveError], ...] = (
    BadRequest,
    Unauthorized,
    Forbidden,
    NotFound,
    MethodNotAllowed,
    Conflict,
    PayloadTooLarge,
    RateLimited,
    Unavailable,
    PeerUnreachable,
    NoResponder,
    Refused,
    NoCapacity,
    InstanceLost,
    Deposed,
    Internal,
    KvTransferFailed,
)
_BY_KIND: dict[str, type[MeshserveError]] = {cls.__name__: cls for cls in _ALL}
# A peer that predates ``kind`` (or an unknown kind): the status decides, as it did then, as
# the first (most general) class of that status.
_BY_STATUS: dict[int, type[MeshserveError]] = {}
for _cls in _ALL:
    _BY_STATUS.setdefault(_cls.status, _cls)


def from_reply(reply: ErrorReply) -> MeshserveError:
    """Rebuild the domain error a peer sent over the bus, as its own class."""
    cls = _BY_KIND.get(reply.kind) or _BY_STATUS.get(reply.status, Internal)
    return cls(reply.message, param=reply.param, retry_after_s=reply.retry_after_s, code=reply.code)
