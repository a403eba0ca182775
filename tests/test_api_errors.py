"""Every bad request to the OpenAI front is answered in OpenAI's error shape with its HTTP code, and the front
serves on afterwards.

Why real processes: the codes come from three places (the front's own checks, FastAPI's parsing, the decode
server's gRPC status through api_server/errors.py), and only a running front shows which one answered and how.
The fronts: one before a colocated decode server with --max-inflight 2 and a bearer token; one before the same
decode server with a 0.5 s deadline (504); one before an address nobody listens on (503). The last two have no
tokenizer, so they start in seconds.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from bench.measure.launch import stop
from support.apifront import api_front, request, start_api
from support.faultkit import scrape, value
from support.servers import ROOT, colocated_server, free_port
from support.textmodel import build_text_model

TOKEN = "s3cret-token"
SHAPE = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_text_model(tmp_path_factory.mktemp("textmodel"))


@pytest.fixture(scope="module")
def decode(model_dir, tmp_path_factory):
    port = free_port()
    with colocated_server(tmp_path_factory.mktemp("decode"), model=str(model_dir),
                          args=["--max-inflight", "2", "--metrics-port", str(port)]) as d:
        d.metrics_port = port  # its kvt_requests_total: how each request ended
        yield d


@pytest.fixture(scope="module")
def url(decode, model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("api")
    token_file = logs / "token"
    token_file.write_text(TOKEN + "\n")
    with api_front(str(logs / "api.log"), decode.addr,
                   ["--model", str(model_dir), "--auth-token-file", str(token_file)], ready=(200,)) as u:
        yield u


@pytest.fixture(autouse=True)
def serves_on_afterwards(request_url):
    yield
    if request_url is not None:
        status, body = post(request_url, "/v1/completions", {"prompt": "Hello", "max_tokens": 2})
        assert status == 200 and body["choices"][0]["finish_reason"] in ("length", "stop"), body


@pytest.fixture
def request_url(request):
    return request.getfixturevalue("url") if "url" in request.fixturenames else None


def post(url: str, path: str, body=None, token: str = TOKEN, raw: bytes | None = None):
    return request("POST", f"{url}{path}", body, token=token, raw=raw)


def refused(got, status: int, param: str | None = None, *words: str) -> dict:
    code, body = got
    assert code == status, body
    assert isinstance(body, dict) and set(body) == {"error"} and set(body["error"]) == SHAPE, body
    err = body["error"]
    if param is not None:
        assert err["param"] == param, err
    for w in words:
        assert w in err["message"], err
    return err


def test_an_unknown_model_is_404(url):
    err = refused(post(url, "/v1/completions", {"model": "gpt-4", "prompt": "x"}), 404, "model", "gpt-4")
    assert err["code"] == "model_not_found"


@pytest.mark.parametrize("body,param,words", [
    ({"temperature": -0.5}, "temperature", ["temperature"]),
    ({"max_tokens": 0}, "max_tokens", ["max_tokens"]),
    ({"top_p": 2}, "top_p", ["top_p"]),
    ({"n": 2}, "n", ["n=2"]),
    ({"logprobs": 1}, "logprobs", ["logprobs"]),
    ({"echo": True}, "echo", ["echo"]),
    ({"best_of": 2}, "best_of", ["best_of"]),
    ({"prompt": 5}, "prompt", []),
    ({"prompt": []}, "prompt", ["empty"]),
    ({"prompt": [1, 1 << 70]}, "prompt", []),
], ids=["temperature", "max_tokens", "top_p", "n", "logprobs", "echo", "best_of", "prompt-type", "prompt-empty",
        "prompt-id-over-int64"])
def test_completion_requests_out_of_range_or_not_implemented_are_400(url, body, param, words):
    refused(post(url, "/v1/completions", {"prompt": "x", **body}), 400, param, *words)


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"logprobs": True}, "logprobs"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
], ids=["tools", "response_format", "logprobs", "no-messages", "image-part"])
def test_chat_requests_not_implemented_are_400(url, body, param):
    refused(post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], **body}), 400, param)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_prompt_and_max_tokens_over_the_context_is_400_naming_max_tokens(url, stream):
    """Streaming too: a refusal before the first token is an HTTP error, not an error event in a 200 stream. The
    prompt fits; with its max_tokens it does not: the front refuses it from the decode server's Info, naming the
    client's field (it passed on the decode server's words about max_new_tokens, param null, until 2026-12-07; the
    decode server's own check stays behind it, decode_server/validate.py)."""
    got = post(url, "/v1/completions", {"prompt": [5] * 4000, "max_tokens": 200, "stream": stream})
    assert refused(got, 400, "max_tokens", "that is 4200", "ask for at most 96")["code"] == "invalid_request"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_prompt_that_leaves_no_room_in_the_context_is_refused_by_the_front(url, stream):
    got = post(url, "/v1/completions", {"prompt": [5] * 4096, "max_tokens": 4, "stream": stream})
    assert refused(got, 400, "prompt", "at most 4095 prompt tokens", "context")["code"] == "prompt_too_large"


