"""Cases a mutation pass over the OpenAI front's request handling (api_server/: params.py, protocol.py, stops.py,
text.py, prompts.py, auth.py, limits.py, errors.py, streams.py) found untested: each test here failed on a one-line
change of that code that the other tests (the in-process ones and the real fronts of test_api_errors.py,
test_api_inputs.py, test_api_openai.py, test_api_slow_clients.py) let through. How a request ends was covered by
test_ending_mutants.py, the slow-client guards and the body limit's bound by test_cap_and_front_mutants.py.

Why in process, against a scripted decode server (support.apifront.FakeBackend) or the function itself: each case
is a value at a bound (a seed one under int64, a token id of 0, max_tokens one over uint32, a body exactly at a
message limit), a header a real client rarely sends (`bearer` in lower case, a token with a suffix), or a decode
server's answer of a chosen shape (two prompts, one failing mid-answer); a real front would reach each only by a
start of tens of seconds, while here each runs in milliseconds, the same way every time.
"""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from api_server.app import build_app
from api_server.config import ApiConfig
from api_server.errors import ApiError, from_rpc
from api_server.metrics import ApiMetrics
from api_server.params import INT64_MAX, UINT32_MAX, params
from api_server.protocol import ChatCompletionRequest, CompletionRequest
from api_server.text import TextCodec
from proto import kvtransfer_pb2 as pb
from support.apifront import HANG, FakeBackend, asgi_post, rpc_error, sse_events
from support.textmodel import save_tokenizer

LENGTH = pb.FINISH_REASON_LENGTH
GUARD_S = 30  # an exchange not over after this long is a hang
CHAT_PATH = "/v1/chat/completions"
CHAT = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def codec(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    save_tokenizer(d)
    return TextCodec.load(str(d))


def _app(backend: FakeBackend, codec=None, **config):
    return build_app(ApiConfig(served_model_name="m", **config), backend, codec, ApiMetrics())


def _post(app, body: dict, path: str = "/v1/completions") -> tuple[int, str]:
    return asyncio.run(asgi_post(app, path, body, timeout=GUARD_S))


def _error(app, body: dict, path: str = "/v1/completions") -> tuple[int, dict]:
    status, text = _post(app, body, path)
    return status, json.loads(text)["error"]


def _refused(req) -> ApiError:
    with pytest.raises(ApiError) as e:
        params(req)
    assert e.value.status == 400
    return e.value


def _chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=CHAT, **kw)


# --- what a request may ask (api_server/params.py) ---


@pytest.mark.parametrize("field,value", [("n", 0), ("n", -1), ("frequency_penalty", 0.5)])
def test_n_below_1_and_a_frequency_penalty_are_refused_by_name(field, value):
    """n=0 asks for no choice at all, and a frequency penalty changes the answer: neither may be served as a plain
    answer (kills `n > 1` for `n not in (None, 1)`, and frequency_penalty dropped from the penalties checked)."""
    assert _refused(CompletionRequest(prompt=[1], **{field: value})).param == field


def test_function_call_is_refused_but_none_of_tool_choice_and_function_call_is_served():
    """docs/api.md: tool_choice / function_call are refused "other than none" (kills function_call dropped from the
    check, and "none" refused with the rest)."""
    assert _refused(_chat(function_call="auto")).param == "function_call"
    assert _refused(_chat(function_call={"name": "f"})).param == "function_call"
    params(_chat(tool_choice="none", function_call="none"))


def test_a_response_format_without_a_type_is_plain_text():
    """A response_format naming no type is the default, plain text (kills the type required: it was refused as a
    format this server does not produce)."""
    params(_chat(response_format={"strict": False}))


@pytest.mark.parametrize("field,value", [("max_tokens", UINT32_MAX + 1), ("top_k", UINT32_MAX + 1),
                                         ("seed", -(1 << 63) - 1), ("stop_token_ids", [INT64_MAX + 1])])
