"""The OpenAI front's pieces that need no server: stop strings, incremental detokenization, the error table, the
request checks, and the app itself in-process against a scripted decode server.

Why apart from the server tests: each of these has edge cases (a stop string split over three pieces, a
character split over three tokens, a seed over 64 bits, a decode server that fails at the second token or never
answers, a client that hangs up mid-prefill) that are cheap to state here and costly to reach through a model
with random weights.
"""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest

from api_server.app import build_app
from api_server.config import ApiConfig
from api_server.errors import HTTP_OF_GRPC, ApiError, from_rpc
from api_server.generation import Generation, collect
from api_server.metrics import ApiMetrics
from api_server.params import params
from api_server.protocol import ChatCompletionRequest, CompletionRequest
from api_server.stops import StopMatcher
from api_server.text import Detokenizer, TextCodec
from proto import kvtransfer_pb2 as pb
from support.apifront import HANG, FakeBackend, asgi_post, rpc_error, sse_events
from support.textmodel import save_tokenizer

MULTI = "é漢字🙂"


@pytest.fixture(scope="module")
def codec(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    save_tokenizer(d)
    return TextCodec.load(str(d))


def _stream(matcher: StopMatcher, pieces: list[str]) -> tuple[list[str], bool]:
    sent, stopped = [], False
    for p in pieces:
        out, stopped = matcher.feed(p)
        sent.append(out)
        if stopped:
            break
    if not stopped:
        sent.append(matcher.flush())
    return sent, stopped


def test_a_stop_string_split_over_pieces_is_cut_and_never_sent():
    sent, stopped = _stream(StopMatcher(["\nUser:"]), ["Hello", " there\n", "Us", "er: more"])
    assert stopped and "".join(sent) == "Hello there"
    assert all("\n" not in s for s in sent)  # the "\n" that began the match was held back, never sent


def test_a_partial_match_that_does_not_complete_is_sent_later():
    sent, stopped = _stream(StopMatcher(["abc"]), ["xa", "b", "d", "e"])
    assert not stopped and "".join(sent) == "xabde"
    assert sent[:2] == ["x", ""]  # "a", then "ab", held while they could still begin "abc"


def test_the_earliest_of_several_stops_wins():
    sent, stopped = _stream(StopMatcher(["world", "lo w"]), ["hello world"])
    assert stopped and "".join(sent) == "hel"


def test_no_stops_pass_everything_at_once():
    assert StopMatcher([]).feed("abc") == ("abc", False)
    assert StopMatcher([""]).feed("abc") == ("abc", False)  # an empty stop string stops nothing


def test_multibyte_characters_split_across_tokens_stream_whole(codec):
    ids = codec.tok(MULTI + " Café", add_special_tokens=False)["input_ids"]
    assert len(ids) > len(MULTI + " Café")  # the byte-level BPE split some characters over several tokens
    detok = codec.detokenizer([codec.tok.bos_token_id])
    pieces = [detok.step(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == MULTI + " Café"
    assert "\ufffd" not in "".join(pieces) and "" in pieces  # held back, not sent as replacement characters
    assert codec.decode(ids) == MULTI + " Café"


def test_an_unfinished_character_at_the_end_is_flushed_as_a_one_shot_decode_would(codec):
    ids = codec.tok("漢", add_special_tokens=False)["input_ids"]
    assert len(ids) > 1
    detok = codec.detokenizer([])
    streamed = "".join(detok.step(i) for i in ids[:-1]) + detok.flush()
    assert streamed == codec.decode(ids[:-1]) and "\ufffd" in streamed


def _words(codec, text: str) -> list[int]:
    return codec.tok(text, add_special_tokens=False)["input_ids"]


def test_a_prompt_ending_inside_a_character_is_not_repeated_in_the_answer(codec):
    """A token-id prompt may stop inside a character: the answer's first token completes it. That character is
    the answer's, and no prompt text comes back with it."""
    ids = _words(codec, "hello 漢")
    assert codec.decode(ids[-1:]) == "\ufffd"  # the last token is one byte of 漢
    detok = codec.detokenizer(codec.encode("hello 漢")[:-1])
    pieces = [detok.step(t) for t in [ids[-1], *_words(codec, " world")]] + [detok.flush()]
    assert "".join(pieces) == "漢 world"


def test_held_text_is_flushed_after_a_prompt_ending_inside_a_character(codec):
    ids = _words(codec, "hello 漢")
    detok = codec.detokenizer(codec.encode("hello 漢")[:-2])
    assert detok.step(ids[-2]) == ""  # still inside the character
    assert detok.flush() == "\ufffd" == codec.decode(ids[-2:-1])  # as a one-shot decode of the answer says


def test_ids_past_the_tokenizer_and_special_tokens_decode_to_nothing(codec):
    detok = codec.detokenizer([])
    assert detok.step(codec.size + 5) == "" and detok.step(-1) == ""
    assert detok.step(codec.tok.eos_token_id) == ""
    ids = codec.tok("Hello", add_special_tokens=False)["input_ids"]
    assert "".join(detok.step(i) for i in ids) + detok.flush() == "Hello"


def test_the_chat_template_opens_the_assistant_turn(codec):
    ids = codec.chat([{"role": "user", "content": "Hi"}])
    assert codec.tok.decode(ids) == "<s><|user|>Hi\n<|assistant|>"


CASES = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.OUT_OF_RANGE: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 503, grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.FAILED_PRECONDITION: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504, grpc.StatusCode.INTERNAL: 500, grpc.StatusCode.UNKNOWN: 500,
    grpc.StatusCode.DATA_LOSS: 500, grpc.StatusCode.UNIMPLEMENTED: 500,
}


@pytest.mark.parametrize("code", list(CASES), ids=[c.name for c in CASES])
def test_each_grpc_status_has_its_http_code_and_keeps_the_servers_words(code):
    e = from_rpc(grpc.aio.AioRpcError(code, None, None, details="what to fix"), "127.0.0.1:1")
    assert e.status == CASES[code] and e.code == code.name and "what to fix" in e.message
    err = e.body()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert set(HTTP_OF_GRPC) <= set(CASES)


def test_only_this_fronts_own_failed_connect_is_called_unreachable():
    """A router in front (--backend) that has no healthy worker answers UNAVAILABLE with its workers' states, which
    may say "failed to connect": it is reachable, and the front said "the decode server at <router> is unreachable"."""
    def message(details):
        return from_rpc(grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, details=details), "h:1").message
    own = message("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Connection refused")
    assert "the decode server at h:1 is unreachable (--backend)" in own
    router = message("no healthy decode worker behind this router (127.0.0.1:50051 down: failed to connect to all "
                     "addresses); retry later")
    assert "unreachable" not in router and router.startswith("no healthy decode worker")


@pytest.mark.parametrize("details", ["Stream removed (ping timeout)", "Socket closed"])
def test_a_connection_lost_before_the_first_token_says_so(details):
    """A decode server frozen past --backend-keepalive-s: the call fails UNAVAILABLE "Stream removed (ping
    timeout)", which was passed on as the reason with code UNAVAILABLE; after a first token it already read as a
    lost connection."""
    e = from_rpc(grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, details=details), "h:1")
    assert (e.status, e.code) == (503, "backend_connection_lost")
    assert e.message.startswith("the connection to the decode server at h:1 was lost before the first token")
    assert details in e.message and "retry" in e.message


