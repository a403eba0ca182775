"""Cases a mutation pass over how a request ends (max_tokens, stop strings and ids, EOS, the end of a stream, its
usage, a cancel, a deadline) in the OpenAI front (api_server/) and the decode server (decode_server/request_path.py,
validate.py, kvtransfer/engine/sequence.py) found untested: each test here failed on a one-line change of that code
that the other tests let through.

Why the front in process, against a scripted decode server (support.apifront.FakeBackend): each case is a Generate
stream of a chosen shape (a stop string completed mid-answer, a stream that ends without finish_reason, two prompts
that end at different tokens, a decode server whose slot bounds the answer), which the real model's random weights
reach only by search, and a real server's timing only now and then; each runs in milliseconds, the same way every
time. Why one real decode server beside them: stop_on_eos and --request-timeout-s are the decode server's own,
behind a gRPC call the front never makes that way (it lists the EOS itself and sets its own deadline).
"""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from api_server.app import build_app
from api_server.config import ApiConfig
from api_server.errors import ApiError
from api_server.generation import Generation, collect
from api_server.metrics import ApiMetrics
from api_server.params import params
from api_server.protocol import CompletionRequest
from api_server.text import TextCodec
from proto import kvtransfer_pb2 as pb
from support.apifront import HANG, FakeBackend, asgi_post, rpc_error, sse_events
from support.textmodel import save_tokenizer

