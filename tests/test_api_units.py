"""The OpenAI front's pieces that need no server: stop strings, incremental detokenization, the error table, the
request checks.

Why apart from the server tests: each of these has edge cases (a stop string split over three pieces, a
character split over three tokens, a seed over 64 bits) that are cheap to state here and costly to reach through
a model with random weights.
"""

from __future__ import annotations

import grpc
import pytest

from api_server.errors import HTTP_OF_GRPC, ApiError, from_rpc
from api_server.params import params
from api_server.protocol import ChatCompletionRequest, CompletionRequest
from api_server.stops import StopMatcher
from api_server.text import TextCodec
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
    grpc.StatusCode.CANCELLED: 499, grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.FAILED_PRECONDITION: 503,
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