def _refused(req) -> ApiError:
    with pytest.raises(ApiError) as e:
        params(req)
    assert e.value.status == 400
    return e.value


@pytest.mark.parametrize("field,value", [("temperature", -0.1), ("temperature", float("nan")), ("top_p", 0.0),
                                         ("top_p", 1.5), ("top_k", -2), ("seed", 1 << 64), ("max_tokens", 0),
                                         ("n", 2), ("logprobs", 1), ("echo", True), ("best_of", 3),
                                         ("suffix", "x"), ("presence_penalty", 0.5), ("logit_bias", {"1": 2.0}),
                                         ("stop_token_ids", [-1])])
def test_completion_fields_out_of_range_or_not_implemented_are_refused_by_name(field, value):
    assert _refused(CompletionRequest(prompt=[1], **{field: value})).param == field


@pytest.mark.parametrize("field,value", [("logprobs", True), ("top_logprobs", 2), ("max_completion_tokens", 0),
                                         ("tools", [{"type": "function"}]), ("tool_choice", "auto"),
                                         ("functions", [{"name": "f"}]), ("response_format", {"type": "json_object"})])
def test_chat_fields_not_implemented_are_refused_by_name(field, value):
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **{field: value})
    assert _refused(req).param == field


def test_the_defaults_and_vllm_extensions_reach_the_request():
    p = params(CompletionRequest(prompt=[1], seed=-1, top_k=-1, top_p=0.5, stop="x", stop_token_ids=[7],
                                 response_format=None))
    assert p.max_tokens == 16 and p.sampling.temperature == 1.0 and p.sampling.seed == (1 << 64) - 1
    assert p.sampling.top_k == 0 and p.sampling.top_p == 0.5 and p.stop == ["x"]
    r = p.request([1, 2], 16, eos_token_ids=[3])
    assert list(r.stop_token_ids) == [7, 3] and r.stop_on_eos and r.max_new_tokens == 16
    r = params(CompletionRequest(prompt=[1], ignore_eos=True)).request([1], 4, eos_token_ids=[3])
    assert list(r.stop_token_ids) == [] and not r.stop_on_eos
    chat = params(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], max_tokens=5,
                                        max_completion_tokens=7, response_format={"type": "text"}))
    assert chat.max_tokens == 7


