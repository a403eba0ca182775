"""What a client can put in a body that the OpenAI front must refuse by name, and how big a body may be, against
a real front (with a tokenizer) and a real colocated decode server; the front serves on after each.

Why real processes: the cases here fail below the route handlers (uvicorn's body reading, FastAPI's JSON parsing,
pydantic's coercion, the tokenizer's Rust binding, the event loop itself), where only a running front shows
which layer answered and how. Why ordering rather than a time bound for the huge body: on a busy 2-core machine
any bound is a guess, while "the small request is answered before the huge one" holds by a wide margin when the
huge prompt is tokenized off the event loop and never when it is tokenized on it.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import pytest

from support.apifront import api_front, request
from support.servers import colocated_server
from support.textmodel import build_text_model

SHAPE = {"message", "type", "param", "code"}
BODY_LIMIT = 4 << 20  # --max-body-bytes' default
WORDS = "The quick brown fox jumps over the lazy dog. Hello, world! "


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_text_model(tmp_path_factory.mktemp("textmodel"))


@pytest.fixture(scope="module")
def url(model_dir, tmp_path_factory):
    with colocated_server(tmp_path_factory.mktemp("decode"), model=str(model_dir)) as decode:
        logs = tmp_path_factory.mktemp("api")
        with api_front(str(logs / "api.log"), decode.addr, ["--model", str(model_dir)], ready=(200,)) as u:
            yield u


@pytest.fixture(autouse=True)
def serves_on_afterwards(url):
    yield
    status, body = post(url, {"prompt": "Hello", "max_tokens": 2})
    assert status == 200 and body["choices"][0]["finish_reason"] in ("length", "stop"), body


def post(url: str, body=None, path: str = "/v1/completions", raw: bytes | None = None):
    return request("POST", f"{url}{path}", body, raw=raw)


def refused(got, status: int, param: str | None, code: str, *words: str) -> dict:
    got_status, body = got
    assert got_status == status, body
    assert isinstance(body, dict) and set(body) == {"error"} and set(body["error"]) == SHAPE, body
    err = body["error"]
    assert err["param"] == param and err["code"] == code, err
    for w in words:
        assert w in err["message"], err
    return err


CHAT = "/v1/chat/completions"


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "ab\ud800c"}, "prompt"),
    ("/v1/completions", {"prompt": ["fine", "x\udfff"]}, "prompt"),
    (CHAT, {"messages": [{"role": "user", "content": "a\ud800"}]}, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}, "messages[0].content"),
    (CHAT, {"messages": [{"role": "us\udc00er", "content": "a"}]}, "messages[0].role"),
], ids=["prompt", "prompt-list", "chat-content", "chat-part", "chat-role"])
def test_a_lone_surrogate_is_400_naming_the_field(url, path, body, param):
    """JSON's "\\ud800" parses to a str no UTF-8 encoder takes: before, the tokenizer raised TypeError (500)."""
    refused(post(url, {"max_tokens": 2, **body}, path), 400, param, "invalid_request", "lone UTF-16 surrogate")


def test_a_model_name_with_a_lone_surrogate_is_404_not_500(url):
    """The 404 quotes the name: its body must still encode (it did not: a 500 from rendering the 404)."""
    err = refused(post(url, {"model": "m\ud800", "prompt": "x"}), 404, "model", "model_not_found")
    assert "\ud800" in err["message"]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "x", "max_tokens": "8"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 8.0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "x", "temperature": "0"}, "temperature"),
    (CHAT, {"messages": [{"role": "user"}], "max_tokens": 2}, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": "2"}, "max_completion_tokens"),
], ids=["max_tokens-str", "max_tokens-float", "stream-str", "temperature-str", "no-content", "max_completion-str"])
def test_a_field_of_the_wrong_type_or_missing_is_400_not_coerced(url, path, body, param):
    refused(post(url, body, path), 400, param, "invalid_request", param)


@pytest.mark.parametrize("raw,words", [
    (b'{"prompt": "\xff\xfe", "max_tokens": 2}', "not UTF-8"),
    (b"[" * 100_000 + b"]" * 100_000, "too deeply"),
], ids=["not-utf8", "100k-deep"])
def test_a_body_not_utf8_or_nested_too_deep_is_400_invalid_request(url, raw, words):
    refused(post(url, raw=raw), 400, None, "invalid_request", words)


def test_more_prompts_than_a_request_may_hold_is_400_naming_the_flag(url):
    """Before: each prompt one Generate call, 200 > the decode server's --max-inflight 64, 429 however often
    retried."""
    refused(post(url, {"prompt": [[1, 2]] * 200, "max_tokens": 2}), 400, "prompt", "too_many_prompts",
            "200 prompts", "at most 64", "--max-prompts-per-request")


def _host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def test_a_body_over_the_limit_is_413_before_it_is_read(url):
    """Headers announcing 1 GiB and no body at all: the 413 comes without waiting for one byte of it (before:
    the front waited for the body, and would then have parsed and tokenized it)."""
    host, port = _host_port(url)
    with socket.create_connection((host, port), timeout=60) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {1 << 30}\r\n\r\n".encode())
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        got = resp.status, json.loads(resp.read())
    refused(got, 413, None, "request_too_large", f"{1 << 30} bytes", str(BODY_LIMIT), "--max-body-bytes")


def test_a_body_over_the_limit_is_413_with_a_length_or_chunked(url):
    ids = b"[" + b"5," * (BODY_LIMIT // 2) + b"5]"  # over the limit as JSON; before: parsed, then a 429
    refused(post(url, raw=b'{"prompt": ' + ids + b"}"), 413, None, "request_too_large", "--max-body-bytes")

    def chunks():
        yield b'{"prompt": '
        for i in range(0, len(ids), 1 << 20):
            yield ids[i:i + (1 << 20)]
        yield b"}"

    conn = http.client.HTTPConnection(*_host_port(url), timeout=60)
    try:
        conn.request("POST", "/v1/completions", body=chunks(), headers={"Content-Type": "application/json"},
                     encode_chunked=True)
        resp = conn.getresponse()
        got = resp.status, json.loads(resp.read())
    finally:
        conn.close()
    refused(got, 413, None, "request_too_large", f"went past this server's limit of {BODY_LIMIT} bytes",
            "--max-body-bytes")


def test_a_small_request_is_answered_while_a_huge_prompt_is_tokenized(url):
    """A 3 MiB text prompt (within the body limit) takes seconds to tokenize; before, that ran on the event loop
    and a one-word request sent meanwhile waited for all of it (7.2 s beside a 16 MiB prompt)."""
    text = WORDS * ((3 << 20) // len(WORDS))
    order, sent = [], threading.Event()

    def huge():
        conn = http.client.HTTPConnection(*_host_port(url), timeout=300)
        try:
            conn.request("POST", "/v1/completions", body=json.dumps({"prompt": text, "max_tokens": 2}),
                         headers={"Content-Type": "application/json"})
            sent.set()
            resp = conn.getresponse()
            order.append(("huge", resp.status, resp.read()))
        finally:
            sent.set()
            conn.close()

    worker = threading.Thread(target=huge)
    worker.start()
    try:
        assert sent.wait(120)
        time.sleep(1.0)  # the body read and parsed: the front is tokenizing it now
        status, body = post(url, {"prompt": "Hello", "max_tokens": 2})
        order.append(("small", status, body))
    finally:
        worker.join(300)
    assert [name for name, *_ in order] == ["small", "huge"], order
    assert order[0][1] == 200 and order[1][1] == 400, order  # the huge prompt: over the context, said by the server
