"""The OpenAI-compatible front, end to end with the official `openai` client: a colocated decode server serving a
local model directory (the tiny preset's weights, a byte-level BPE tokenizer), `python -m api_server` in front.

Why the official client: it is what users point at the front, and it parses what it gets strictly enough
(SSE framing, chunk shapes, usage) that a shape wrong in a way a hand-written check would share goes noticed.
Why the gRPC client beside it: the ids the front sends and gets back are checked against a direct Generate call
to the same decode server, so the text is known to be the model's output, not just some text. One server set
for the module: each start costs tens of seconds of a shared core.
"""

from __future__ import annotations

import asyncio
import os

import pytest

openai = pytest.importorskip("openai")  # the dev extra; a GPU machine's python (make gpu-test) may lack it

from api_server.text import TextCodec
from decode_server.client import generate
from support.apifront import api_front, request
from support.servers import colocated_server
from support.textmodel import build_text_model

NEW = 8
LENGTH = {"ignore_eos": True, "return_token_ids": True}  # every request runs its max_tokens (no early EOS)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_text_model(tmp_path_factory.mktemp("textmodel"))


@pytest.fixture(scope="module")
def codec(model_dir):
    return TextCodec.load(str(model_dir))


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    with colocated_server(logs, model=str(model_dir)) as decode, \
            api_front(str(logs / "api.log"), decode.addr, ["--model", str(model_dir)], ready=(200,)) as url:
        yield decode, url


@pytest.fixture(scope="module")
def client(servers):
    return openai.OpenAI(base_url=f"{servers[1]}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _direct(servers, ids: list[int], n: int) -> list[int]:
    """The decode server's own greedy answer, over gRPC."""
    return asyncio.run(generate(servers[0].addr, ids, n))["tokens"]


def test_models_lists_the_one_served_model(client, model_dir):
    models = client.models.list().data
    assert [m.id for m in models] == [os.path.basename(model_dir)]  # the decode server's Info.model


def test_health_is_the_backends(servers):
    assert request("GET", f"{servers[1]}/health") == (200, {"status": "serving"})


def test_a_text_completion_is_the_models_greedy_output_and_counts_its_tokens(client, model, servers, codec):
    out = client.completions.create(model=model, prompt="Hello world", max_tokens=NEW, temperature=0,
                                    extra_body=LENGTH)
    prompt = codec.encode("Hello world")
    choice = out.choices[0]
    assert choice.token_ids == _direct(servers, prompt, NEW)
    assert choice.text == codec.decode(choice.token_ids) and choice.finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == \
        (len(prompt), NEW, len(prompt) + NEW)
    assert out.object == "text_completion" and out.model == model


def test_streaming_sends_the_same_text_then_usage_then_done(client, model):
    whole = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=NEW, temperature=0,
                                      extra_body=LENGTH).choices[0].text
    chunks = list(client.completions.create(model=model, prompt="The quick brown fox", max_tokens=NEW,
                                            temperature=0, stream=True, stream_options={"include_usage": True},
                                            extra_body=LENGTH))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == whole and len(texts) > 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == NEW


def test_a_token_id_prompt_goes_through_as_it_is(client, model, servers):
    ids = [5, 6, 7, 8, 9]
    out = client.completions.create(model=model, prompt=ids, max_tokens=4, temperature=0, extra_body=LENGTH)
    assert out.choices[0].token_ids == _direct(servers, ids, 4)
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 4


def test_several_prompts_answer_one_choice_each(client, model, servers):
    prompts = [[5, 6, 7], [10, 11, 12, 13]]
    out = client.completions.create(model=model, prompt=prompts, max_tokens=3, temperature=0, extra_body=LENGTH)
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.token_ids for c in out.choices] == [_direct(servers, p, 3) for p in prompts]
    assert out.usage.prompt_tokens == 7 and out.usage.completion_tokens == 6


def test_a_multibyte_prompt_is_tokenized_and_counted(client, model, codec):
    out = client.completions.create(model=model, prompt="é漢字🙂", max_tokens=2, temperature=0, extra_body=LENGTH)
    assert out.usage.prompt_tokens == len(codec.encode("é漢字🙂")) > len("é漢字🙂") + 1


def test_chat_streams_the_same_answer_as_it_returns_whole(client, model, codec):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, how are you?"}]
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=NEW, temperature=0,
                                           extra_body=LENGTH)
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].finish_reason == "length"
    prompt = codec.chat(messages)
    assert whole.usage.prompt_tokens == len(prompt) and whole.usage.completion_tokens == NEW
    assert whole.choices[0].message.content == codec.decode(whole.choices[0].token_ids)
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_completion_tokens=NEW,
                                                 temperature=0, stream=True, stream_options={"include_usage": True},
                                                 extra_body=LENGTH))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == len(prompt) and chunks[-1].usage.completion_tokens == NEW


def test_a_seeded_sample_repeats_and_another_seed_differs(client, model):
    def sample(seed):
        return client.completions.create(model=model, prompt="Once upon a time", max_tokens=16, temperature=1.0,
                                         seed=seed, extra_body=LENGTH).choices[0].token_ids
    first = sample(1234)
    assert sample(1234) == first
    assert sample(99) != first