def test_null_flags_are_false_as_openais_schema_allows():
    """`"stream": null` (OpenAI: boolean or null) was a 400 "Input should be a valid boolean", as were
    ignore_eos and return_token_ids: every other optional field took null. Null reads as the default, false."""
    req = CompletionRequest.model_validate({"prompt": [1], "stream": None, "ignore_eos": None,
                                            "return_token_ids": None})
    assert not req.stream and not req.return_token_ids
    r = params(req).request([1], 4, eos_token_ids=[3])
    assert r.stop_on_eos and list(r.stop_token_ids) == [3]
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "stream": None})
    assert not chat.stream


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_max_tokens_too_large_for_the_wire_names_the_upper_bound(field):
    """10^12 was told "use 1 or more", the wrong bound."""
    body = {"prompt": [1]} if field == "max_tokens" else {"messages": [{"role": "user", "content": "x"}]}
    cls = CompletionRequest if field == "max_tokens" else ChatCompletionRequest
    e = _refused(cls.model_validate({**body, field: 10 ** 12}))
    assert e.param == field and "at most 4294967295" in e.message and "1 or more" not in e.message
    assert "1 or more" in _refused(cls.model_validate({**body, field: 0})).message


# ---- the app in-process, against a scripted decode server (support.apifront.FakeBackend) ----

LAST = pb.FINISH_REASON_LENGTH


def _app(backend: FakeBackend, codec=None):
    return build_app(ApiConfig(served_model_name="m"), backend, codec, ApiMetrics())


def _post(app, body: dict, path: str = "/v1/completions", **kw) -> tuple[int, str]:
    return asyncio.run(asgi_post(app, path, body, **kw))


@pytest.mark.parametrize("stream,script", [(False, [HANG]), (False, [5, 6, HANG]), (True, [HANG])],
                         ids=["whole-in-prefill", "whole-mid-answer", "stream-in-prefill"])
def test_a_client_that_hangs_up_cancels_its_generate_call(stream, script):
    """Starlette runs a handler to its end whatever the client does; the front must notice the hang-up itself
    (a stream past its first token is Starlette's own case: its writes notice)."""
    backend = FakeBackend(lambda _req: script)
    t0 = time.monotonic()
    status, _ = _post(_app(backend), {"prompt": [1, 2], "max_tokens": 50, "stream": stream}, hang_up_after=0.3)
    assert status == 499 and time.monotonic() - t0 < 5
    assert [c.cancelled for c in backend.calls] == [True]


def test_a_refused_prompt_is_answered_without_waiting_for_the_others():
    """Prompt 2 refused at once, prompt 1 still in prefill (never answering here): the 400 comes now and prompt
    1's call is cancelled, rather than the refusal waiting for every other prompt's first token."""
    backend = FakeBackend(lambda req: [rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "prompt too long")]
                          if list(req.token_ids) == [7, 8] else [HANG])
    status, text = _post(_app(backend), {"prompt": [[5, 6], [7, 8]], "max_tokens": 4}, timeout=5)
    assert status == 400 and "prompt too long" in text
    assert [c.cancelled for c in backend.calls] == [True, False]


def test_an_error_after_the_first_token_is_an_error_event_then_done():
    backend = FakeBackend(lambda _req: [5, rpc_error(grpc.StatusCode.UNAVAILABLE, "the decode server is stopping")])
    status, text = _post(_app(backend), {"prompt": [1, 2], "max_tokens": 8, "stream": True})
    events = sse_events(text)
    assert status == 200 and events[0]["choices"][0]["token_ids"] == [5]
    assert events[1]["error"]["code"] == "UNAVAILABLE" and "stopping" in events[1]["error"]["message"]
    assert events[2:] == ["[DONE]"]


