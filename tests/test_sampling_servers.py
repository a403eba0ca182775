"""Sampling through the servers: a seeded request draws the same tokens in every mode, stop tokens end it, bad
values are refused, and Info names the model and its limits. One float32 gloo pair serves every case (each server
start is ~10 s of a CI core); its decode server also runs requests colocated (mode COLOCATED).

Why these: the first token is drawn on the prefill worker (disaggregated) or in the decode server's own prefill
(colocated, recompute), every later one in the decode step; a seed or position that differed between them, or a
parameter dropped on the way to the prefill worker, shows as tokens that differ between modes or from the
in-process engine.
"""

from __future__ import annotations

import asyncio
import math
import os
import queue

import grpc
import pytest
import torch

from decode_server.client import generate, sampling_message
from kvtransfer.engine.sampler import SamplingParams
from kvtransfer.engine.sequence import Ended, Sequence
from kvtransfer.model.prefill import random_prompt
from proto import kvtransfer_pb2 as pb
from proto import kvtransfer_pb2_grpc as pbg
from support.enginekit import _engine, engine_generate
from support.servers import ROOT, server_pair

S = grpc.StatusCode
PROMPT = random_prompt(512, 21, seed=21)[0].tolist()
SEEDED = {"temperature": 1.0, "top_p": 0.9, "seed": 7}
MODES = ("layerwise", "bulk", "colocated")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    with server_pair(tmp_path_factory.mktemp("sampling"), dtype="float32") as run:
        yield run


def gen(run, n: int = 12, mode: str = "auto", **kw) -> dict:
    sampling = kw.pop("sampling", None)
    return asyncio.run(generate(run.addr, PROMPT, n, mode, sampling=sampling, **kw))


def engine_sampled(model, ids: list[int], p: SamplingParams, n: int) -> list[int]:
    """The same request in this process: the engine the decode server runs, alone (bit-identical logits)."""
    e = _engine(model)
    lease = e.pool.try_lease()
    first = e.prefill(list(ids), lease, False, p).result(timeout=60).first
    q: queue.Queue = queue.Queue()
    e.scheduler.add(Sequence(0, lease, len(ids), first, n - 1, q.put, sampling=p))
    toks = [first]
    while True:
        t = q.get(timeout=60)
        assert not isinstance(t, Ended), t
        toks.append(t.token_id)
        if t.last:
            return toks


def test_a_seeded_request_draws_the_same_tokens_in_every_mode(pair, tiny_fp32):
    want = gen(pair, sampling=sampling_message(**SEEDED))
    assert want["finish_reason"] == "length" and len(want["tokens"]) == 12
    for mode in MODES:
        assert gen(pair, mode=mode, sampling=sampling_message(**SEEDED))["tokens"] == want["tokens"], mode
    # the in-process engine with the parameters as the wire carries them (top_p a float32)
    p = SamplingParams(1.0, float(torch.tensor(0.9, dtype=torch.float32)), 0, 7)
    assert engine_sampled(tiny_fp32, PROMPT, p, 12) == want["tokens"]
    other = gen(pair, sampling=sampling_message(**{**SEEDED, "seed": 8}))
    assert other["tokens"] != want["tokens"]
    greedy = gen(pair)["tokens"]
    assert want["tokens"] != greedy


def test_without_a_seed_the_server_draws_one(pair):
    hot = sampling_message(temperature=2.0)
    assert gen(pair, sampling=hot)["tokens"] != gen(pair, sampling=hot)["tokens"]


def test_temperature_zero_is_greedy_as_before(pair, tiny_fp32):
    want, _ = engine_generate(tiny_fp32, PROMPT, 12)
    assert gen(pair)["tokens"] == want
    for mode in MODES:
        zero = pb.Sampling(temperature=0.0, top_p=0.5, top_k=3, seed=5)  # the rest is ignored at temperature 0
        assert gen(pair, mode=mode, sampling=zero)["tokens"] == want, mode


def test_stop_token_ids_end_early_with_finish_reason_stop(pair):
    full = gen(pair, sampling=sampling_message(**SEEDED))
    toks = full["tokens"]
    assert full["finish_reason"] == "length"
    at = next(i for i in range(3, 12) if toks[i] not in toks[:i])  # a token first made mid-stream
    for mode in MODES:
        got = gen(pair, mode=mode, sampling=sampling_message(**SEEDED), stop_token_ids=[toks[at], 511])
        assert got["tokens"] == toks[:at + 1] and got["finish_reason"] == "stop", mode
        first = gen(pair, mode=mode, sampling=sampling_message(**SEEDED), stop_token_ids=[toks[0]])
        assert first["tokens"] == toks[:1] and first["finish_reason"] == "stop", mode  # the single-message path
    one = gen(pair, n=1, sampling=sampling_message(**SEEDED))
    assert one["tokens"] == toks[:1] and one["finish_reason"] == "length"


