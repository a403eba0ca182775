"""Cases a mutation pass over the OpenAI front's core (api_server/: app.py, generation.py, backend.py, shutdown.py,
metrics.py) found untested: each test here failed on a one-line change of that code that the other tests (the
in-process ones of test_api_units.py, test_api_front_mutants.py, test_ending_mutants.py, test_lifecycle_mutants.py
and the real fronts' asserts of test_api_errors.py, test_api_openai.py) let through.

56 mutants: 28 caught by the in-process tests before, 6 more by the real fronts' (test_api_errors.py: the /health
503 of an unreachable decode server and its 200 of a serving one, the unknown model's 404, the 504 of
--request-timeout-s counted under its code, the code read from a message without one), 13 caught only here (the
TTFT and inter-token figures swapped among them: the real 504 test's counts still held), 8 equivalent, 1 left.
Equivalent: the hang-up watcher left running (uvicorn answers every read after the response with
http.disconnect, so it ends there); the Info failure passed on rather than left to Generate (the same channel's
error through the same from_rpc: same status and code); a prompt of exactly --max-message-bytes ids built
rather than not (over the limit either way: same 400, only the byte count worded); the start tasks left
uncancelled on a refusal (each already made its call, which is cancelled, and that ends it); the filled-in
max_tokens at least 0 rather than 1 (the only bound under 1 is a prompt longer than the slot, refused before any
call); a call cancelled once done (grpc.aio's cancel is then a no-op); header names compared without lower()
(ASGI's are lower case); the metrics port read back from the server (port 0 is "off" and never served). Left: a
chat chunk with no text carrying `"content": ""` rather than an empty delta (OpenAI's schema allows both; clients
append nothing either way).

Why in process, against a scripted decode server (support.apifront.FakeBackend) or the part itself: each case is
a figure of a chosen size (the milliseconds between two tokens, on a clock the test sets), a header as Starlette
really writes it (`text/event-stream; charset=utf-8`), a request cancelled at a chosen point (uvicorn's end of
--shutdown-grace-s) or an Info of a chosen shape; a real front would reach each only by a start of tens of seconds
and by timing, while here each runs in milliseconds, the same way every time.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from api_server import generation as generation_mod
from api_server.app import build_app
from api_server.config import ApiConfig
from api_server.generation import Generation, collect
from api_server.metrics import ApiMetrics, CountResponses
from api_server.shutdown import CutOffAtShutdown
from proto import kvtransfer_pb2 as pb
from api_server.text import TextCodec
from support.apifront import HANG, FakeBackend, asgi_post, sse_events
from support.textmodel import save_tokenizer

LENGTH = pb.FINISH_REASON_LENGTH
GUARD_S = 30  # an exchange not over after this long is a hang


@pytest.fixture(scope="module")
def codec(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    save_tokenizer(d)
    return TextCodec.load(str(d))


def _app(backend: FakeBackend, metrics: ApiMetrics | None = None, codec=None, **config):
    config = {"served_model_name": "m", **config}
    return build_app(ApiConfig(**config), backend, codec, metrics or ApiMetrics())


async def _get(app, path: str) -> tuple[int, dict]:
    """One GET over ASGI: (status, parsed JSON body)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": [],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    status, chunks = [0], []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        if message["type"] == "http.response.start":
            status[0] = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
    await asyncio.wait_for(app(scope, receive, send), GUARD_S)
    return status[0], json.loads(b"".join(chunks) or b"null")


# --- /v1/models (app.py) ---

def test_models_says_the_decode_server_s_slot_as_max_model_len():
    """max_model_len is the slot (Info.max_seq_len), not the longest prompt (kills max_prompt_tokens read in its
    place: a client sizing its prompt plus answer by it would be refused)."""
    info = pb.InfoResponse(model="fake", max_seq_len=128, max_prompt_tokens=100, max_new_tokens=64)
    status, body = asyncio.run(_get(_app(FakeBackend(lambda _r: [], info)), "/v1/models"))
    assert status == 200 and body["data"][0]["max_model_len"] == 128, body


def test_a_model_named_by_its_directory_is_the_directory_s_own_name():
    """Neither --served-model-name nor Info.model: the model is called by its directory's last part (kills the
    parent directory's name served instead)."""
    backend = FakeBackend(lambda _r: [], pb.InfoResponse(model=""))
    status, body = asyncio.run(_get(_app(backend, served_model_name="", model="/models/tiny-llama/"), "/v1/models"))
    assert status == 200 and body["data"][0]["id"] == "tiny-llama", body


def test_a_chat_stream_opens_with_the_assistant_s_role(codec):
    """The first chunk's delta names the role the client assembles the message under (kills it as `user`)."""
    backend = FakeBackend(lambda _r: [5, (6, LENGTH)])
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True}
    status, text = asyncio.run(asgi_post(_app(backend, codec=codec), "/v1/chat/completions", body, timeout=GUARD_S))
    events = sse_events(text)
    assert status == 200 and events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}, events
    assert events[-1] == "[DONE]"


def test_without_any_bound_from_the_decode_server_an_answer_may_run_256_tokens():
    """A decode server that says no limits (one from before Info's fields): max_tokens null is filled with the
    documented default (kills 256 changed: every such answer cut short, finish_reason `length`)."""
    backend = FakeBackend(lambda _r: [(5, LENGTH)], pb.InfoResponse(model="fake"))
    status, _ = asyncio.run(asgi_post(_app(backend), "/v1/completions", {"prompt": [1, 2], "max_tokens": None},
                                      timeout=GUARD_S))
    assert status == 200 and [c.request.max_new_tokens for c in backend.calls] == [256]


# --- the front's figures (generation.py, metrics.py) ---