@pytest.mark.parametrize("prompt", [[1, 2], [[1, 2], [3, 4]]], ids=["one-prompt", "two-prompts"])
def test_a_bug_mid_stream_is_a_500_event_then_done_never_a_stall(codec, monkeypatch, prompt):
    """Not only the decode server's errors: an exception of the front's own (here its detokenizer) must still
    end the stream in OpenAI's shape, and with several prompts must not leave the merge waiting forever."""
    def broken(self, token_id):
        raise RuntimeError("detokenizer broke")
    monkeypatch.setattr(Detokenizer, "step", broken)
    backend = FakeBackend(lambda _req: [5, 6, (7, LAST)])
    status, text = _post(_app(backend, codec), {"prompt": prompt, "max_tokens": 3, "stream": True}, timeout=5)
    events = sse_events(text)
    assert status == 200 and events[-1] == "[DONE]"
    err = events[-2]["error"]
    assert (err["type"], err["code"]) == ("server_error", "internal_error") and "detokenizer broke" in err["message"]
    assert all(c.done() for c in backend.calls)


def test_a_stop_string_completed_by_the_last_message_reads_its_status_rather_than_cancel(codec):
    """The decode server then counts the request as finished, not cancelled."""
    ids = _words(codec, "Hello world")
    backend = FakeBackend(lambda _req: [*ids[:-1], (ids[-1], LAST)])
    request = pb.GenerateRequest(token_ids=[1], max_new_tokens=len(ids))
    gen = Generation(backend, request, codec.detokenizer([1]), ["world"], ApiMetrics(), "/v1/completions", 0.0)

    async def run():
        await gen.start()
        return await collect(gen)
    piece = asyncio.run(run())
    assert (piece.text, piece.finish_reason, piece.token_ids) == ("Hello ", "stop", ids)
    assert backend.calls[0].status_read and not backend.calls[0].cancelled


def _asked(bodies: list[tuple[str, dict]], codec) -> list[pb.GenerateRequest]:
    """The GenerateRequests the app sends a decode server that allows 64 new tokens, one per body."""
    backend = FakeBackend(lambda _req: [(5, LAST)], pb.InfoResponse(model="fake", max_new_tokens=64, max_seq_len=4096))
    app = _app(backend, codec)
    for path, body in bodies:
        status, text = _post(app, body, path)
        assert status == 200, text
    return [c.request for c in backend.calls]


def test_every_sampling_field_reaches_the_generate_request_a_seed_of_0_too(codec):
    """top_k, top_p, temperature and the seed as the decode server is asked them. A seed of 0 is a seed (left out,
    the server would draw one and the answer would not repeat); no seed is left out (the server draws one)."""
    seeded, plain, chat = _asked([
        ("/v1/completions", {"prompt": [1, 2], "temperature": 0.7, "top_p": 0.5, "top_k": 5, "seed": 0}),
        ("/v1/completions", {"prompt": [1, 2]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "top_k": 3, "seed": 9})], codec)
    s = seeded.sampling
    assert (s.temperature, s.top_p, s.top_k, s.HasField("seed"), s.seed) == (pytest.approx(0.7), 0.5, 5, True, 0)
    assert not plain.sampling.HasField("seed") and plain.sampling.top_k == 0 and plain.sampling.temperature == 1.0
    assert (chat.sampling.top_k, chat.sampling.seed) == (3, 9)


def test_without_max_tokens_completions_ask_for_16_and_chat_for_what_the_server_allows(codec):
    """OpenAI's defaults: /v1/completions 16; chat none, so the decode server's --max-new-tokens (64 here), within
    the slot's room after the prompt."""
    completion, chat = _asked([("/v1/completions", {"prompt": [1, 2]}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})], codec)
    assert completion.max_new_tokens == 16 and chat.max_new_tokens == 64