BAD = {  # case (a row of docs/errors.md's catalogue) -> (sampling, stop_token_ids, what the message says)
    "temperature_negative": (pb.Sampling(temperature=-1.0), [], "sampling.temperature is -1.0; use a finite value >= 0"),
    "temperature_nan": (pb.Sampling(temperature=math.nan), [], "sampling.temperature is nan"),
    "temperature_inf": (pb.Sampling(temperature=math.inf), [], "sampling.temperature is inf"),
    "top_p_zero": (pb.Sampling(temperature=1.0, top_p=0.0), [], "sampling.top_p is 0.0; use a value in (0, 1]"),
    "top_p_over_1": (pb.Sampling(temperature=1.0, top_p=1.5), [], "sampling.top_p is 1.5"),
    "stop_token_over_vocab": (None, [3, 512], "stop_token_ids: 512 outside the vocabulary [0, 512)"),
    "stop_token_negative": (None, [-1], "stop_token_ids: -1 outside the vocabulary"),
}


def test_the_refusals_are_in_the_catalogue():
    with open(os.path.join(ROOT, "docs", "errors.md")) as f:
        text = f.read()
    assert not [name for name in BAD if f"`{name}`" not in text]


@pytest.mark.parametrize("case", BAD)
def test_bad_sampling_values_are_refused(pair, case):
    sampling, stops, words = BAD[case]
    with pytest.raises(grpc.aio.AioRpcError) as e:
        gen(pair, sampling=sampling, stop_token_ids=stops)
    assert e.value.code() == S.INVALID_ARGUMENT and words in e.value.details(), e.value.details()
    if sampling is not None:  # the prefill server refuses it with the same words
        async def prefill():
            async with grpc.aio.insecure_channel(pair.prefill_addr) as ch:
                await pbg.PrefillStub(ch).Prefill(pb.PrefillRequest(request_id=5, token_ids=[1, 2], sampling=sampling),
                                                  timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            asyncio.run(prefill())
        assert e.value.code() == S.INVALID_ARGUMENT and words in e.value.details(), e.value.details()
    assert len(gen(pair, n=2)["tokens"]) == 2  # still serving


def test_info_names_the_model_and_its_limits(pair):
    async def info():
        async with grpc.aio.insecure_channel(pair.addr) as ch:
            return await pbg.DecodeStub(ch).Info(pb.InfoRequest(), timeout=10)
    r = asyncio.run(info())
    assert (r.model, r.vocab_size, r.context_length, r.max_new_tokens, r.max_prompt_tokens) == (
        "tiny", 512, 4096, 4096, 32768)
    assert 2 <= r.max_seq_len <= r.context_length and list(r.eos_token_ids) == [2]


FILTERS = {"top_k": {"top_k": 3, "seed": 7}, "top_p": {"top_p": 0.9, "seed": 11}}  # each alone, with a seed whose
# first token the filter changes (seed 7 draws the same first token with top_p 0.9 as without it)


@pytest.mark.parametrize("name", FILTERS)
def test_top_k_and_top_p_each_reach_every_path_the_first_token_included(pair, tiny_fp32, name):
    """Each filter alone keeps the same tokens wherever a token is drawn: the first on the prefill worker (layerwise,
    bulk) or in the decode server's own prefill (colocated), every later one in the decode step. A parameter
    dropped on the way to the prefill worker, or by it, shows as a first token that differs disaggregated only."""
    kw = FILTERS[name]
    top_p = float(torch.tensor(kw.get("top_p", 1.0), dtype=torch.float32))  # as the wire carries it
    want = engine_sampled(tiny_fp32, PROMPT, SamplingParams(1.0, top_p, kw.get("top_k", 0), kw["seed"]), 12)
    unfiltered = engine_sampled(tiny_fp32, PROMPT, SamplingParams(1.0, 1.0, 0, kw["seed"]), 12)
    assert want[0] != unfiltered[0]  # the filter changes the first token itself
    for mode in MODES:
        got = gen(pair, mode=mode, sampling=sampling_message(temperature=1.0, **kw))
        assert got["tokens"] == want, (mode, got["tokens"], want)
