"""Chunked local prefill (--prefill-chunk): what equals the whole prefill, and within what tolerance.

Claim: a prompt no longer than one chunk runs exactly the whole prefill (bit-identical first token logits and
cache). A longer prompt, prefilled chunk by chunk, attends over the same keys in other kernel shapes: its first
token's logits and its cache agree with the whole prefill within CHUNK_TOL (fp32, CPU), and its greedy tokens
are equal (tiny's top-2 margins are far above that).
"""

from __future__ import annotations

import torch

from kvtransfer.engine.engine import DecodeEngine, EngineOptions
from kvtransfer.geometry import CacheGeometry
from kvtransfer.model.loaded import LoadedModel
from kvtransfer.model.prefill import random_prompt
from kvtransfer.model.spec import ModelSpec, load_model

CHUNK_TOL = 1e-4  # fp32 max |diff| of first-token logits and of cache values (measured ~1e-6 on tiny)


def engine(chunk: int) -> DecodeEngine:
    model = load_model(ModelSpec("tiny", "float32", 0))
    lm = LoadedModel(ModelSpec("tiny", "float32"), model, CacheGeometry.from_config(model.config, torch.float32),
                     torch.device("cpu"))
    return DecodeEngine(lm, EngineOptions(max_batch=2, max_seq_len=512, cuda_graphs=False, prefill_chunk=chunk))


def prefilled(e: DecodeEngine, ids: list[int]):
    lease = e.pool.try_lease()
    r = e.prefill(ids, lease, True).result(timeout=60)
    cache = [(k.clone(), v.clone()) for k, v in e.pool.views(lease.slot, len(ids))]
    lease.release()
    return r, cache


def test_chunked_prefill_agrees_with_whole_prefill():
    whole, chunked = engine(0), engine(64)
    try:
        short = random_prompt(512, 40, seed=2)[0].tolist()
        a, ca = prefilled(whole, short)
        b, cb = prefilled(chunked, short)
        assert (a.first, a.digest) == (b.first, b.digest)  # one chunk: the very same forward
        assert all(torch.equal(x, y) for (x, _), (y, _) in zip(ca, cb))
        ids = random_prompt(512, 300, seed=3)[0].tolist()  # 5 chunks of 64 (the last one short)
        a, ca = prefilled(whole, ids)
        b, cb = prefilled(chunked, ids)
        assert a.first == b.first
        for (ka, va), (kb, vb) in zip(ca, cb):
            assert (ka - kb).abs().max() <= CHUNK_TOL and (va - vb).abs().max() <= CHUNK_TOL
    finally:
        whole.close()
        chunked.close()


def test_decode_steps_run_between_chunks():
    """A running sequence advances while a long prompt is prefilled in chunks (the point of chunking)."""
    import queue

    from kvtransfer.engine.sequence import Sequence

    e = engine(32)
    try:
        lease = e.pool.try_lease()
        r = e.prefill([1, 2, 3], lease, False).result(timeout=60)
        q: queue.Queue = queue.Queue()
        e.scheduler.add(Sequence(1, lease, 3, r.first, 400, q.put))
        q.get(timeout=30)
        before = e.scheduler.steps
        other = e.pool.try_lease()
        e.prefill(random_prompt(512, 320, seed=4)[0].tolist(), other, False).result(timeout=60)
        assert e.scheduler.steps - before >= 9  # 10 chunks: at least one step between each two
        other.release()
    finally:
        e.close()