def test_at_most_two_long_texts_are_tokenized_at_once_and_a_cancelled_one_keeps_its_turn():
    """Long prompts are tokenized in worker threads, LONG_TEXTS_AT_ONCE at a time (api_server/prompts.py): before,
    30 bodies of 3 MB text were all tokenized at once (3.4 GB). A request cancelled while its text is tokenized
    keeps its turn until its thread ends, since the thread cannot be stopped."""
    import threading

    from api_server import prompts

    release, lock = threading.Event(), threading.Lock()
    inside, most = [0], [0]

    class Blocking:
        def encode(self, text):
            with lock:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
            release.wait(60)
            with lock:
                inside[0] -= 1
            return [len(text)]

    async def until(cond, seconds):
        end = time.monotonic() + seconds
        while not cond() and time.monotonic() < end:
            await asyncio.sleep(0.01)
        return cond()

    async def main():
        long = "w " * prompts.INLINE_CHARS
        tasks = [asyncio.create_task(prompts.completion_prompts(Blocking(), long + "x" * i, 64)) for i in range(6)]
        try:
            assert await until(lambda: inside[0] == prompts.LONG_TEXTS_AT_ONCE, 30)
            assert not await until(lambda: inside[0] > prompts.LONG_TEXTS_AT_ONCE, 1.0), "more threads went in"
            tasks[0].cancel()  # one of the two inside: its thread runs on, so no third may start yet
            assert not await until(lambda: inside[0] > prompts.LONG_TEXTS_AT_ONCE, 0.5)
        finally:
            release.set()  # a failed check must not leave threads waiting out their 60 s
        done = await asyncio.gather(*tasks, return_exceptions=True)
        assert isinstance(done[0], asyncio.CancelledError)
        assert [d[0][0] for d in done[1:]] == [len(long) + i for i in range(1, 6)]

    asyncio.run(main())
    assert most[0] == prompts.LONG_TEXTS_AT_ONCE


CHAT = "/v1/chat/completions"


@pytest.mark.parametrize("path,body,param,words", [
    ("/v1/completions", {"prompt": [1], "temperature": 1e308}, "temperature", ["32-bit"]),
    ("/v1/completions", {"prompt": [1], "top_p": 1e-50}, "top_p", ["32-bit"]),
    ("/v1/completions", {"prompt": [1], "stop": ""}, "stop", ["empty"]),
    ("/v1/completions", {"prompt": [1], "stop": ["x", ""]}, "stop", ["empty"]),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", ["wizard", "user"]),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": {"x": ["y"]}}]}]},
     "messages[0].content[0].text", ["string"]),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text"}]}]},
     "messages[0].content[1].text", ["string"]),
], ids=["temperature-over-f32", "top-p-under-f32", "stop-empty", "stop-list-empty", "role", "part-text-object",
        "part-text-missing"])
def test_values_the_decode_server_cannot_hold_or_parts_without_text_are_400_naming_the_field(codec, path, body,
                                                                                          param, words):
    """Before: the float overflowed on the way (a 400 from the decode server naming sampling.temperature, param
    null), an empty stop string was dropped, and an unknown role or a text part whose text was an object or absent
    was served (the object turned into its repr)."""
    backend = FakeBackend([])
    status, text = _post(_app(backend, codec), body, path)
    err = json.loads(text)["error"]
    assert status == 400 and err["param"] == param, (status, err)
    for w in words:
        assert w in err["message"], err
    assert backend.calls == []  # refused before any Generate call


def test_the_decode_servers_info_is_asked_again_after_its_ttl_and_a_failed_refresh_keeps_the_last(monkeypatch):
    """Before, the front kept the first Info forever: a decode server restarted with --max-new-tokens 50 had its
    requests without max_tokens refused for the old default (4095), a limit the client never sent."""
    from types import SimpleNamespace

    from api_server import backend as backend_mod

    now = [100.0]
    monkeypatch.setattr(backend_mod.time, "monotonic", lambda: now[0])
    answers = [pb.InfoResponse(model="m", max_new_tokens=4095), pb.InfoResponse(model="m", max_new_tokens=50),
               rpc_error(grpc.StatusCode.UNAVAILABLE, "down")]

    class Stub:
        calls = 0

        async def Info(self, request, timeout, metadata):
            Stub.calls += 1
            got = answers.pop(0)
            if isinstance(got, Exception):
                raise got
            return got

    b = backend_mod.Backend("127.0.0.1:1", SimpleNamespace(metadata=lambda: ()), 1 << 20, 10.0, 60.0)

    async def main():
        b._decode, b._info_lock = Stub(), asyncio.Lock()
        first = (await b.info()).max_new_tokens
        now[0] += backend_mod.INFO_TTL_S / 2
        cached = (await b.info()).max_new_tokens
        now[0] += backend_mod.INFO_TTL_S
        refreshed = (await b.info()).max_new_tokens
        now[0] += backend_mod.INFO_TTL_S
        kept = (await b.info()).max_new_tokens  # the refresh fails: the last answer stands
        return first, cached, refreshed, kept

    assert asyncio.run(main()) == (4095, 4095, 50, 50)
    assert Stub.calls == 3


