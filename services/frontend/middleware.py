"""The frontend's HTTP layer, around every handler: each failure leaves as an OpenAI-style
JSON error with its status (``errors_middleware``, the outermost, which also counts every
request and every one shed by admission control), and a caller is authenticated and held to
its body-size limit before its handler runs (``auth_middleware``)."""

from __future__ import annotations

import time

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Handler, Middleware
from prometheus_client import Counter

from services.frontend import responses as R
from services.frontend.auth import PRINCIPAL, Authenticator
from services.frontend.files import FILES_PATH
from shared.errors import (
    BadRequest,
    Internal,
    MeshserveError,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
)
from shared.logging import get_logger

log = get_logger(__name__)

MAX_BODY = web.AppKey("max_body_bytes", int)
ARRIVED = web.RequestKey("arrived", float)  # when the frontend began on it (monotonic)

# Paths anyone may call: probes, metrics, the API's description.
# The status page itself holds no data: the status it reads needs the admin key.
OPEN_PATHS = ("/health", "/metrics", "/openapi.json", "/dashboard")

REQUESTS = Counter("meshserve_http_requests", "HTTP requests", ["endpoint", "status"])
SHED = Counter(
    "meshserve_shed_requests",
    "Requests refused at admission because every instance was saturated and none was coming",
)


def error_response(err: MeshserveError) -> web.Response:
    headers = dict(err.headers)
    if err.status in (429, 503) and err.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, round(err.retry_after_s)))
    return web.Response(
        status=err.status,
        body=R.json_body(R.error_body(err)),
        content_type="application/json",
        headers=headers,
    )


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure leaves as an OpenAI-style JSON body, never as a stack trace."""
    request[ARRIVED] = time.monotonic()
    endpoint = (
        request.match_info.route.resource.canonical if request.match_info.route.resource else "?"
    )
    try:
        resp = await handler(request)
    except MeshserveError as e:
        if e.code == "overloaded":  # a job executor's admission control refused it
            SHED.inc()
        resp = error_response(e)
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[MAX_BODY]
        resp = error_response(PayloadTooLarge(f"The request body exceeds {limit} bytes."))
    except web.HTTPNotFound:
        resp = error_response(NotFound(f"Unknown request URL: {request.method} {request.path}."))
    except web.HTTPMethodNotAllowed as e:
        resp = error_response(
            MethodNotAllowed(f"Method {request.method} is not allowed on {request.path}.")
        )
        resp.headers["Allow"] = ",".join(sorted(e.allowed_methods))
    except web.RequestPayloadError as e:
        # request.read() could not decode the body (a Content-Encoding it is not in, broken
        # chunked framing): the client's fault, raised as a plain exception, not a 400.
        cause = e.__cause__
        why = cause.message if isinstance(cause, HttpProcessingError) else "it is malformed"
        resp = error_response(BadRequest(f"The request body could not be read: {why}."))
    except web.HTTPException:
        raise
    except Exception:
        log.exception("unhandled error", path=request.path)
        resp = error_response(Internal("The server had an error processing your request."))
    REQUESTS.labels(endpoint, str(resp.status)).inc()
    return resp


UPLOAD_SLACK = 1 << 20  # a file upload's multipart framing, besides the file


def auth_middleware(auth: Authenticator, upload_bytes: int | None = None) -> Middleware:
    """The caller of every path but ``OPEN_PATHS``, left on the request (``PRINCIPAL``); a
    body whose Content-Length exceeds the caller's limit is refused before it is read (a
    file upload's: ``upload_bytes``, the largest file, plus its framing)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in OPEN_PATHS:
            principal = await auth.principal(request)
            request[PRINCIPAL] = principal
            limit = principal.limits.max_body_bytes
            if upload_bytes is not None and request.path == FILES_PATH:
                limit = upload_bytes + UPLOAD_SLACK
            if (size := request.content_length) and size > limit:
                raise PayloadTooLarge(f"The request body exceeds {limit} bytes.")
        return await handler(request)

    return middleware
