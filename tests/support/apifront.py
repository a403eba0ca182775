"""Start `kvtransfer-api` as a real process for tests, and speak raw HTTP to it; or drive its app in-process
against a scripted decode server.

Why a process and raw HTTP beside the openai client: what a user runs is `python -m api_server` in front of a
decode server, and an error's exact shape (status line, JSON body, malformed input) is easiest to check below
any client library's own handling of it. Why the in-process driver beside it: a decode server that fails at a
chosen token, never answers, or a client that hangs up at a chosen moment is hard to stage with real processes
and cheap with a scripted Backend and a hand-made ASGI exchange (no HTTP client library needed).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import ssl
import time
import urllib.error
import urllib.request
from contextlib import contextmanager

import grpc

from bench.measure.launch import free_port, spawn, stop
from proto import kvtransfer_pb2 as pb

START_S = 240.0  # importing transformers for the tokenizer takes tens of seconds on a loaded 2-core machine


def request(method: str, url: str, body=None, token: str = "", raw: bytes | None = None,
            timeout: float = 60.0, context: ssl.SSLContext | None = None) -> tuple[int, dict | str]:
    """(status, parsed JSON body or text); `raw` is sent as it is (malformed bodies); `context`: HTTPS."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=context) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def start_api(log_path: str, backend: str, args=(), ready=(200, 503), context: ssl.SSLContext | None = None):
    """`python -m api_server --backend BACKEND ARGS` on a free loopback port, once /health answers with a status in
    `ready` (503: up, its backend not serving) -> (its process, its base URL); `context`: over HTTPS. The caller
    stops the process (a test of the stop itself signals it)."""
    addr = f"127.0.0.1:{free_port()}"
    proc = spawn("api_server", ["--backend", backend, "--listen", addr, *args], log_path)
    url = f"{'https' if context else 'http'}://{addr}"
    deadline = time.monotonic() + START_S
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"kvtransfer-api exited {proc.returncode} during start-up:\n{_tail(log_path)}")
            try:
                if request("GET", f"{url}/health", timeout=5, context=context)[0] in ready:
                    return proc, url
            except (OSError, http.client.HTTPException):  # not up yet; or not HTTP: another process's port
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"kvtransfer-api not up after {START_S} s:\n{_tail(log_path)}")
            time.sleep(0.3)
    except BaseException:
        stop([proc])
        raise


@contextmanager
def api_front(log_path: str, backend: str, args=(), ready=(200, 503), context: ssl.SSLContext | None = None):
    """`start_api`, yielding its base URL, and the process stopped at the end."""
    proc, url = start_api(log_path, backend, args, ready, context)
    try:
        yield url
    finally:
        stop([proc])


def _tail(path: str, n: int = 4000) -> str:
    with open(path) as f:
        return f.read()[-n:]


HANG = object()  # in a FakeCall's script: no answer until the call is cancelled


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, None, None, details=details)


class FakeCall:
    """A Generate call that plays a script: token ids, (id, FinishReason) for a last message, an exception that
    `read` raises, or HANG. Records whether it was cancelled and whether its status was read."""

    def __init__(self, request: pb.GenerateRequest, script):
        self.request, self.script = request, list(script)
        self.cancelled = self.status_read = self._ended = False
        self._cancel = asyncio.Event()

    async def read(self):
        if self.cancelled:
            raise asyncio.CancelledError
        if not self.script:
            self._ended = True
            return grpc.aio.EOF
        item = self.script.pop(0)
        if item is HANG:
            await self._cancel.wait()
            raise asyncio.CancelledError  # as grpc.aio's read of a call cancelled here
        if isinstance(item, BaseException):
            self._ended = True
            raise item
        token, reason = item if isinstance(item, tuple) else (item, pb.FINISH_REASON_UNSPECIFIED)
        return pb.GenerateResponse(token_id=token, finish_reason=reason)

    async def code(self) -> grpc.StatusCode:
        self.status_read = self._ended = True
        return grpc.StatusCode.OK

    def done(self) -> bool:
        return self._ended or self.cancelled

    def cancel(self) -> bool:
        if self.done():
            return False
        self.cancelled = True
        self._cancel.set()
        return True


class FakeBackend:
    """api_server.backend.Backend's surface, answering Generate with FakeCalls: `script(request)` gives each
    call's script. Keeps every call made, in order."""

    address = "fake-decode:0"

    def __init__(self, script, info: pb.InfoResponse | None = None):
        self.script, self._info = script, info or pb.InfoResponse(model="fake", max_new_tokens=64)
        self.calls: list[FakeCall] = []

    def open(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def info(self) -> pb.InfoResponse:
        return self._info

    async def serving(self, timeout: float) -> bool:
        return True

    def generate(self, request: pb.GenerateRequest) -> FakeCall:
        self.calls.append(FakeCall(request, self.script(request)))
        return self.calls[-1]


async def asgi_post(app, path: str, body: dict, hang_up_after: float | None = None,
                    timeout: float = 10.0) -> tuple[int, str]:
    """POST `body` to the ASGI `app` as uvicorn would hand it over; (status, body text). `hang_up_after`: the
    client disconnects that many seconds in. Raises TimeoutError when the app has not finished in `timeout` s."""
    data = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    gone, asked, status, chunks = asyncio.Event(), [], [0], []

    async def receive():
        if not asked:
            asked.append(1)
            return {"type": "http.request", "body": data, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            status[0] = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                gone.set()

    if hang_up_after is not None:
        asyncio.get_running_loop().call_later(hang_up_after, gone.set)
    await asyncio.wait_for(app(scope, receive, send), timeout)
    return status[0], b"".join(chunks).decode()


def sse_events(text: str) -> list:
    """A stream's `data:` payloads in order: parsed JSON, or the string "[DONE]"."""
    out = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            payload = block[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out
