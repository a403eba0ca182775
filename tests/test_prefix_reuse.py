"""A request served from a reused prefix against the same request from scratch, in the engine (tiny, float32, CPU).

Claim (docs/prefix-cache.md): the prefix's KV came from another forward (turn 1's prefill and decode steps), and the
rest of the prompt is prefilled after it as a later chunk is, so the slot's cache and the first token's logits equal
a from-scratch prefill's within chunked prefill's tolerance (CHUNK_TOL), and the tokens are equal where the top-2
margin exceeds it. Both prefill paths are covered: between steps (whole / chunked) and riding in the decode steps
(--mixed-prefill).
"""

from __future__ import annotations

import pytest
import torch
from test_chunked_prefill import CHUNK_TOL

from kvtransfer.engine.engine import DecodeEngine, EngineOptions
from kvtransfer.geometry import CacheGeometry
from kvtransfer.model.loaded import LoadedModel
from kvtransfer.model.prefill import prefill, random_prompt
from kvtransfer.model.spec import ModelSpec, load_model
from support.enginekit import serve_turn


@pytest.fixture(scope="module")
def model():
    return load_model(ModelSpec("tiny", "float32", 0))


def engine(model, **kw) -> DecodeEngine:
    lm = LoadedModel(ModelSpec("tiny", "float32"), model, CacheGeometry.from_config(model.config, torch.float32),
                     torch.device("cpu"))
    return DecodeEngine(lm, EngineOptions(max_batch=4, max_seq_len=512, cuda_graphs=False, prefix_cache=True, **kw))


def turn(e: DecodeEngine, prompt: list[int], new: int, reuse: bool = True):
    """(tokens, reused tokens, the slot's cache of the prompt) of one request through the prefix cache."""
    toks, taken, cache = serve_turn(e, prompt, new, reuse)
    return toks, taken.length if taken else 0, cache


def margin(model, ids: list[int]) -> float:
    top2 = prefill(model, torch.tensor([ids]))[1].topk(2).values
    return float(top2[0] - top2[1])


@pytest.mark.parametrize("mixed", [False, True], ids=["between-steps", "mixed"])
def test_the_next_turn_from_the_cache_matches_it_from_scratch(model, mixed):
    opts = {"mixed_prefill": True, "prefill_chunk": 64} if mixed else {}
    e, scratch = engine(model, **opts), engine(model, **opts)
    try:
        p1 = random_prompt(512, 90, seed=40)[0].tolist()
        a1, start, _ = turn(e, p1, 12)
        assert start == 0
        p2 = p1 + a1 + random_prompt(512, 30, seed=41)[0].tolist()  # turn 2: the history and new text
        (kept,) = [en for en in e.cache.index.entries()]
        before = e.pool.kv[:, :, kept.where[1], :, :kept.length].clone()  # turn 1's KV as its steps wrote it
        a2, reused, c2 = turn(e, p2, 12)
        assert reused == len(p1) + len(a1) - 1 == kept.length  # all but the answer's last token (never fed)
        got = torch.stack([torch.stack([k[0, :, :reused], v[0, :, :reused]]) for k, v in c2])
        assert torch.equal(got, before)  # the prefix was used as it was, not prefilled again
        b2, none, s2 = turn(scratch, p2, 12, reuse=False)
        assert none == 0
        for (ka, va), (kb, vb) in zip(c2, s2):
            assert (ka - kb).abs().max() <= CHUNK_TOL and (va - vb).abs().max() <= CHUNK_TOL
        assert margin(model, p2) > CHUNK_TOL  # tiny's margins are far above the tolerance: the tokens are equal
        assert a2 == b2
        p3 = p2 + a2 + random_prompt(512, 20, seed=42)[0].tolist()
        a3, reused3, _ = turn(e, p3, 8)
        assert reused3 == len(p2) + len(a2) - 1 and a3 == turn(scratch, p3, 8, reuse=False)[0]
        assert e.pool.used() == 0 and e.cache.cached_slots() == 1  # one conversation, one cached slot
    finally:
        e.close()
        scratch.close()
