"""Slow clients cannot hold the OpenAI front's connections: headers or a body that do not arrive in time get a 408
with OpenAI's error body and the connection closed (api_server/slow_clients.py), and the front serves on.

Why a real process and raw sockets: the stall happens below the app, in uvicorn's HTTP parsing, where only a
running front shows what a client that stops mid-request gets. Before the fix each of these connections stayed
open for as long as the client liked (a new-user pass held 19,980 of them). No decode server is needed: every
case ends before a request reaches it. The bounds asserted are the sockets' own generous timeouts: a stall that
is never answered fails the test by timing out, however loaded the machine.
"""

from __future__ import annotations

import json
import socket
import time

import pytest

from support.apifront import api_front, request

SHAPE = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def addr(tmp_path_factory):
    logs = tmp_path_factory.mktemp("api")
    with api_front(str(logs / "api.log"), "127.0.0.1:1", ["--header-timeout-s", "1", "--body-timeout-s", "1"],
                   ready=(503,)) as url:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        yield host, int(port)


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _timed_out(data: bytes, *words: str) -> dict:
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), data
    assert b"connection: close" in head.lower(), head
    err = json.loads(body)["error"]
    assert set(err) == SHAPE and err["code"] == "request_timeout" and err["type"] == "invalid_request_error", err
    for w in words:
        assert w in err["message"], err
    return err


def test_headers_that_stop_halfway_get_408_and_the_connection_closes(addr):
    with socket.create_connection(addr, timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        _timed_out(_read_all(sock), "headers", "--header-timeout-s")


def test_headers_sent_a_byte_at_a_time_are_cut_off(addr):
    """The slowloris pattern: each byte arrives before any idle timer would fire, the headers never end."""
    line = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200
    with socket.create_connection(addr, timeout=60) as sock:
        got = b""
        for i in range(len(line)):
            try:
                sock.sendall(line[i:i + 1])
            except OSError:  # closed under us: the 408 is in the socket's buffer
                break
            time.sleep(0.1)
            sock.setblocking(False)
            try:
                got += sock.recv(65536)
            except BlockingIOError:
                pass
            finally:
                sock.setblocking(True)
            if got:
                break
        assert got or i < len(line) - 1, "all 200+ bytes went in over 20 s and nothing was answered"
        sock.settimeout(60)
        _timed_out(got + _read_all(sock), "headers")


def test_a_connection_that_never_sends_a_request_is_closed(addr):
    with socket.create_connection(addr, timeout=60) as sock:
        _timed_out(_read_all(sock), "headers")


def test_a_body_shorter_than_its_length_gets_408(addr):
    with socket.create_connection(addr, timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"prompt\": [1, 2")
        _timed_out(_read_all(sock), "body", "--body-timeout-s")


def test_a_chunked_body_that_never_ends_gets_408(addr):
    with socket.create_connection(addr, timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\na\r\n{\"prompt\":\r\n")
        _timed_out(_read_all(sock), "body")


def test_the_next_request_on_a_kept_alive_connection_has_the_same_deadline(addr):
    """After a whole request and its answer, a second request's headers that stop halfway are cut off too (the
    keep-alive timer uvicorn arms is cancelled by the first bytes of the next request)."""
    with socket.create_connection(addr, timeout=60) as sock:
        sock.sendall(b"GET /v1/no-such-path HTTP/1.1\r\nHost: x\r\n\r\n")
        first = b""
        while b"\r\n\r\n" not in first:
            first += sock.recv(65536)
        head, _, rest = first.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 404 "), head
        length = int(next(v for k, _, v in (h.partition(b":") for h in head.split(b"\r\n")[1:])
                          if k.strip().lower() == b"content-length"))
        while len(rest) < length:
            rest += sock.recv(65536)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHo")
        _timed_out(rest[length:] + _read_all(sock), "headers")


def test_a_whole_request_is_still_answered(addr):
    status, body = request("GET", f"http://{addr[0]}:{addr[1]}/v1/no-such-path")
    assert status == 404 and body["error"]["code"] == "not_found", body


@pytest.mark.parametrize("pieces", [
    [b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"] + [b"X-Big-%d: " % i + b"a" * 8000 + b"\r\n" for i in range(12)],
    [b"NOT HTTP AT ALL\r\n\r\n"],
], ids=["headers_over_16k_unended", "garbage"])
def test_a_request_h11_cannot_parse_gets_openai_error_body(addr, pieces):
    """uvicorn answered these text/plain "Invalid HTTP request received."; a client of an OpenAI API reads JSON.
    h11 refuses headers once over 16 KiB of them is buffered without their end, so they go in pieces."""
    with socket.create_connection(addr, timeout=60) as sock:
        try:
            for piece in pieces:
                sock.sendall(piece)
                time.sleep(0.02)
        except OSError:  # closed under us once h11 gave up: the 400 is in the socket's buffer
            pass
        data = _read_all(sock)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 "), data[:300]
    assert b"application/json" in head.lower(), head
    err = json.loads(body)["error"]
    assert set(err) == SHAPE and err["code"] == "invalid_request" and "HTTP/1.1" in err["message"], err
    assert request("GET", f"http://{addr[0]}:{addr[1]}/health")[0] in (200, 503)  # the front serves on
