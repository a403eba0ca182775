"""SIGTERM on the OpenAI front while requests run: what its --shutdown-grace-s leaves running is answered in OpenAI's
shape (api_server/shutdown.py), and the front exits 0. Real processes: a colocated `tiny` decode server making
long answers, and the front.

Why: at the grace's end uvicorn cancels what still runs. Before, a non-streaming request then got a text/plain
`500 Internal Server Error` and a stream stopped mid-token with neither an error event nor [DONE] (a new-user
pass). Ordering, not timing: both requests are seen running on the decode server before the signal, and their
answers (4,000 tokens each) cannot finish within the 1 s grace.
"""

from __future__ import annotations

import http.client
import json
import threading
import time

import grpc

from bench.measure.launch import stop
from proto import kvtransfer_pb2 as pb
from proto import kvtransfer_pb2_grpc as pbg
from support.apifront import sse_events, start_api
from support.servers import colocated_server

LONG = {"prompt": [1, 2, 3], "max_tokens": 4000, "ignore_eos": True}


def _post(addr: str, body: dict, out: dict, key: str) -> None:
    host, port = addr.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        out[key] = (resp.status, resp.getheader("content-type", ""), resp.read().decode())
    except OSError as e:
        out[key] = ("error", "", repr(e))
    finally:
        conn.close()


def test_requests_still_running_when_the_grace_ends_get_openai_errors_and_it_exits_0(tmp_path):
    with colocated_server(tmp_path / "decode") as decode:
        log = tmp_path / "api.log"
        proc, url = start_api(str(log), decode.addr, ["--served-model-name", "m", "--shutdown-grace-s", "1"],
                              ready=(200,))
        addr = url.removeprefix("http://")
        try:
            deadline = time.monotonic() + 240
            got: dict = {}
            threads = [threading.Thread(target=_post, args=(addr, LONG, got, "whole")),
                       threading.Thread(target=_post, args=(addr, {**LONG, "stream": True}, got, "stream"))]
            for t in threads:
                t.start()
            with grpc.insecure_channel(decode.addr) as ch:
                stub = pbg.DecodeStub(ch)
                while stub.Load(pb.LoadRequest(), timeout=10).running_requests < 2:
                    assert time.monotonic() < deadline and not got, (got, log.read_text())
                    time.sleep(0.05)
            proc.terminate()
            assert proc.wait(timeout=60) == 0, log.read_text()
            for t in threads:
                t.join(60)
        finally:
            stop([proc])
    status, ctype, text = got["whole"]
    assert status == 503 and ctype.startswith("application/json"), got["whole"]
    err = json.loads(text)["error"]
    assert err["code"] == "shutting_down" and "--shutdown-grace-s" in err["message"], err
    status, ctype, text = got["stream"]
    assert status == 200 and ctype.startswith("text/event-stream"), got["stream"][:2]
    events = sse_events(text)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "shutting_down", events[-3:]
    assert any("choices" in e for e in events[:-2]), "the stream was under way before the signal"