LENGTH, STOP = pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP
GUARD_S = 30  # an exchange not over after this long is a hang
CHAT = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def codec(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    save_tokenizer(d)
    return TextCodec.load(str(d))


def _app(backend: FakeBackend, codec=None):
    return build_app(ApiConfig(served_model_name="m"), backend, codec, ApiMetrics())


def _post(app, body: dict, path: str = "/v1/completions") -> tuple[int, str]:
    return asyncio.run(asgi_post(app, path, body, timeout=GUARD_S))


def _words(codec, text: str) -> list[int]:
    return codec.tok(text, add_special_tokens=False)["input_ids"]


def _choices(events: list) -> list[dict]:
    """Every choice of a stream's chunks, in order (the usage chunk has none)."""
    return [c for e in events if isinstance(e, dict) for c in e.get("choices", [])]


def _generation(backend: FakeBackend, codec, stop: list[str], max_new_tokens: int) -> Generation:
    request = pb.GenerateRequest(token_ids=[1], max_new_tokens=max_new_tokens)
    return Generation(backend, request, codec.detokenizer([1]) if codec else None, stop, ApiMetrics(),
                      "/v1/completions", 0.0)


def _collect(gen: Generation):
    async def run():
        await gen.start()
        return await asyncio.wait_for(collect(gen), GUARD_S)
    return asyncio.run(run())


# --- how a Generate call is left (api_server/generation.py) ---


def test_a_stop_string_matched_mid_answer_cancels_the_call_rather_than_wait_for_its_end(codec):
    """The stop string completes before the decode server's last token: the call is cancelled so the decode server
    frees the slot at its next step (kills the status read on every stop match, not only on the call's last
    message: the front then waited for the decode server to run the answer to max_tokens, the slot busy and the
    client's answer held until then)."""
    ids = _words(codec, "Hello world and more")
    backend = FakeBackend(lambda _req: [*ids, HANG])  # the decode server would go on: it never ends by itself here
    piece = _collect(_generation(backend, codec, ["world"], 50))
    assert (piece.text, piece.finish_reason) == ("Hello ", "stop")
    call = backend.calls[0]
    assert call.cancelled and not call.status_read


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_an_answer_that_ran_to_max_tokens_reads_its_status_rather_than_cancel(stream):
    """The decode server's last message came (finish_reason length): the call is read to its OK status, so the
    decode server counts the request finished, not cancelled (kills the status read dropped on the length path:
    every answer that ran to max_tokens was counted CANCELLED in kvt_requests_total)."""
    backend = FakeBackend(lambda _req: [5, 6, (7, LENGTH)])
    status, text = _post(_app(backend), {"prompt": [1, 2], "max_tokens": 3, "stream": stream})
    assert status == 200, text
    call = backend.calls[0]
    assert call.status_read and not call.cancelled


def test_text_held_back_as_a_possible_stop_string_is_sent_when_the_answer_ends_without_it(codec):
    """The answer ends at max_tokens on text that began a stop string ("Hello wor", stop "world"): what was held
    back is plain text after all and is sent (kills the held text dropped on the finish_reason path: the answer
    lost its last characters)."""
    ids = _words(codec, "Hello wor")
    backend = FakeBackend(lambda _req: [*ids[:-1], (ids[-1], LENGTH)])
    piece = _collect(_generation(backend, codec, ["world"], len(ids)))
    assert (piece.text, piece.finish_reason, piece.token_ids) == ("Hello wor", "length", ids)


def test_an_answer_ending_inside_a_character_ends_as_a_one_shot_decode_of_its_ids(codec):
    """The last token is one byte of a three-byte character: the detokenizer's held bytes are flushed with the last
    message, as a decode of the whole answer shows them (kills the flush dropped: the answer's text then differed
    from a decode of its own token_ids)."""
    ids = _words(codec, "ab 漢")[:-1]
    assert codec.decode(ids[-1:]) == "\ufffd"  # the answer ends inside 漢
    backend = FakeBackend(lambda _req: [*ids[:-1], (ids[-1], LENGTH)])
    piece = _collect(_generation(backend, codec, [], len(ids)))
    assert piece.text == codec.decode(ids) and piece.text.endswith("\ufffd")


def test_a_stream_without_finish_reason_that_ran_to_max_tokens_is_length():
    """A decode server from before the field ends the stream with no finish_reason: one that sent max_tokens tokens
    ended on its length, an earlier end on a stop token (kills `>` for `>=` in the inference: every such answer read
    "stop")."""
    backend = FakeBackend(lambda req: [5, 6, 7][:3 if req.max_new_tokens == 3 else 2])
    assert _collect(_generation(backend, None, [], 3)).finish_reason == "length"
    assert _collect(_generation(backend, None, [], 4)).finish_reason == "stop"


# --- the stream's end (api_server/streams.py, app.py) ---


def test_a_stream_of_two_prompts_ends_only_once_both_have_finished():
    """Prompt 0 ends after 2 tokens, prompt 1 after 6: the stream carries every token of both and a finish_reason
    for each (kills the merge counting one finished choice as all: the stream ended at the first finish_reason and
    the longer answer was cut off, with no finish_reason of its own)."""
    backend = FakeBackend(lambda req: [5, (6, LENGTH)] if list(req.token_ids) == [1, 2] else
                          [7, 8, 9, 10, 11, (12, STOP)])
    status, text = _post(_app(backend), {"prompt": [[1, 2], [3, 4]], "max_tokens": 6, "stream": True})
    assert status == 200, text
    events = sse_events(text)
    assert events[-1] == "[DONE]"
    choices = _choices(events)
    for index, ids, reason in ((0, [5, 6], "length"), (1, [7, 8, 9, 10, 11, 12], "stop")):
        mine = [c for c in choices if c["index"] == index]
        assert [t for c in mine for t in c["token_ids"]] == ids and mine[-1]["finish_reason"] == reason, mine
        assert all(c["finish_reason"] is None for c in mine[:-1])


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": [1, 2]}),
    ("/v1/completions", {"prompt": [1, 2], "stream_options": {"include_usage": False}}),
    ("/v1/chat/completions", {"messages": CHAT}),
    ("/v1/chat/completions", {"messages": CHAT, "stream_options": {"include_usage": False}}),
], ids=["completions", "completions-usage-false", "chat", "chat-usage-false"])
def test_a_stream_that_did_not_ask_for_usage_has_no_usage_chunk(codec, path, body):
    """OpenAI sends the usage chunk (empty choices) only on stream_options.include_usage true; a client reading
    choices[0] of every chunk breaks on one it did not ask for (kills the chunk sent without the option, or with it
    false)."""
    backend = FakeBackend(lambda _req: [5, 6, (7, LENGTH)])
    status, text = _post(_app(backend, codec), {**body, "max_tokens": 3, "stream": True}, path)
    assert status == 200, text
    events = sse_events(text)
    assert events[-1] == "[DONE]" and all(e["choices"] and "usage" not in e for e in events[:-1]), events