def test_values_past_the_proto_s_integer_ranges_are_400_naming_the_field(field, value):
    """A value protobuf cannot hold would fail as a ValueError inside the GenerateRequest (a 500 naming nothing);
    a seed under int64 must not wrap to another seed silently (kills each field's bound dropped)."""
    p = None
    with pytest.raises(ApiError) as e:
        p = params(CompletionRequest(prompt=[1], **{field: value}))
        p.request([1], p.max_tokens or 1, [])  # where the unchecked value would fail
    assert (e.value.status, e.value.param) == (400, field), p


def test_the_edges_of_each_range_are_served():
    """temperature 0 (greedy), top_p 1, the int64 minimum seed, token id 0 and the bounds themselves are valid
    (kills `<= 0`, `< 1`, and `low < t` for the inclusive ends)."""
    p = params(CompletionRequest(prompt=[1], temperature=0.0, top_p=1.0, top_k=UINT32_MAX, seed=-(1 << 63),
                                 stop_token_ids=[0, INT64_MAX], max_tokens=UINT32_MAX))
    r = p.request([1], p.max_tokens, [])
    assert (r.sampling.temperature, r.sampling.top_p, r.sampling.top_k, r.sampling.seed) == (0.0, 1.0, UINT32_MAX,
                                                                                              1 << 63)
    assert list(r.stop_token_ids) == [0, INT64_MAX] and r.max_new_tokens == UINT32_MAX


def test_an_eos_the_client_listed_is_asked_once():
    """The client's stop_token_ids already hold the tokenizer's EOS: the decode server is asked for it once (kills
    the EOS appended whether or not listed)."""
    r = params(CompletionRequest(prompt=[1], stop_token_ids=[3, 9])).request([1], 4, [3])
    assert list(r.stop_token_ids) == [3, 9]


# --- what the front answers (api_server/protocol.py, streams.py) ---


async def _exchange(app, path: str, body: bytes | list[bytes], headers=(), method: str = "POST",
                    read_past_body: bool = True):
    """One ASGI exchange: `body` sent as it is (a list: in that many messages, the last with more_body false);
    (status, response headers, body text, the body messages the app never read). `read_past_body` False: a read
    after the body's last message, before the response ended, fails the exchange."""
    pieces = list(body) if isinstance(body, list) else [body]
    left = [{"type": "http.request", "body": p, "more_body": i + 1 < len(pieces)} for i, p in enumerate(pieces)]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [*headers] if any(k == b"content-type" for k, _ in headers) else
             [(b"content-type", b"application/json"), *headers],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    start, chunks, done = {}, [], asyncio.Event()

    async def receive():
        if left:
            return left.pop(0)
        assert read_past_body or done.is_set(), "the app read past the body's end before its answer was sent"
        await done.wait()  # the client waits for its answer, then hangs up
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            start.update(message)
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                done.set()

    await asyncio.wait_for(app(scope, receive, send), GUARD_S)
    return start["status"], dict(start.get("headers", [])), b"".join(chunks).decode(), left


def test_a_stream_is_served_as_server_sent_events():
    """OpenAI clients read a stream by its content type (kills the StreamingResponse's media type changed)."""
    backend = FakeBackend(lambda _req: [5, (6, LENGTH)])
    body = json.dumps({"prompt": [1, 2], "max_tokens": 2, "stream": True}).encode()
    status, headers, text, _ = asyncio.run(_exchange(_app(backend), "/v1/completions", body))
    assert status == 200 and headers[b"content-type"].startswith(b"text/event-stream"), headers
    assert sse_events(text)[-1] == "[DONE]"


def test_the_answers_have_openai_s_fields(codec):
    """A completion choice carries `logprobs` (null here) as OpenAI's does, and a chat answer is the assistant's
    (kills the field dropped and the role changed: the openai client accepts either)."""
    backend = FakeBackend(lambda _req: [5, (6, LENGTH)])
    status, text = _post(_app(backend), {"prompt": [1, 2], "max_tokens": 2})
    choice = json.loads(text)["choices"][0]
    assert status == 200 and "logprobs" in choice and choice["logprobs"] is None, choice
    status, text = _post(_app(backend, codec), {"messages": CHAT, "max_tokens": 2}, CHAT_PATH)
    assert status == 200 and json.loads(text)["choices"][0]["message"]["role"] == "assistant", text


