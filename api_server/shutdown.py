"""A request still running when --shutdown-grace-s runs out after SIGTERM/SIGINT ends with an error in OpenAI's shape.

Why: at the end of its grace uvicorn cancels the requests still in flight. Left to itself, that gives a non-streaming
request uvicorn's text/plain `500 Internal Server Error`, and cuts a stream off mid-token, with neither an error
event nor `data: [DONE]` (a new-user pass). Here `Stopping` (a uvicorn.Server) marks the shutdown before uvicorn
begins it, and `CutOffAtShutdown` (an ASGI middleware, outermost but for the counters) turns that cancellation
into an answer:
  - nothing sent yet: 503, code shutting_down, saying to retry;
  - a stream under way: an error event with the same body, then `data: [DONE]`.
The generation's own cleanup (its gRPC call cancelled, so the decode server frees the request's KV) runs as on
any cancellation. A cancellation outside a shutdown (none is made today) is passed on as it came.
"""

from __future__ import annotations

import asyncio
import json

import uvicorn

from api_server.errors import ApiError

MESSAGE = ("kvtransfer-api is shutting down (SIGTERM/SIGINT) and its --shutdown-grace-s ran out before this request "
           "ended: retry it (on another replica, or once this one is back)")


class Stopping(uvicorn.Server):
    """uvicorn's server, with `stopping` set the moment its shutdown begins (before the grace period)."""

    def __init__(self, config: uvicorn.Config, stopping: asyncio.Event | None = None):
        super().__init__(config)
        self.stopping = stopping if stopping is not None else asyncio.Event()

    async def shutdown(self, sockets=None) -> None:
        self.stopping.set()
        await super().shutdown(sockets)


class CutOffAtShutdown:
    """ASGI middleware: a request cancelled while `stopping` is set is answered 503, or its stream ended with an
    error event and [DONE]."""

    def __init__(self, app, stopping: asyncio.Event):
        self.app, self.stopping = app, stopping

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = {"started": False, "sse": False, "ended": False}

        async def tracking(message):
            if message["type"] == "http.response.start":
                state["started"] = True
                state["sse"] = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                   for k, v in message.get("headers", ()))
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["ended"] = True
            await send(message)

        try:
            await self.app(scope, receive, tracking)
        except asyncio.CancelledError:
            if not self.stopping.is_set() or state["ended"]:
                raise
            error = ApiError(503, MESSAGE, code="shutting_down")
            if not state["started"]:
                await error.response()(scope, receive, send)
            elif state["sse"]:
                event = f"data: {json.dumps(error.body())}\n\ndata: [DONE]\n\n".encode()
                await send({"type": "http.response.body", "body": event, "more_body": False})
            else:  # a whole answer under way (its body is written at once: not reached today)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