@pytest.mark.parametrize("last,reason", [((7, LENGTH), "length"), ((7, STOP), "stop")])
def test_a_chat_stream_s_last_chunk_says_why_it_ended(codec, last, reason):
    """The chunk carrying the last token has the finish_reason, every earlier chunk null (kills the chat stream
    sending null on every chunk: the whole answer's finish_reason was checked, the stream's was not)."""
    backend = FakeBackend(lambda _req: [5, 6, last])
    status, text = _post(_app(backend, codec), {"messages": CHAT, "max_tokens": 3, "stream": True},
                         "/v1/chat/completions")
    assert status == 200, text
    choices = _choices(sse_events(text))
    assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + [reason]


def test_usage_counts_prompt_and_answer_and_their_sum(codec):
    """usage's three numbers, whole and as the stream's last chunk (kills total_tokens one off: only the server
    tests checked the sum)."""
    backend = FakeBackend(lambda _req: [5, 6, (7, LENGTH)])
    want = {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    status, text = _post(_app(backend), {"prompt": [1, 2], "max_tokens": 3})
    assert status == 200 and json.loads(text)["usage"] == want, text
    status, text = _post(_app(backend), {"prompt": [1, 2], "max_tokens": 3, "stream": True,
                                         "stream_options": {"include_usage": True}})
    events = sse_events(text)
    assert events[-2]["choices"] == [] and events[-2]["usage"] == want, events


# --- what max_tokens asks of the decode server (api_server/app.py, params.py) ---


def _asked(info: pb.InfoResponse, path: str, body: dict) -> int:
    """The max_new_tokens the front asks the decode server for."""
    backend = FakeBackend(lambda _req: [(5, LENGTH)], info)
    status, text = _post(_app(backend), body, path)
    assert status == 200, text
    return backend.calls[0].request.max_new_tokens


def test_without_max_tokens_the_answer_may_fill_the_slot_and_no_more():
    """No max_tokens (chat's default, or null on /v1/completions): what the decode server's slot leaves after the
    prompt when that binds, else its --max-new-tokens (kills the room one over, which the decode server refuses as
    prompt + max_new_tokens over its slot: every such request failed 400; and kills null on /v1/completions read as
    a fixed 256)."""
    slot = pb.InfoResponse(model="fake", max_new_tokens=4096, max_seq_len=32)
    prompt = list(range(1, 11))
    assert _asked(slot, "/v1/completions", {"prompt": prompt, "max_tokens": None}) == 32 - 10
    roomy = pb.InfoResponse(model="fake", max_new_tokens=100, max_seq_len=4096)
    assert _asked(roomy, "/v1/completions", {"prompt": prompt, "max_tokens": None}) == 100


def test_logprobs_0_on_completions_is_refused_not_ignored():
    """logprobs=0 asks for the chosen token's log-probability, which this server does not compute: refused by name
    like any other logprobs (kills `if req.logprobs:`, which let 0 through as if it had not been asked)."""
    with pytest.raises(ApiError) as refused:
        params(CompletionRequest(prompt=[1], logprobs=0))
    assert (refused.value.status, refused.value.param) == (400, "logprobs")


# --- an error after the first token (api_server/errors.py) ---


def test_a_connection_lost_right_after_the_first_token_is_a_mid_answer_503():
    """The decode server's connection drops after one token: the stream's error event says the answer was cut off
    after 1 token and that the connection was lost, a 503 worth a retry (kills `if tokens > 1:`, which told the
    first token's loss as a failure before any answer)."""
    backend = FakeBackend(lambda _req: [5, rpc_error(grpc.StatusCode.UNAVAILABLE, "Socket closed")])
    status, text = _post(_app(backend), {"prompt": [1, 2], "max_tokens": 8, "stream": True})
    events = sse_events(text)
    assert status == 200 and events[-1] == "[DONE]"
    err = events[-2]["error"]
    assert err["code"] == "backend_connection_lost" and "after 1 tokens" in err["message"], err


# --- the decode server's own ends (decode_server/request_path.py, kvtransfer/engine/sequence.py) ---

SERVER_DEADLINE_S = 3.0  # the decode server's --request-timeout-s: far above a short answer, far below 4000 tokens
TINY_EOS = 2  # the tiny preset's eos_token_id (LlamaConfig's default)
# Prompts whose greedy answer from the tiny preset's weights (seed 0) holds its EOS; the rest are searched in order.
EOS_PROMPTS = [[1, 283, 284]] + [[1, a, a + 1] for a in range(3, 512, 5)]


@pytest.fixture(scope="module")
def decode(tmp_path_factory):
    """A colocated decode server over the tiny preset (float32) that ends every request within SERVER_DEADLINE_S."""
    from support.servers import colocated_server
    with colocated_server(tmp_path_factory.mktemp("decode"), args=["--request-timeout-s", str(SERVER_DEADLINE_S)]) \
            as run:
        yield run


def _generate(addr: str, prompt: list[int], n: int, **kw) -> dict:
    from decode_server.client import generate
    return asyncio.run(generate(addr, prompt, n, timeout=120.0, **kw))


def test_stop_on_eos_alone_ends_the_answer_at_the_model_s_eos(decode):
    """A Generate call asking stop_on_eos without listing the EOS in stop_token_ids (decode_server.client
    --stop-on-eos, any gRPC client) ends at the model's EOS, counted, with finish_reason stop (kills the model's EOS
    left out of the request's stop set: the front lists the EOS itself, so only its tests ran, and every direct
    client's answer ran to max_tokens)."""
    n = 24
    prompt, base = next(((p, b) for p in EOS_PROMPTS
                         if TINY_EOS in (b := _generate(decode.addr, p, n)["tokens"])[1:]), (None, None))
    assert prompt is not None, "no prompt in EOS_PROMPTS makes the tiny model say its EOS: add one"
    assert len(base) == n
    j = base.index(TINY_EOS, 1)
    got = _generate(decode.addr, prompt, n, stop_on_eos=True)
    assert (got["tokens"], got["finish_reason"]) == (base[:j + 1], "stop")


def test_the_decode_server_s_own_deadline_ends_a_long_answer_whose_client_set_a_later_one(decode):
    """--request-timeout-s bounds every request, whatever deadline its client set (here 120 s): a 4000-token answer
    ends DEADLINE_EXCEEDED, saying decoding did not finish (kills the deadline dropped from the wait for each decoded
    token: only a client's own deadline then ended it, and a client without one held its slot to max_tokens)."""
    with pytest.raises(grpc.aio.AioRpcError) as ended:
        _generate(decode.addr, [1, 2, 3], 4000)
    assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, ended.value
    assert "decoding did not finish before the deadline" in (ended.value.details() or ""), ended.value.details()


def test_a_sequence_asked_to_stop_twice_ends_for_the_first_reason():
    """A slow reader's stop, then a shutdown's before the scheduler's next step: the stream ends for the first one,
    RESOURCE_EXHAUSTED naming --stream-buffer-tokens (kills Sequence.stop's first-call-wins guard removed: the later
    call rewrote the cause and the client was told to retry elsewhere)."""
    from kvtransfer.engine.sequence import EndCause, Sequence
    s = Sequence(1, lease=None, length=1, last_token=0, remaining=10, sink=lambda item: None)
    s.stop("too many unread", EndCause.SLOW_READER)
    s.stop("server shutting down", EndCause.SHUTDOWN)
    assert s.stopped and (s.stop_cause, s.stop_reason) == (EndCause.SLOW_READER, "too many unread")


def test_max_new_tokens_of_exactly_the_server_s_limit_is_admitted_and_one_more_refused():
    """--max-new-tokens is the most a request may ask for, inclusive (kills `<` for `<=`: a client asking exactly
    the limit the server's Info announces, as the front does for chat without max_tokens, was refused 400)."""
    from types import SimpleNamespace

    from decode_server.validate import request_problem
    config = SimpleNamespace(max_new_tokens=8, max_prompt_tokens=64, colocated=True)
    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=64))
    engine = SimpleNamespace(m=SimpleNamespace(model=model), pool=SimpleNamespace(max_seq=64))

    def problem(new: int):
        return request_problem(pb.GenerateRequest(token_ids=[1, 2], max_new_tokens=new), config, engine, 512, None)
    assert problem(8) is None and problem(1) is None
    code, message = problem(9)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "--max-new-tokens" in message
