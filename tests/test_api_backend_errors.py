"""Failures on the gRPC side of the OpenAI front that no retry fixes, or that gRPC words badly, as HTTP clients
see them: a prompt over a gRPC message limit (the front's or the decode server's) and a decode server lost in the
middle of an answer.

Why real processes: both come from the channel itself (grpc's own size check on either side, a socket that
closes), which a scripted backend would only imitate. The decode server here takes small messages
(--max-message-bytes 20000), so a prompt over its limit is a 60 KB body; the fronts have no tokenizer, so they
start in seconds.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import grpc
import pytest

from proto import kvtransfer_pb2 as pb
from proto import kvtransfer_pb2_grpc as pbg
from api_server.errors import from_rpc
from support.apifront import api_front, request, rpc_error
from support.servers import colocated_server

SHAPE = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def decode(tmp_path_factory):
    args = ["--max-prompt-tokens", "1000", "--max-message-bytes", "20000"]
    with colocated_server(tmp_path_factory.mktemp("decode"), args=args) as d:
        yield d


def _front(decode_addr: str, logs, *args):
    return api_front(str(logs / "api.log"), decode_addr, ["--served-model-name", "m", *args], ready=(200,))


def refused(got, status: int, code: str, *words: str) -> dict:
    got_status, body = got
    assert got_status == status, body
    assert isinstance(body, dict) and set(body) == {"error"} and set(body["error"]) == SHAPE, body
    err = body["error"]
    assert err["code"] == code, err
    for w in words:
        assert w in err["message"], err
    return err


def _complete(url: str, body: dict):
    return request("POST", f"{url}/v1/completions", body)


def test_a_prompt_over_a_limit_the_front_knows_is_400_naming_it(decode, tmp_path):
    """Before: gRPC refused to send either ("CLIENT: Sent message larger than max"): RESOURCE_EXHAUSTED, a 429
    that every retry gets again. Now the decode server's --max-prompt-tokens (its Info) and this front's
    --max-message-bytes are checked before the call."""
    with _front(decode.addr, tmp_path, "--max-message-bytes", "2000") as url:
        for prompt, words in (([5] * 70_000, ("70000 tokens", "at most 1000 prompt tokens (its --max-prompt-tokens)")),
                              ([300] * 1000, ("1000 tokens", "2000 bytes (--max-message-bytes)"))):  # 2 bytes an id
            err = refused(_complete(url, {"prompt": prompt, "max_tokens": 2}), 400, "prompt_too_large", *words)
            assert err["param"] == "prompt" and err["type"] == "invalid_request_error", err
        status, body = _complete(url, {"prompt": [1, 2], "max_tokens": 2})
        assert status == 200, body


def test_a_request_over_the_decode_servers_message_limit_is_400(decode, tmp_path):
    """Within this front's limit (4 MiB) but not the decode server's (20000 bytes): it refuses the message on
    arrival, RESOURCE_EXHAUSTED, which is no 429 either (a prompt within its --max-prompt-tokens always fits its
    messages, so a long stop_token_ids list makes it too large here)."""
    with _front(decode.addr, tmp_path) as url:
        refused(_complete(url, {"prompt": [1, 2], "max_tokens": 2, "stop_token_ids": [3] * 20_000}), 400,
                "prompt_too_large", f"decode server at {decode.addr} (its --max-message-bytes)",
                "Received message larger than max")
        status, body = _complete(url, {"prompt": [1, 2], "max_tokens": 2})
        assert status == 200, body


@pytest.mark.parametrize("details,side", [("CLIENT: Sent message larger than max (9 vs. 8)", "this front's"),
                                          ("SERVER: Received message larger than max (9 vs. 8)", "decode server")])
def test_grpcs_message_size_refusal_is_400_whichever_side_said_it(details, side):
    """The front's own check comes first, so its side is reached only if that check misses (a request that grew
    past it); the status alone would be a 429."""
    err = from_rpc(rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, details), "decode:1")
    assert (err.status, err.code) == (400, "prompt_too_large") and side in err.message and details in err.message
    other = from_rpc(rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "2 requests in flight"), "decode:1")
    assert (other.status, other.code) == (429, "RESOURCE_EXHAUSTED")  # a full server is still worth a retry


def test_a_decode_server_lost_mid_answer_is_a_clean_error_streaming_or_not(tmp_path):
    """Before: the client read gRPC's transport text, "Stream removed (Socket closed)", code UNAVAILABLE."""
    with colocated_server(tmp_path / "decode") as decode, _front(decode.addr, tmp_path) as url:
        long = {"prompt": [1, 2, 3], "max_tokens": 4000, "ignore_eos": True}
        stream = urllib.request.urlopen(urllib.request.Request(
            f"{url}/v1/completions", data=json.dumps({**long, "stream": True}).encode(), method="POST",
            headers={"Content-Type": "application/json"}), timeout=120)
        assert stream.readline().startswith(b"data: {")  # generating
        whole = []
        worker = threading.Thread(target=lambda: whole.append(_complete(url, long)))
        worker.start()
        try:
            _wait_running(decode.addr, 2)
        finally:
            decode.procs[0].kill()
            worker.join(120)
        events = [json.loads(line[6:]) for line in stream.read().decode().split("\n\n") if
                  line.startswith("data: {")]
        assert stream.status == 200 and "error" in events[-1], events[-3:]
        for err in (events[-1]["error"], refused(whole[0], 503, "backend_connection_lost")):
            assert err["code"] == "backend_connection_lost" and err["type"] == "server_error", err
            assert err["message"].startswith("the decode worker's stream ended after "), err
            assert f"the connection to the decode server at {decode.addr} was lost" in err["message"], err


def _wait_running(addr: str, n: int) -> None:
    """Until the decode server reports `n` requests decoding (its Load), so both are mid-answer."""
    deadline = time.monotonic() + 60
    with grpc.insecure_channel(addr) as channel:
        stub = pbg.DecodeStub(channel)
        while stub.Load(pb.LoadRequest(), timeout=10).running_requests < n:
            assert time.monotonic() < deadline, "the two requests never both ran"
            time.sleep(0.1)
