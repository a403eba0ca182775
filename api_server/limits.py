"""The front's own size limits: the HTTP body, the prompts in one body, one prompt's gRPC message.

Why the body is limited before it is read: the front is one event loop; a body of tens of MiB costs its reading,
JSON parsing and (off the loop, but still CPU) tokenizing before anything could refuse it, and nothing beyond a
few MiB is a prompt a model can take (a 128k-token prompt is about 1 MiB as JSON token ids). A Content-Length over
--max-body-bytes is refused 413 without reading a byte; a body without one (chunked) is counted as it arrives
and refused once it passes the limit. What the client still sends is read and dropped, unparsed, before the 413
ends (for LINGER_S at most), so that a client sending its whole body before it reads can read why.

Why the prompt count and a prompt's size are checked here rather than left to the decode server: the refusals it
would give cannot be fixed by a retry and do not say what to fix. A body of more prompts than the decode server
admits at once (its --max-inflight, when set) fails 429 whatever the load; a prompt larger than a gRPC message fails
RESOURCE_EXHAUSTED on this side of the channel, before the decode server sees it. Both are 400s naming the limit,
checked before any Generate call; so is a prompt over the decode server's --max-prompt-tokens (its Info says it),
which then never crosses the channel as megabytes of ids only to be refused.
"""

from __future__ import annotations

import asyncio

from starlette.exceptions import HTTPException

from api_server.errors import ApiError, bad_request


LINGER_S = 5.0  # a refused body's rest is read (and dropped) this long at most before the 413 ends


def _too_large(limit: int, size: int | None) -> str:
    """`size` None: a body without Content-Length, refused once it passed the limit."""
    body = f"the request body is {size} bytes, over" if size is not None else "the request body went past"
    return (f"{body} this server's limit of {limit} bytes (--max-body-bytes): send a shorter prompt, or start "
            "kvtransfer-api with a larger --max-body-bytes")


class BodyTooLarge(HTTPException):
    """Raised from the body's reading; an HTTPException, so FastAPI passes it to the handler as it is (errors.py
    answers it 413, code request_too_large) instead of wrapping it as a body it could not parse."""

    def __init__(self, limit: int):
        super().__init__(413, _too_large(limit, None))


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is refused 413 before it is read, or while it is."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), b"")
        if length.isdigit() and int(length) > self.limit:
            refusal = ApiError(413, _too_large(self.limit, int(length)), code="request_too_large").response()
            return await refusal(scope, receive, _lingering(receive, send))
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        async def sending(message):  # the 413 an over-long body without a Content-Length gets, lingering too
            await (_lingering(receive, send) if seen > self.limit else send)(message)

        await self.app(scope, counted, sending)


def _lingering(receive, send):
    """`send`, except that the response's last message waits until the client has sent the rest of its body
    (read and dropped; LINGER_S at most). Why: a client that says `Connection: close` (urllib) gets its
    connection closed when the response ends; with its body still coming, its kernel turns the 413 into a
    connection reset, and the client never reads why."""

    async def linger(message):
        if message["type"] != "http.response.body" or message.get("more_body", False):
            return await send(message)
        await send({**message, "more_body": True})
        deadline = asyncio.get_running_loop().time() + LINGER_S
        try:
            while (left := deadline - asyncio.get_running_loop().time()) > 0:
                got = await asyncio.wait_for(receive(), left)
                if got["type"] != "http.request" or not got.get("more_body", False):
                    break
        except asyncio.TimeoutError:
            pass
        await send({"type": "http.response.body", "body": b""})

    return linger


def prompt_count(prompt) -> int:
    """How many prompts a /v1/completions `prompt` holds: a string and a list of ids are one."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return 1
    return len(prompt)


def check_prompt_count(n: int, limit: int) -> None:
    if n > limit:
        raise bad_request(f"prompt: {n} prompts in one request; this server takes at most {limit} "
                          "(--max-prompts-per-request: each prompt is one request to the decode server, all sent at "
                          "once): send them over several requests", "prompt", code="too_many_prompts")


def check_prompt_tokens(n: int, most: int, param: str, max_seq: int = 0) -> None:
    """`most`: the decode server's --max-prompt-tokens; `max_seq`: the tokens one request can hold there, prompt
    and answer (both from its Info; 0: not known). A prompt needs room for one answer token too."""
    if most and n > most and not (max_seq and max_seq - 1 < most):
        raise bad_request(f"{param}: {n} tokens; the decode server takes at most {most} prompt tokens (its "
                          "--max-prompt-tokens): send a shorter prompt", param, code="prompt_too_large")
    if max_seq and n > max_seq - 1:
        raise bad_request(f"{param}: {n} tokens; the decode server holds at most {max_seq} tokens a request, prompt "
                          f"and answer (its context), so at most {max_seq - 1} prompt tokens: send a shorter prompt",
                          param, code="prompt_too_large")


def check_max_tokens(prompt: int, asked: int, most: int, max_seq: int, param: str) -> None:
    """A client's max_tokens (`param`, its field's name) against the decode server's --max-new-tokens (`most`) and
    the tokens one request holds there (`max_seq`; both from its Info, 0: not known), for a prompt of `prompt`
    tokens: refused here, naming the client's field, instead of the decode server's words about `max_new_tokens`."""
    if most and asked > most:
        raise bad_request(f"{param} is {asked}; the decode server generates at most {most} tokens a request (its "
                          f"--max-new-tokens): ask for at most {most}", param)
    if max_seq and prompt < max_seq and prompt + asked > max_seq:
        raise bad_request(f"{param} is {asked}; with the prompt's {prompt} tokens that is {prompt + asked}, over the "
                          f"{max_seq} tokens the decode server holds a request (prompt and answer): ask for at most "
                          f"{max_seq - prompt}", param)


def check_message_size(n: int, size: int | None, limit: int, param: str) -> None:
    """A prompt of `n` ids whose GenerateRequest is `size` bytes (None: not built, more than `limit` for sure)."""
    if size is None or size > limit:
        made = f"a {size}-byte request" if size is not None else f"a request of more than {limit} bytes"
        raise bad_request(f"{param}: {n} tokens make {made} to the decode server, over this front's gRPC message "
                          f"limit of {limit} bytes (--max-message-bytes): send a shorter prompt, or raise "
                          "--max-message-bytes (here and on the decode server)", param, code="prompt_too_large")
