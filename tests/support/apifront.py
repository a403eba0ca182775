"""Start `kvtransfer-api` as a real process for tests, and speak raw HTTP to it.

Why a process and raw HTTP beside the openai client: what a user runs is `python -m api_server` in front of a
decode server, and an error's exact shape (status line, JSON body, malformed input) is easiest to check below
any client library's own handling of it.
"""

from __future__ import annotations

import json
import ssl
import time
import urllib.error
import urllib.request
from contextlib import contextmanager

from bench.measure.launch import free_port, spawn, stop

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


@contextmanager
def api_front(log_path: str, backend: str, args=(), ready=(200, 503), context: ssl.SSLContext | None = None):
    """`python -m api_server --backend BACKEND ARGS` on a free loopback port; yields its base URL once /health
    answers with a status in `ready` (503: up, its backend not serving); `context`: over HTTPS."""
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
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"kvtransfer-api not up after {START_S} s:\n{_tail(log_path)}")
            time.sleep(0.3)
        yield url
    finally:
        stop([proc])


def _tail(path: str, n: int = 4000) -> str:
    with open(path) as f:
        return f.read()[-n:]