def test_ttft_and_the_gaps_between_tokens_are_milliseconds_from_their_own_starts(monkeypatch):
    """On a clock the test sets: the first token 5 ms after the request came in, the next two 5 and 20 ms after
    their previous one (kills TTFT observed in seconds, the gaps measured from 0 rather than the last token, the
    gaps not observed, and TTFT and the gaps swapped)."""
    clock = iter([0.005, 0.010, 0.030])
    monkeypatch.setattr(generation_mod.time, "perf_counter", lambda: next(clock))
    metrics = ApiMetrics()
    backend = FakeBackend(lambda _r: [5, 6, (7, LENGTH)])
    gen = Generation(backend, pb.GenerateRequest(token_ids=[1, 2], max_new_tokens=3), None, [], metrics,
                     "/v1/completions", 0.0)

    async def run():
        await gen.start()
        return await collect(gen)
    assert asyncio.run(run()).token_ids == [5, 6, 7]
    value = metrics.registry.get_sample_value
    ttft = {"endpoint": "/v1/completions"}
    assert value("kvt_api_ttft_ms_count", ttft) == 1 and value("kvt_api_ttft_ms_sum", ttft) == pytest.approx(5)
    assert value("kvt_api_itl_ms_count") == 2 and value("kvt_api_itl_ms_sum") == pytest.approx(25)


def test_responses_are_counted_by_their_endpoint_and_code_other_paths_as_other():
    """Kills: the path taken as the label whatever it is (a scan of made-up paths grows the series without
    bound), /health dropped from the endpoints, and the code read from the wrong message."""
    metrics = ApiMetrics()
    app = CountResponses(_app(FakeBackend(lambda _r: []), metrics), metrics)
    assert asyncio.run(_get(app, "/health"))[0] == 200
    assert asyncio.run(_get(app, "/no/such/path-1"))[0] == 404
    value = metrics.registry.get_sample_value
    assert value("kvt_api_requests_total", {"endpoint": "/health", "code": "200"}) == 1
    assert value("kvt_api_requests_total", {"endpoint": "other", "code": "404"}) == 1
    assert value("kvt_api_requests_total", {"endpoint": "/no/such/path-1", "code": "404"}) is None


# --- a request cut off (app.py's watcher, shutdown.py) ---

async def _cut_off(app, body: dict, until) -> tuple[asyncio.Task, list]:
    """Start a POST to `app`; once `until(sent messages)` holds, cancel it as uvicorn does at the grace's end."""
    data = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    asked, sent, never = [], [], asyncio.Event()

    async def receive():
        if not asked:
            asked.append(1)
            return {"type": "http.request", "body": data, "more_body": False}
        await never.wait()  # the client stays

    async def send(message):
        sent.append(message)
    task = asyncio.ensure_future(app(scope, receive, send))
    for _ in range(1000):  # steps of the loop, not time
        if until(sent):
            break
        await asyncio.sleep(0)
    task.cancel()
    try:
        await asyncio.wait_for(task, GUARD_S)
    except asyncio.CancelledError:
        pass
    return task, sent


def test_a_request_cancelled_in_prefill_cancels_its_generate_call():
    """uvicorn cancels the handler at the end of --shutdown-grace-s: its Generate call must go too, so the decode
    server frees its KV slot (kills `task.cancel()` dropped from _unless_gone's except: the work ran on)."""
    backend = FakeBackend(lambda _r: [HANG])

    async def run():
        await _cut_off(_app(backend), {"prompt": [1, 2], "max_tokens": 8}, lambda _sent: backend.calls)
        for _ in range(20):  # the cancelled work's own clean-up: steps of the loop
            await asyncio.sleep(0)
        return [c.cancelled for c in backend.calls]
    assert asyncio.run(run()) == [True]


def test_a_real_stream_cut_off_at_shutdown_ends_with_an_error_event_and_done():
    """Starlette writes `text/event-stream; charset=utf-8`: a stream under way must still be told it was cut off
    (kills the content type compared whole, which left it cut mid-token, no error event, no [DONE])."""
    backend = FakeBackend(lambda _r: [5, HANG])
    stopping = asyncio.Event()
    stopping.set()

    async def run():
        app = CutOffAtShutdown(_app(backend), stopping)
        return await _cut_off(app, {"prompt": [1, 2], "max_tokens": 8, "stream": True},
                              lambda sent: any(m.get("body", b"").startswith(b"data: {") for m in sent))
    _task, sent = asyncio.run(run())
    assert sent[0]["status"] == 200
    events = sse_events(b"".join(m.get("body", b"") for m in sent[1:]).decode())
    assert events[0]["choices"][0]["token_ids"] == [5], events
    assert events[-2]["error"]["code"] == "shutting_down" and events[-1] == "[DONE]", events


# --- the channel's calls (backend.py) ---

def test_the_front_s_deadlines_reach_generate_and_the_health_check():
    """Kills: --request-timeout-s not passed to Generate (a decode server that stalls holds the request and its
    client forever) and --health-timeout-s not passed to Check (a decode server that accepts but never answers
    hangs every load balancer's probe of /health)."""
    from types import SimpleNamespace

    from grpc_health.v1 import health_pb2

    from api_server.backend import Backend
    asked = {}

    class Stub:
        def Generate(self, request, timeout=None, metadata=None):
            asked["generate"] = timeout

        async def Check(self, request, timeout=None):
            asked["check"] = timeout
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    b = Backend("127.0.0.1:1", SimpleNamespace(metadata=lambda: ()), 1 << 20, 10.0, 60.0)
    b._decode = b._health = Stub()
    b.generate(pb.GenerateRequest(token_ids=[1], max_new_tokens=1))
    assert asyncio.run(b.serving(2.5)) is True
    assert asked == {"generate": 60.0, "check": 2.5}
