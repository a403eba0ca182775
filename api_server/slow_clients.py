"""Slow clients: a request's headers, then its body, must arrive in time, or the connection is answered 408 and closed.

Why: uvicorn times out a connection only while it idles between requests (its keep-alive). One that sends half a
request line, or headers a byte every few seconds, or fewer body bytes than its Content-Length says, was held
open for as long as the client liked: a few thousand such connections (slowloris) use up the process's file
descriptors, and every real request is then turned away without a word. The bearer token does not help: it is
read from the headers, which never end. So:
  - the headers: from the moment a connection opens, or a response on it ends, the next request's line and
    headers must be in within --header-timeout-s (`guarded_h11`, a uvicorn protocol: an asyncio timer, armed
    while no request is being parsed; uvicorn's own keep-alive timer still closes idle connections sooner);
  - the body: once the headers are in, the whole body must be in within --body-timeout-s (`BodyDeadline`, an
    ASGI middleware around the app's reads).
Either answers 408 with OpenAI's error body, code request_timeout, and the connection is closed. A request h11
cannot parse (a malformed line; over 16 KiB of headers not yet ended) gets OpenAI's body too, 400 code
invalid_request, where uvicorn answered text/plain.
"""

from __future__ import annotations

import asyncio
import json

from starlette.exceptions import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol


def _message(what: str, seconds: float, flag: str) -> str:
    return (f"the request's {what} did not arrive within {seconds:g} s ({flag}): send the whole request at once, "
            "or start kvtransfer-api with a larger " + flag)


def _raw_error(status: bytes, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 response with OpenAI's error body, for the protocol to write before it closes."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


UNPARSED = ("the request is not valid HTTP/1.1: a malformed request line or header, or over 16 KiB of request line "
            "and headers still without their end (h11's limit); send a well-formed request, the prompt in its body")


def guarded_h11(header_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline on each request's line and headers (uvicorn.Config(http=...))."""

    class GuardedH11(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._waiting_for_headers():
                if self._header_timer is None:
                    self._arm()
            else:
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._waiting_for_headers() and not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:  # h11 could not parse it: OpenAI's body, not uvicorn's text
            self._disarm()
            self.transport.write(_raw_error(b"400 Bad Request", UNPARSED, "invalid_request"))
            self.transport.close()

        def _waiting_for_headers(self) -> bool:
            # no request yet on this connection, or the last one answered: the next one's headers are awaited
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(header_timeout_s, self._too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _too_slow(self) -> None:
            self._header_timer = None
            if self.transport.is_closing() or not self._waiting_for_headers():
                return
            self.logger.info("closed a connection whose request headers did not arrive within %g s "
                             "(--header-timeout-s)", header_timeout_s)
            self.transport.write(_raw_error(b"408 Request Timeout", _message("line and headers", header_timeout_s,
                                                                            "--header-timeout-s"), "request_timeout"))
            self.transport.close()

    return GuardedH11


class BodyTimedOut(HTTPException):
    """Raised from the body's reading; errors.py answers it 408, code request_timeout."""

    def __init__(self, seconds: float):
        super().__init__(408, _message("body", seconds, "--body-timeout-s"), headers={"connection": "close"})


class BodyDeadline:
    """ASGI middleware: the app's reads of the request body end by `seconds` after the headers came in; a body
    not complete by then raises BodyTimedOut (408). Reads after the body (a disconnect watch) are not timed."""

    def __init__(self, app, seconds: float):
        self.app, self.seconds = app, seconds

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        loop = asyncio.get_running_loop()
        deadline, complete = loop.time() + self.seconds, False

        async def timed():
            nonlocal complete
            if complete:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise BodyTimedOut(self.seconds) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                complete = True
            return message

        await self.app(scope, timed, send)