@pytest.mark.parametrize("info,bound,words", [
    (pb.InfoResponse(model="m", max_prompt_tokens=32768, context_length=4096, max_seq_len=4096), 4095,
     ["at most 4095 prompt tokens", "context"]),
    (pb.InfoResponse(model="m", max_prompt_tokens=100, context_length=4096, max_seq_len=4096), 100,
     ["at most 100 prompt tokens", "--max-prompt-tokens"]),
    (pb.InfoResponse(model="m", max_prompt_tokens=32768, context_length=32768, max_seq_len=2048), 2047,
     ["at most 2047 prompt tokens"]),
], ids=["context-binds", "flag-binds", "pool-binds"])
def test_a_prompt_over_the_decode_servers_context_is_refused_by_the_front_naming_the_bound(info, bound, words):
    """Before, the front checked only --max-prompt-tokens (32,768 by default on CPU, where a request holds 4,096),
    so a 5,000-token prompt reached the decode server and came back with param null."""
    backend = FakeBackend(lambda _req: [(5, LAST)], info=info)
    status, text = _post(_app(backend), {"prompt": [1] * (bound + 1), "max_tokens": 1})
    err = json.loads(text)["error"]
    assert status == 400 and err["param"] == "prompt" and err["code"] == "prompt_too_large", (status, err)
    for w in words:
        assert w in err["message"], err
    assert backend.calls == []
    assert _post(_app(backend), {"prompt": [1] * bound, "max_tokens": 1})[0] == 200  # at the bound: sent
    assert len(backend.calls) == 1


@pytest.mark.parametrize("prompt,where", [("", "prompt "), ([[1, 2], []], "prompt[1] "), (["w5", ""], "prompt[1] ")],
                         ids=["empty-text", "empty-ids-in-list", "empty-text-in-list"])
def test_a_prompt_of_no_tokens_is_refused_by_the_front_naming_it(prompt, where):
    """"" went on to the decode server, whose "empty prompt: send at least one token id" came back with param null
    and code INVALID_ARGUMENT, while [] got the front's own 400 naming `prompt`: now every empty prompt gets that.
    (A tokenizer without a BOS, as the README's, encodes "" to nothing; the tests' own adds one.)"""
    from api_server import prompts

    class NoBos:
        def encode(self, text: str) -> list[int]:
            return [5] * len(text.split())

    with pytest.raises(ApiError) as e:
        asyncio.run(prompts.completion_prompts(NoBos(), prompt, 64))
    assert (e.value.status, e.value.param) == (400, "prompt") and e.value.message.startswith(where + "is empty")


@pytest.mark.parametrize("body,param,words,fits", [
    ({"prompt": [1, 2], "max_tokens": 65}, "max_tokens", "at most 64 tokens a request (its --max-new-tokens)", 64),
    ({"prompt": [1] * 100, "max_tokens": 29}, "max_tokens", "that is 129, over the 128 tokens", 28),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "max_completion_tokens": 65},
     "max_completion_tokens", "ask for at most 64", 8),
], ids=["over-max-new-tokens", "over-the-context", "chat-max_completion_tokens"])
def test_max_tokens_over_the_decode_servers_bounds_is_refused_naming_the_clients_field(codec, body, param, words,
                                                                                      fits):
    """The decode server refused in its words, naming its own field ("max_new_tokens is 5000; use 1..4096"), with
    param null; the front knows both bounds from its Info and names the field the client sent. No call goes out."""
    calls = []
    backend = FakeBackend(lambda req: calls.append(req) or [5, (6, LAST)],
                          pb.InfoResponse(model="fake", max_new_tokens=64, context_length=128, max_seq_len=128))
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    status, text = _post(_app(backend, codec), body, path)
    err = json.loads(text)["error"]
    assert (status, err["param"]) == (400, param) and words in err["message"], err
    assert not calls
    assert _post(_app(backend, codec), {**body, param: fits}, path)[0] == 200  # at the bound: served
