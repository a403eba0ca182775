"""The prefill/decode pair in two real processes over gloo: equality with the colocated run."""

from __future__ import annotations

import asyncio
from contextlib import contextmanager

import grpc
import pytest
import torch

from decode_server.client import generate
from kvtransfer.model.prefill import prefill, random_prompt
from kvtransfer.model.spec import ModelSpec, load_model
from kvtransfer.model.streaming import cache_digest, cache_layers
from support.enginekit import engine_generate
from support.servers import colocated_server, server_pair

LENGTHS = [1, 7, 33, 130]


def reference(model, ids: list[int], n: int) -> dict:
    cache, _ = prefill(model, torch.tensor([ids]))
    tokens, digests = engine_generate(model, ids, n)
    return {"tokens": tokens, "logits_digests": digests, "cache_digest": cache_digest(cache_layers(cache))}


def prompts(vocab: int) -> list[list[int]]:
    return [random_prompt(vocab, n, seed=n).view(-1).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def tiny_models():
    return {dt: load_model(ModelSpec("tiny", dt)) for dt in ("float32", "bfloat16")}


@pytest.fixture(scope="module")
def default_pair(tmp_path_factory):
    """The float32 gloo pair, for the tests that only need it serving (each start is ~10 s of a CI core)."""
    with server_pair(tmp_path_factory.mktemp("default"), dtype="float32", prefill_args=["--transport", "gloo"],
                     decode_args=["--transport", "gloo"]) as run:
        yield run


@contextmanager
def pair_for(request, tmp_path, dtype: str, transport: str):
    if (dtype, transport) == ("float32", "gloo"):
        yield request.getfixturevalue("default_pair")
        return
    with server_pair(tmp_path, dtype=dtype, prefill_args=["--transport", transport],
                     decode_args=["--transport", transport]) as run:
        yield run


@pytest.mark.parametrize("dtype,transport", [("float32", "gloo"), ("bfloat16", "gloo"), ("bfloat16", "grpc")])
def test_pair_matches_colocated(request, tmp_path, tiny_models, dtype, transport):
    """Cache byte-equal, tokens and logits bit-identical, in every mode, over each CPU data plane."""
    model = tiny_models[dtype]
    with pair_for(request, tmp_path, dtype, transport) as run:
        for ids in prompts(model.config.vocab_size):
            want = reference(model, ids, 6)
            for mode in ("layerwise", "bulk", "auto", "colocated"):
                got = asyncio.run(generate(run.addr, ids, 6, mode, digest=True, cache_digest=True))
                assert got["tokens"] == want["tokens"], (mode, len(ids))
                assert got["logits_digests"] == want["logits_digests"], (mode, len(ids))
                assert got["cache_digest"] == want["cache_digest"], (mode, len(ids))
                auto = "layerwise" if len(ids) >= 2048 else "bulk"  # prefill_server/policy.py, gloo and grpc
                assert got["timing"]["mode"] == ("colocated" if mode == "colocated" else
                                                 auto if mode == "auto" else mode)


def test_grouped_layers_and_concurrency(tmp_path, tiny_models):
    """8+ concurrent requests of different lengths, layers grouped 3 per message: caches byte-equal, tokens equal.

    Decoded in batches, so logits are not compared bit for bit (the batch-vs-alone tolerance is test_engine's)."""
    model = tiny_models["float32"]
    ids_list = [random_prompt(model.config.vocab_size, n, seed=100 + n).view(-1).tolist()
                for n in [3, 17, 64, 1, 90, 5, 41, 128, 8, 77]]
    wants = [reference(model, ids, 5) for ids in ids_list]

    async def all_at_once(addr):
        return await asyncio.gather(*[generate(addr, ids, 5, "layerwise" if i % 2 else "bulk", digest=True,
                                               cache_digest=True) for i, ids in enumerate(ids_list)])

    with server_pair(tmp_path, prefill_args=["--layers-per-message", "3"]) as run:
        for got, want in zip(asyncio.run(all_at_once(run.addr)), wants):
            assert got["tokens"] == want["tokens"]
            assert got["cache_digest"] == want["cache_digest"]


def test_colocated_server(tmp_path, tiny_models):
    model = tiny_models["float32"]
    ids = prompts(model.config.vocab_size)[2]
    want = reference(model, ids, 4)
    with colocated_server(tmp_path) as run:
        got = asyncio.run(generate(run.addr, ids, 4, "auto", digest=True, cache_digest=True))
    assert got["tokens"] == want["tokens"] and got["logits_digests"] == want["logits_digests"]
    assert got["timing"]["mode"] == "colocated"


def test_handshake_refuses_other_model(tmp_path):
    """A prefill peer with other weights (another seed) is refused with a message naming the fix."""
    with server_pair(tmp_path, prefill_args=["--seed", "1"], wait=False) as run:
        decode = run.procs[1]
        decode.wait(timeout=120)
        assert decode.returncode != 0
        text = run.log_text()
        assert "weights_fingerprint" in text and "--seed" in text


def test_bad_requests_get_clear_status(default_pair):
    """On the float32 gloo pair of test_pair_matches_colocated: each refused, and the pair serves on."""
    run = default_pair
    for ids, n, code, words in [([], 4, grpc.StatusCode.INVALID_ARGUMENT, "empty prompt"),
                                ([1, 10**6], 4, grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
                                ([1, 2], 0, grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens")]:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            asyncio.run(generate(run.addr, ids, n))
        assert e.value.code() == code and words in e.value.details()
    assert len(asyncio.run(generate(run.addr, [1, 2, 3], 3))["tokens"]) == 3


def test_auto_mode_policy_is_measured_per_transport():
    from prefill_server import policy
    assert policy.choose("grpc", -1, 1024) == "bulk" and policy.choose("grpc", -1, 4096) == "layerwise"
    assert policy.choose("nccl", -1, 32768) == "bulk"  # until the tuned layer-wise path is measured on 2 GPUs
    assert policy.choose("nccl", 0, 1) == "layerwise"  # --layerwise-min-tokens overrides the table
