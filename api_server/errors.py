"""Every refusal leaves the front in OpenAI's error shape, with one HTTP code per cause.

Why one table and one handler: OpenAI clients read `{"error": {"message", "type", "param", "code"}}` and decide
on the HTTP code whether to retry (429, 503) or give up (400). The decode server already says what went wrong as
a gRPC status and a message that says what to fix (docs/errors.md); the front only translates the code, keeps the
message and names the status in `code`. FastAPI's own 422 for a body it cannot parse, and Starlette's 404/405,
are answered the same way, so a client sees one shape whatever refused it.

Why two gRPC failures are told apart from the table: a request larger than a gRPC message limit (this front's
or the decode server's) comes back RESOURCE_EXHAUSTED, which the table makes a 429 that no retry can fix, so it
is a 400 saying which limit; and a call that fails after its first token (the connection to the decode server
lost, or the server ending it) says that its stream ended mid-answer, not gRPC's transport text ("Stream
removed (Socket closed)") alone.
"""

from __future__ import annotations

import json
import logging

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

log = logging.getLogger("kvtransfer.api")

# The decode server's status -> this front's HTTP code (docs/api.md, "Errors"); anything else: 500.
HTTP_OF_GRPC = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 503,  # the server gave up on the call (stopping, its peer lost): worth a retry
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.FAILED_PRECONDITION: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}

TOO_LARGE = "message larger than max"  # gRPC's own words: "CLIENT: Sent message larger than max (N vs. M)",
# or from the server, "Received message larger than max (N vs. M)"
TRANSPORT_TEXTS = ("Socket closed", "Stream removed", "Connection reset", "Broken pipe", "GOAWAY",
                   "keepalive watchdog timeout", "Connection refused")  # gRPC core's, never the decode server's

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
               429: "rate_limit_error",
               499: "request_cancelled"}  # 499: the client hung up before its answer (nobody reads it; counted)


class ApiError(Exception):
    """A refusal: its HTTP status, a message that says what to fix, the request field at fault, a short code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = ERROR_TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return ErrorResponse(self.body(), status_code=self.status)


class ErrorResponse(JSONResponse):
    """JSON as ASCII: a message quoting the client's own text (a model name holding a lone surrogate) is still a
    body UTF-8 can carry, where Starlette's `ensure_ascii=False` would fail to encode it (a 500)."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


def bad_request(message: str, param: str | None = None, code: str = "invalid_request") -> ApiError:
    return ApiError(400, message, param, code)


def internal(exc: Exception) -> ApiError:
    """A bug in the front, as a 500 in the same shape (a handler's, or a stream's error event after its 200)."""
    return ApiError(500, f"internal error in the API front: {type(exc).__name__}: {exc}", code="internal_error")


def from_rpc(e: grpc.aio.AioRpcError, backend: str, tokens: int = 0) -> ApiError:
    """The decode server's status as this front's error: its message kept, its status name as `code`. `tokens`:
    how many the call had sent before it failed (0: it failed before its first token)."""
    status, code = HTTP_OF_GRPC.get(e.code(), 500), e.code().name
    message = e.details() or e.code().name
    if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and TOO_LARGE in message:  # a retry sends the same bytes
        limit = "this front's gRPC message limit (--max-message-bytes)" if message.startswith("CLIENT:") else \
            f"the gRPC message limit of the decode server at {backend} (its --max-message-bytes)"
        return bad_request(f"the request is larger than {limit}: {message}; send a shorter prompt",
                           code="prompt_too_large")
    if tokens:
        if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL) and \
                any(t in message for t in TRANSPORT_TEXTS):
            status, code = 503, "backend_connection_lost"
            message = f"the connection to the decode server at {backend} was lost ({message}); retry the request"
        message = f"the decode worker's stream ended after {tokens} tokens, before the answer was complete: {message}"
    elif e.code() == grpc.StatusCode.UNAVAILABLE and message.lower().startswith("failed to connect"):  # this
        # channel's own (a router that answered with its workers' "failed to connect" is reachable)
        message = f"the decode server at {backend} is unreachable (--backend): {message}"
    elif e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL) and \
            any(t in message for t in TRANSPORT_TEXTS):  # e.g. a decode server that stopped answering pings
        status, code = 503, "backend_connection_lost"
        message = f"the connection to the decode server at {backend} was lost before the first token ({message}); " \
                  "retry the request"
    elif e.code() == grpc.StatusCode.UNAUTHENTICATED:  # the front's own credentials, not the client's API key
        message = f"the decode server refused this front's credentials (--backend-auth-token*): {message}"
    return ApiError(status, message, code=code)


def _loc(error: dict) -> list[str]:
    return [str(p) for p in error.get("loc", ()) if p != "body"]


def _validation_message(exc: RequestValidationError, content_type: str = "application/json"
                        ) -> tuple[str, str | None]:
    """One line naming the field (OpenAI's `param` is the top-level field); a value of none of a field's accepted
    types (the prompt) is said once, not once per type tried. A body that is no object at all under another
    Content-Type was never parsed as JSON (FastAPI reads only application/json): the message names the header."""
    errors = exc.errors()
    if not errors:
        return "the request body is not valid", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    loc = _loc(first)
    if not loc:
        kind = content_type.split(";")[0].strip().lower()
        if kind != "application/json" and not kind.endswith("+json"):
            return (f"the request body was not read as JSON: its Content-Type is {kind or 'missing'!r}; send a JSON "
                    "object with Content-Type: application/json"), None
        return f"the request body: {first.get('msg', 'invalid')} (send a JSON object)", None
    field = loc[0]
    tried = sorted({e.get("msg", "") for e in errors if _loc(e)[:1] == [field]})
    if len(tried) > 1:
        return f"{field}: not any of the accepted forms ({'; '.join(tried[:4])})", field
    return f"{'.'.join(loc)}: {first.get('msg', 'invalid')}", field


def _unparsable(cause: BaseException) -> str:
    if isinstance(cause, UnicodeDecodeError):
        return (f"the request body is not UTF-8 text (byte {cause.start}: {cause.reason}); send JSON encoded as "
                "UTF-8")
    if isinstance(cause, RecursionError):
        return "the request body nests arrays or objects too deeply to parse; send a flat JSON object"
    return f"the request body cannot be parsed as JSON ({type(cause).__name__}: {cause}); send a JSON object"


def install(app: FastAPI) -> None:
    """Route every refusal through one shape."""

    @app.exception_handler(ApiError)
    async def _api(_request: Request, exc: ApiError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc, request.headers.get("content-type", ""))
        return bad_request(message, param).response()

    @app.exception_handler(json.JSONDecodeError)
    async def _json(_request: Request, exc: json.JSONDecodeError):
        return bad_request(f"the request body is not valid JSON: {exc}").response()

    @app.exception_handler(HTTPException)
    async def _http(_request: Request, exc: HTTPException):
        if exc.status_code == 400:  # FastAPI's "There was an error parsing the body": say why
            return bad_request(_unparsable(exc.__cause__) if exc.__cause__ else str(exc.detail)).response()
        code = {404: "not_found", 405: "method_not_allowed", 408: "request_timeout",
                413: "request_too_large"}.get(exc.status_code)
        response = ApiError(exc.status_code, str(exc.detail), code=code).response()
        response.headers.update(exc.headers or {})  # a 408's `connection: close`
        return response

    @app.exception_handler(Exception)
    async def _internal(_request: Request, exc: Exception):
        log.exception("internal error")
        return internal(exc).response()