def test_a_stop_string_cuts_the_text_and_ends_the_call_at_its_token(client, model, codec):
    base = client.completions.create(model=model, prompt="Paris is the", max_tokens=16, temperature=0,
                                     extra_body=LENGTH).choices[0]
    text = base.text
    at = next((i for i in range(len(text) // 3, len(text) - 1) if "\ufffd" not in text[i:i + 2]), None)
    assert at is not None, text  # a piece of plain text to stop at, past the start
    stop = text[at:at + 2]
    want = text[:text.find(stop)]
    for stream in (False, True):
        kwargs = {"model": model, "prompt": "Paris is the", "max_tokens": 16, "temperature": 0,
                  "stop": [stop, "\x00never"], "extra_body": LENGTH}
        if stream:
            chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
            got = "".join(c.choices[0].text for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            used = chunks[-1].usage.completion_tokens
        else:
            out = client.completions.create(**kwargs)
            got, reason, used = out.choices[0].text, out.choices[0].finish_reason, out.usage.completion_tokens
        assert (got, reason) == (want, "stop"), stream
        # the call ended at the token that completed the match: the ids before it do not hold the stop string yet
        assert stop in codec.decode(base.token_ids[:used]) and stop not in codec.decode(base.token_ids[:used - 1])


def test_a_stop_string_completed_by_the_last_allowed_token_is_stop_not_length(client, model, codec):
    """The decode server's last message says "length" too; the stop string, matched on that same token, wins."""
    ids = client.completions.create(model=model, prompt="Paris is the", max_tokens=16, temperature=0,
                                    extra_body=LENGTH).choices[0].token_ids

    def ends_new(k):  # the last two characters of the first k tokens' text, appearing there for the first time
        stop = codec.decode(ids[:k])[-2:]
        return len(stop) == 2 and "\ufffd" not in stop and stop not in codec.decode(ids[:k - 1])
    k = next((k for k in range(len(ids), 1, -1) if ends_new(k)), None)
    assert k is not None, codec.decode(ids)
    text = codec.decode(ids[:k])
    stop = text[-2:]
    for stream in (False, True):
        kwargs = {"model": model, "prompt": "Paris is the", "max_tokens": k, "temperature": 0, "stop": stop,
                  "extra_body": LENGTH}
        if stream:
            chunks = [c for c in client.completions.create(stream=True, **kwargs) if c.choices]
            got = ("".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason,
                   [t for c in chunks for t in c.choices[0].token_ids])
        else:
            c = client.completions.create(**kwargs).choices[0]
            got = (c.text, c.finish_reason, c.token_ids)
        assert got == (text[:text.find(stop)], "stop", ids[:k]), stream


def test_max_tokens_1_answers_one_token(client, model, servers):
    out = client.completions.create(model=model, prompt=[5, 6, 7], max_tokens=1, temperature=0, extra_body=LENGTH)
    assert out.choices[0].token_ids == _direct(servers, [5, 6, 7], 1) and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 1
    chunks = list(client.completions.create(model=model, prompt=[5, 6, 7], max_tokens=1, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body=LENGTH))
    assert [c.choices[0].finish_reason for c in chunks if c.choices] == ["length"]
    assert chunks[-1].usage.completion_tokens == 1


def test_stop_token_ids_end_the_answer_on_that_id_even_with_ignore_eos(client, model, servers):
    base = _direct(servers, [5, 6, 7], 12)
    j = next((j for j in range(1, len(base)) if base[j] not in base[:j]), None)
    assert j is not None, base  # a token first generated past the start, to stop on
    out = client.completions.create(model=model, prompt=[5, 6, 7], max_tokens=12, temperature=0,
                                    extra_body={**LENGTH, "stop_token_ids": [base[j]]})
    assert out.choices[0].token_ids == base[:j + 1] and out.choices[0].finish_reason == "stop"  # the id is counted
    assert out.usage.completion_tokens == j + 1


# Prompts whose greedy answer from the tiny preset's weights holds the EOS; the rest are searched in order.
EOS_PROMPTS = [[0, 457, 458], [0, 394, 395]] + [[0, a, a + 1] for a in range(2, 512, 7)]


def test_eos_ends_the_answer_unless_ignore_eos(client, model, servers, codec):
    eos, n = codec.tok.eos_token_id, 48
    prompt, base = next(((p, b) for p in EOS_PROMPTS if eos in (b := _direct(servers, p, n))), (None, None))
    assert prompt is not None, "no prompt in EOS_PROMPTS makes the model say EOS: add one"
    j = base.index(eos)
    out = client.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0,
                                    extra_body={"return_token_ids": True}).choices[0]
    assert (out.token_ids, out.finish_reason) == (base[:j + 1], "stop")
    assert out.text == codec.decode(base[:j])  # the EOS is counted, its text not shown
    out = client.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0,
                                    extra_body=LENGTH).choices[0]
    assert (out.token_ids, out.finish_reason) == (base, "length")


def test_32_concurrent_streams_all_complete(servers, model):
    async def one(aclient, i):
        stream = await aclient.completions.create(model=model, prompt=[2 + i, 3 + i, 4 + i], max_tokens=NEW,
                                                  temperature=0, stream=True, stream_options={"include_usage": True},
                                                  extra_body=LENGTH)
        chunks = [c async for c in stream]
        return [c.choices[0].finish_reason for c in chunks if c.choices][-1], chunks[-1].usage.completion_tokens

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{servers[1]}/v1", api_key="unused", max_retries=0,
                                      timeout=300) as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(32)))

    assert asyncio.run(run()) == [("length", NEW)] * 32