def test_a_chat_stream_whose_client_leaves_at_its_first_chunk_cancels_the_call(codec):
    """The client is gone when the role chunk is sent (uvicorn's send raises OSError, ASGI 2.4): no piece was read
    yet, so only the stream's own clean-up can cancel the Generate call (kills sse_response's cancel: the decode
    server ran the answer to max_tokens for nobody)."""
    from starlette.requests import ClientDisconnect
    backend = FakeBackend(lambda _req: [5, HANG])
    app = _app(backend, codec)
    data = json.dumps({"messages": CHAT, "max_tokens": 50, "stream": True}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": CHAT_PATH, "raw_path": CHAT_PATH.encode(),
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]}
    asked, gone = [], asyncio.Event()

    async def receive():
        if not asked:
            asked.append(1)
            return {"type": "http.request", "body": data, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.body":
            gone.set()
            raise OSError("the client hung up")

    async def exchange():
        with pytest.raises(ClientDisconnect):
            await asyncio.wait_for(app(scope, receive, send), GUARD_S)
    asyncio.run(exchange())  # its end closes the stream's generator, as the loop would once it is dropped
    assert [c.cancelled for c in backend.calls] == [True]


def test_usage_of_several_prompts_counts_every_prompt():
    """prompt_tokens is the sum over the request's prompts, as its completion_tokens is (kills the first prompt's
    count taken for all of them)."""
    backend = FakeBackend(lambda _req: [5, (6, LENGTH)])
    status, text = _post(_app(backend), {"prompt": [[1, 2], [3, 4, 5]], "max_tokens": 2})
    assert status == 200 and json.loads(text)["usage"] == {"prompt_tokens": 5, "completion_tokens": 4,
                                                          "total_tokens": 9}, text


def test_one_prompt_failing_mid_answer_cancels_the_others_whole_answer():
    """Two prompts, not streamed: prompt 0's decode server stream fails after a token while prompt 1's goes on; the
    request fails and prompt 1's call is cancelled, its KV slot freed (kills collect_all's cancel: the other call
    ran on, unread, to its max_tokens)."""
    backend = FakeBackend(lambda req: [5, rpc_error(grpc.StatusCode.UNAVAILABLE, "the decode server is stopping")]
                          if list(req.token_ids) == [1, 2] else [7, HANG])

    async def exchange():
        got = await asgi_post(_app(backend), "/v1/completions", {"prompt": [[1, 2], [3, 4]], "max_tokens": 8},
                              timeout=GUARD_S)
        return got, backend.calls[1].cancelled  # looked at now: the end of asyncio.run cancels what is left
    (status, text), cancelled = asyncio.run(exchange())
    assert status == 503 and "stopping" in json.loads(text)["error"]["message"], text
    assert cancelled


# --- prompts and chat messages (api_server/prompts.py, text.py, protocol.py) ---


def test_a_negative_token_id_is_the_decode_server_s_to_refuse_with_a_tokenizer_too(codec):
    """A prompt id under 0 fits the proto; the decode server refuses it in words naming its vocabulary's range, and
    the detokenizer made beforehand must not fail on it (kills the front refusing ids under 0 itself, and the
    detokenizer seeded with ids outside the tokenizer: decoding -1 raised, a 500)."""
    backend = FakeBackend(lambda _req: [rpc_error(grpc.StatusCode.INVALID_ARGUMENT,
                                                  "token id -1 is outside the vocabulary [0, 512)")])
    status, err = _error(_app(backend, codec), {"prompt": [5, -1], "max_tokens": 2})
    assert (status, err["code"]) == (400, "INVALID_ARGUMENT") and "vocabulary" in err["message"], err
    assert list(backend.calls[0].request.token_ids) == [5, -1]


def test_a_completion_prompt_s_text_starts_with_the_tokenizer_s_bos(codec):
    """`tokenizer(text)` adds the special tokens a model was trained with; a chat template places its own (kills
    the completion prompt encoded without them)."""
    assert codec.encode("Hello")[0] == codec.tok.bos_token_id
    assert codec.chat(CHAT).count(codec.tok.bos_token_id) == 1


def test_the_tokenizer_s_eos_is_a_stop_token_of_every_request_unless_ignore_eos(codec):
    """The front lists the tokenizer's EOS (a chat template's end of turn, which need not be the model config's EOS
    the decode server stops on by itself) in stop_token_ids (kills the codec's EOS left empty: the real servers'
    tests passed, their model's EOS being the tokenizer's)."""
    backend = FakeBackend(lambda _req: [(5, LENGTH)])
    app = _app(backend, codec)
    for body, path in (({"prompt": "Hi", "max_tokens": 1}, "/v1/completions"),
                       ({"messages": CHAT, "max_tokens": 1}, CHAT_PATH),
                       ({"prompt": "Hi", "max_tokens": 1, "ignore_eos": True}, "/v1/completions")):
        assert _post(app, body, path)[0] == 200
    eos = codec.tok.eos_token_id
    assert [list(c.request.stop_token_ids) for c in backend.calls] == [[eos], [eos], []]


def test_a_chat_message_s_other_fields_reach_the_template():
    """A message's `name` (and any field no declaration names) goes to the chat template as given (kills the extra
    fields dropped: a template that names the speaker lost it)."""
    from api_server.prompts import chat_messages
    got = chat_messages(ChatCompletionRequest(messages=[{"role": "user", "content": "x", "name": "ann",
                                                         "tool_call_id": "c1"}]))
    assert got == [{"role": "user", "content": "x", "name": "ann", "tool_call_id": "c1"}]


def test_a_tokenizer_without_a_chat_template_is_400_naming_messages(tmp_path):
    """The tokenizer loads, but has no template: chat is the client's to move to /v1/completions (kills the
    template's ValueError left unanswered: a 500)."""
    fast = save_tokenizer(tmp_path)
    fast.chat_template = None
    bare = TextCodec(fast, str(tmp_path))
    status, err = _error(_app(FakeBackend(lambda _req: [(5, LENGTH)]), bare), {"messages": CHAT}, CHAT_PATH)
    assert (status, err["param"]) == (400, "messages") and "no chat template" in err["message"], err


# --- the bearer token (api_server/auth.py) ---

TOKEN = "s3cret"


def _authorized(path: str, authorization: bytes | None) -> int:
    """The status the front behind RequireToken answers a GET of `path` with this Authorization header."""
    from api_server.auth import RequireToken
    app = RequireToken(_app(FakeBackend(lambda _req: [])), TOKEN)
    headers = [] if authorization is None else [(b"authorization", authorization)]
    return asyncio.run(_exchange(app, path, b"", headers, method="GET"))[0]


def test_the_bearer_scheme_is_any_case_and_the_token_must_match_whole():
    """RFC 7235: the scheme is case-insensitive (kills `Bearer` alone accepted); the token is compared whole
    (kills a token that merely starts with the secret accepted)."""
    assert _authorized("/v1/models", b"bearer " + TOKEN.encode()) == 200
    assert _authorized("/v1/models", b"BEARER " + TOKEN.encode()) == 200
    assert _authorized("/v1/models", b"Bearer " + TOKEN.encode() + b"x") == 401
    assert _authorized("/v1/models", b"Bearer " + TOKEN.encode()[:-1]) == 401


def test_only_health_itself_is_open():
    """/health needs no token, a path that merely starts with it does (kills the open path matched as a prefix:
    /healthz, /health/... then passed unchecked)."""
    assert _authorized("/health", None) == 200
    assert _authorized("/healthz", None) == 401
    assert _authorized("/health/x", None) == 401


# --- the front's limits (api_server/limits.py) ---


def test_as_many_prompts_as_the_limit_are_served():
    """--max-prompts-per-request is the most a body may hold, inclusive (kills `>=` for `>`)."""
    backend = FakeBackend(lambda _req: [(5, LENGTH)])
    app = _app(backend, max_prompts_per_request=3)
    assert _post(app, {"prompt": [[1], [2], [3]], "max_tokens": 1})[0] == 200
    status, err = _error(app, {"prompt": [[1], [2], [3], [4]], "max_tokens": 1})
    assert (status, err["code"]) == (400, "too_many_prompts"), err


def test_a_request_of_exactly_the_message_limit_is_sent():
    """--max-message-bytes is the largest request that may go, inclusive, as gRPC's own limit is (kills `>=`)."""
    from api_server.limits import check_message_size
    check_message_size(10, 100, 100, "prompt")
    with pytest.raises(ApiError) as refused:
        check_message_size(10, 101, 100, "prompt")
    assert refused.value.code == "prompt_too_large"


@pytest.mark.parametrize("length", [True, False], ids=["content-length", "chunked"])
def test_a_refused_body_s_rest_is_read_before_the_413_ends_and_no_further(length):
    """A body over --max-body-bytes, with a Content-Length or without: what the client still sends is read (and
    dropped) before the response ends, so that a client that writes its whole body before it reads gets the 413
    rather than a reset; and nothing past the body's end is waited for (kills the linger skipped on either path,
    and the linger reading on past the body's last message until LINGER_S or a hang-up)."""
    backend = FakeBackend(lambda _req: [])
    pieces = [b'{"prompt": [1, 1, 1, 1, 1, 1, 1', b", 1, 1, 1, 1, 1, 1, 1, 1, 1", b', 1], "max_tokens": 1}']
    headers = [(b"content-length", str(len(b"".join(pieces))).encode())] if length else []
    status, _, text, unread = asyncio.run(_exchange(_app(backend, max_body_bytes=40), "/v1/completions", pieces,
                                                    headers, read_past_body=False))
    assert status == 413 and json.loads(text)["error"]["code"] == "request_too_large", text
    assert unread == [] and backend.calls == []


# --- errors and stop strings (api_server/errors.py, stops.py) ---


def test_a_transport_failure_gRPC_reports_as_internal_mid_answer_is_a_lost_connection():
    """gRPC core reports a stream it lost as UNAVAILABLE, UNKNOWN or INTERNAL ("Stream removed"); after the first
    token each is a lost connection, 503 worth a retry, not a 500 (kills INTERNAL left out)."""
    e = from_rpc(rpc_error(grpc.StatusCode.INTERNAL, "Stream removed"), "decode:1", tokens=3)
    assert (e.status, e.code) == (503, "backend_connection_lost") and "after 3 tokens" in e.message, e.message


def test_a_prompt_of_no_accepted_form_is_said_once_naming_the_forms():
    """A value none of a field's types takes (a number for `prompt`) is told as one line naming the forms tried,
    not the first type's complaint alone (kills the union's errors reported as the first)."""
    status, err = _error(_app(FakeBackend(lambda _req: [])), {"prompt": 5})
    assert (status, err["param"]) == (400, "prompt") and "not any of the accepted forms" in err["message"], err


def test_a_stop_matcher_sends_nothing_after_its_match_and_flushes_held_text_once():
    """Once a stop string matched, every later piece is dropped; text held back as a possible stop string is given
    once by flush (kills the match not remembered, and flush keeping what it gave)."""
    from api_server.stops import StopMatcher
    m = StopMatcher(["END"])
    assert m.feed("abEN") == ("ab", False)
    assert (m.flush(), m.flush()) == ("EN", "")
    assert m.feed("D more") == ("D more", False)  # "EN" was flushed: no match across it
    assert m.feed("xEND after") == ("x", True)
    assert m.feed("more text") == ("", True)


@pytest.mark.parametrize("content_type", [b"text/plain", b"application/x-www-form-urlencoded"])
def test_a_json_body_under_another_content_type_is_told_to_send_that_header(content_type):
    """`curl -d '{...}'` without `-H 'Content-Type: application/json'` sends a form type: FastAPI never parses the
    body, and the 400 said "Input should be a valid dictionary or object ... (send a JSON object)" of a JSON
    object. Now it names the header (a new user's pass)."""
    body = json.dumps({"prompt": [1, 2], "max_tokens": 2}).encode()
    app = _app(FakeBackend(lambda _req: [5, (6, LENGTH)]))
    status, _, text, _ = asyncio.run(_exchange(app, "/v1/completions", body, [(b"content-type", content_type)]))
    err = json.loads(text)["error"]
    assert status == 400 and "Content-Type: application/json" in err["message"], err
    assert content_type.decode() in err["message"], err