def test_a_token_id_outside_the_vocabulary_is_400(url):
    err = refused(post(url, "/v1/completions", {"prompt": [1, 2, 100000]}), 400, None, "vocabulary")
    assert err["code"] == "INVALID_ARGUMENT"


def test_max_tokens_over_the_decode_servers_limit_is_400(url):
    refused(post(url, "/v1/completions", {"prompt": [1, 2], "max_tokens": 5000}), 400, "max_tokens",
            "at most 4096 tokens a request (its --max-new-tokens)")


@pytest.mark.parametrize("raw", [b"{not json", b'{"prompt": "x",}', b"", b"[1, 2]"],
                         ids=["garbage", "trailing-comma", "empty", "not-an-object"])
def test_a_malformed_body_is_400_not_422(url, raw):
    refused(post(url, "/v1/completions", raw=raw), 400)


def test_a_missing_field_is_400_naming_it(url):
    refused(post(url, "/v1/completions", {"max_tokens": 3}), 400, "prompt")
    refused(post(url, "/v1/chat/completions", {"model": "x"}), 400, "messages")


def test_no_token_or_a_wrong_one_is_401_and_health_needs_none(url):
    refused(post(url, "/v1/completions", {"prompt": "x"}, token=""), 401, None, "missing")
    refused(post(url, "/v1/completions", {"prompt": "x"}, token="wrong"), 401, None, "does not match")
    refused(request("GET", f"{url}/v1/models"), 401)
    assert request("GET", f"{url}/health")[0] == 200


def test_unknown_routes_and_methods_keep_the_shape(url):
    refused(request("GET", f"{url}/v1/nope", token=TOKEN), 404)
    refused(request("GET", f"{url}/v1/completions", token=TOKEN), 405)


def _open_stream(url: str):
    """A long streaming request, read up to its first chunk: it holds one of the decode server's slots."""
    req = urllib.request.Request(f"{url}/v1/completions", method="POST", data=json.dumps(
        {"prompt": [1, 2, 3], "max_tokens": 3000, "stream": True, "ignore_eos": True}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
    resp = urllib.request.urlopen(req, timeout=60)
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    return resp


def test_a_full_decode_server_is_429_and_frees_its_slots_when_streams_close(url):
    held = [_open_stream(url), _open_stream(url)]  # --max-inflight 2
    try:
        err = refused(post(url, "/v1/completions", {"prompt": [1, 2], "max_tokens": 2}), 429)
        assert err["code"] == "RESOURCE_EXHAUSTED"
    finally:
        for r in held:
            r.close()  # the front cancels their Generate calls at their next token; the decode server frees them
    deadline = time.monotonic() + 30
    while (got := post(url, "/v1/completions", {"prompt": [1, 2], "max_tokens": 2}))[0] == 429:
        assert time.monotonic() < deadline, "the closed streams' slots were never freed"
        time.sleep(0.2)
    assert got[0] == 200, got


def _send_and_keep(url: str, body: dict) -> socket.socket:
    """A request written on a raw socket and left unread: closing the socket is the client hanging up."""
    data = json.dumps(body).encode()
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Authorization: Bearer {TOKEN}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def test_a_client_that_hangs_up_on_a_whole_answer_frees_its_slot_at_once(url, decode):
    """Non-streaming, nothing is written to the client before the answer is whole, so nothing but the front's own
    watching notices the hang-up; unnoticed, each of these would hold a slot for the ~30 s of its 4000 tokens and
    end OK. What is asserted is that the front cut both short (they end CANCELLED at the decode server), not how
    soon: a busy machine slows the notice and the generation alike. Then the slots serve again."""
    held = [_send_and_keep(url, {"prompt": [1, 2, 3], "max_tokens": 4000, "ignore_eos": True}) for _ in range(2)]
    try:
        time.sleep(0.5)
        deadline = time.monotonic() + 30
        while post(url, "/v1/completions", {"prompt": [1, 2], "max_tokens": 2})[0] != 429:  # --max-inflight 2
            assert time.monotonic() < deadline, "the two long requests never held both slots"
            time.sleep(0.1)
        before = ended(decode)
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 180  # past the 4000 tokens on a busy machine: unnoticed, they end OK meanwhile
    while sum(ended(decode).values()) - sum(before.values()) < 2:
        assert time.monotonic() < deadline, "the hung-up requests never ended"
        time.sleep(0.1)
    got = {k: ended(decode)[k] - before[k] for k in before}
    assert got == {"CANCELLED": 2, "OK": 0}, f"the hung-up requests ended {got}: they were not cut short"
    deadline = time.monotonic() + 30
    while (got := post(url, "/v1/completions", {"prompt": [1, 2], "max_tokens": 2}))[0] == 429:
        assert time.monotonic() < deadline, "the hung-up requests ended but their slots were never freed"
        time.sleep(0.1)
    assert got[0] == 200, got


def ended(decode) -> dict[str, float]:
    """The decode server's requests ended CANCELLED and OK so far (kvt_requests_total)."""
    m = scrape(f"http://127.0.0.1:{decode.metrics_port}/metrics")
    return {k: value(m, "kvt_requests_total", outcome=k) for k in ("CANCELLED", "OK")}


def test_the_tokens_never_reach_the_log(tmp_path):
    front, backend = "front-secret-8c1f0e", "backend-secret-5d2e7a"
    log = tmp_path / "api.log"
    args = ["--served-model-name", "m", "--auth-token", front, "--backend-auth-token", backend, "--log-level", "DEBUG"]
    with api_front(str(log), f"127.0.0.1:{free_port()}", args, ready=(503,)) as u:
        refused(post(u, "/v1/completions", {"prompt": [1, 2]}, token=front), 503)  # a Generate call, with its token
        refused(post(u, "/v1/completions", {"prompt": [1, 2]}, token=front + "x"), 401)
    text = log.read_text()
    assert "auth_token=<set>" in text and "backend_auth_token=<set>" in text, text  # the start-up config line
    assert front not in text and backend not in text, text


@pytest.fixture(scope="module")
def dead_backend(tmp_path_factory):
    logs = tmp_path_factory.mktemp("dead")
    with api_front(str(logs / "api.log"), f"127.0.0.1:{free_port()}", ["--served-model-name", "m"],
                   ready=(503,)) as u:
        yield u


def test_an_unreachable_decode_server_is_503_and_health_says_so(dead_backend):
    err = refused(post(dead_backend, "/v1/completions", {"prompt": [1, 2]}), 503, None, "unreachable")
    assert err["code"] == "UNAVAILABLE"
    refused(request("GET", f"{dead_backend}/health"), 503)


def test_stop_strings_without_a_tokenizer_are_400_not_ignored(dead_backend):
    """They match the generated text, which is empty without a tokenizer: accepted, they would never stop it."""
    err = refused(post(dead_backend, "/v1/completions", {"prompt": [1, 2], "stop": ["x"]}), 400, "stop",
                  "--tokenizer DIR", "stop_token_ids")
    assert err["code"] == "no_tokenizer"


def test_text_without_a_tokenizer_is_400_naming_the_flag(dead_backend):
    err = refused(post(dead_backend, "/v1/completions", {"prompt": "hello"}), 400, "prompt", "--tokenizer DIR")
    assert err["code"] == "no_tokenizer"
    refused(post(dead_backend, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}), 400,
            "messages", "--tokenizer DIR")


def test_a_generation_past_its_deadline_is_504_and_the_metrics_count_it(decode, tmp_path):
    port = free_port()
    with api_front(str(tmp_path / "api.log"), decode.addr, ["--served-model-name", "m", "--request-timeout-s", "0.5",
                                                            "--metrics-port", str(port)], ready=(200,)) as u:
        err = refused(post(u, "/v1/completions", {"prompt": [1, 2], "max_tokens": 4000, "ignore_eos": True}), 504)
        assert err["code"] == "DEADLINE_EXCEEDED"
        status, body = post(u, "/v1/completions", {"prompt": [1, 2], "max_tokens": 3, "ignore_eos": True})
        assert status == 200 and body["usage"]["completion_tokens"] == 3
        assert body["choices"][0]["text"] == "" and len(body["choices"][0]["token_ids"]) == 3  # no tokenizer: ids
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
    def value(name: str) -> float:
        return float(text.split(f"{name} ")[1].split()[0])
    assert value('kvt_api_requests_total{code="504",endpoint="/v1/completions"}') == 1
    assert value('kvt_api_requests_total{code="200",endpoint="/v1/completions"}') == 1
    assert value('kvt_api_ttft_ms_count{endpoint="/v1/completions"}') >= 1
    assert value("kvt_api_itl_ms_count") >= 2  # the 200's three tokens: two gaps at least


def test_https_with_client_certificates(tmp_path):
    """--tls-cert/--tls-key serve HTTPS; --tls-ca requires a client certificate signed by it (the decode server's
    flags and meaning); refusals keep their shape over TLS."""
    subprocess.run(["bash", os.path.join(ROOT, "deploy", "make_test_ca.sh"), str(tmp_path / "pki"), "1"],
                   check=True, capture_output=True)
    pki = {n: str(tmp_path / "pki" / n) for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}
    with_cert = ssl.create_default_context(cafile=pki["ca.pem"])
    with_cert.load_cert_chain(pki["client.pem"], pki["client.key"])
    args = ["--served-model-name", "m", "--tls-cert", pki["server.pem"], "--tls-key", pki["server.key"],
            "--tls-ca", pki["ca.pem"]]
    with api_front(str(tmp_path / "api.log"), f"127.0.0.1:{free_port()}", args, ready=(503,), context=with_cert) as u:
        assert u.startswith("https://")
        refused(request("POST", f"{u}/v1/completions", {"prompt": [1]}, context=with_cert), 503)
        refused(request("POST", f"{u}/v1/completions", {"n": 2, "prompt": [1]}, context=with_cert), 400, "n")
        no_cert = ssl.create_default_context(cafile=pki["ca.pem"])
        with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
            request("GET", f"{u}/health", context=no_cert)
        with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
            request("GET", f"{u.replace('https', 'http', 1)}/health")


@pytest.mark.parametrize("case", ["port-taken", "no-tokenizer-dir", "not-a-tokenizer", "bad-backend"])
def test_a_start_that_cannot_work_exits_2_in_one_line(case, tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        args, words = {
            "port-taken": (["--listen", f"127.0.0.1:{port}"], f"--listen 127.0.0.1:{port}: cannot bind"),
            "no-tokenizer-dir": (["--tokenizer", str(tmp_path / "nope")], "--tokenizer"),
            "not-a-tokenizer": (["--tokenizer", str(tmp_path)], "cannot load a tokenizer"),
            "bad-backend": (["--backend", "127.0.0.1:99999"], "--backend"),
        }[case]
        run = subprocess.run([sys.executable, "-m", "api_server", "--served-model-name", "m", *args], cwd=ROOT,
                             check=False, capture_output=True, text=True, timeout=240)
    assert run.returncode == 2, run.stderr
    assert words in run.stderr and "Traceback" not in run.stderr, run.stderr


def test_sigterm_stops_it_gracefully_with_exit_0(tmp_path):
    proc, _ = start_api(str(tmp_path / "api.log"), f"127.0.0.1:{free_port()}", ["--served-model-name", "m"],
                        ready=(503,))
    try:
        proc.terminate()
        assert proc.wait(timeout=60) == 0, (tmp_path / "api.log").read_text()
    finally:
        stop([proc])
