"""Blocks shared by reference between the prefix cache and requests (issue #38), on CPU.

What is claimed (and tested here):
- N prompts over one long cached opening take its full blocks by reference: the pool holds them once (free blocks,
  `KVPool.shared_blocks`, `PrefixCache.cached_blocks`), each request's row reads the opening, and what the requests
  write after it (their prefill, their decoding) never changes the cached entry's bytes;
- a block is free again only when the last row holding it lets go; a cached row taken back for room leaves its
  shared blocks with the requests holding them; every block comes back in the end;
- an opening taken by reference decodes what one copied does, bit for bit (the slot layout copies): the same
  tokens and logits;
- the router's block keys (prefix_index.block_keys) are not touched by any of it.
"""

from __future__ import annotations

import queue

import numpy as np
import pytest
import torch

from kvtransfer.engine.engine import DecodeEngine
from kvtransfer.engine.pool import KVPool
from kvtransfer.engine.prefix_cache import PrefixCache
from kvtransfer.engine.prefix_index import block_keys
from kvtransfer.engine.sequence import Ended, Sequence
from kvtransfer.geometry import CacheGeometry
from kvtransfer.model.prefill import random_prompt
from kvtransfer.model.spec import ModelSpec, load_model
from support.enginekit import cpu_engine

GEO = CacheGeometry(num_layers=2, kv_heads=2, head_dim=4, dtype=torch.float32)


def test_n_prompts_over_one_opening_hold_its_blocks_once():
    pool = KVPool(GEO, torch.device("cpu"), slots=6, max_seq=64, page=4, blocks=40)
    cache = PrefixCache(pool, 0.0, block=4)
    context = np.arange(1, 39, dtype=np.int64)  # 38 tokens: an opening of 36 and 2 more
    keys = block_keys(context, 16)
    first = cache.acquire(context, need=40)
    data = torch.randn(38, GEO.num_layers, 2, GEO.kv_heads, GEO.head_dim)
    pool.write(first.slot, 0, data)
    first.keep = context
    first.release()
    assert pool.free_blocks() == 30 and cache.cached_blocks() == 10  # 38 tokens: 10 blocks, kept
    entry_row = pool.row_blocks(cache.index.entries()[0].where[1])
    leases = []
    for i in range(4):  # each shares 36 tokens: 9 full blocks by reference, 3 blocks of its own (48 positions)
        le = cache.acquire(np.concatenate([context[:36], [900 + i] * 5]), need=48)
        assert le.reuse.how == "shared" and le.reuse.length == 36 and le.reuse.bytes == 0
        assert le.blocks[:9] == entry_row[:9] and not set(le.blocks[9:]) & set(entry_row)
        assert torch.equal(pool.read(le.slot, 0, 36), data[:36])
        pool.write(le.slot, 36, torch.full((12, GEO.num_layers, 2, GEO.kv_heads, GEO.head_dim), float(i)))
        leases.append(le)
    assert pool.free_blocks() == 30 - 4 * 3 and pool.shared_blocks() == 9 and cache.cached_blocks() == 10
    assert torch.equal(pool.read(cache.index.entries()[0].where[1], 0, 38), data)  # the entry never written
    partial = cache.acquire(np.concatenate([context[:37], [7] * 3]), need=40)  # 37 shared: 9 blocks + a copy
    assert partial.reuse.how == "shared" and partial.reuse.bytes == 1 * GEO.bytes_per_token
    assert partial.blocks[9] not in entry_row and torch.equal(pool.read(partial.slot, 0, 37), data[:37])
    partial.release()
    filler = cache.acquire(np.arange(500, 564), need=64)  # 16 of the 18 free blocks
    big = cache.acquire(np.arange(600, 612), need=12)  # 3 blocks: 2 free, the cached row taken back for the third
    assert cache.cached_slots() == 0 and pool.free_blocks() == 0  # its block 9 freed; blocks 0..8 stay shared
    assert pool.shared_blocks() == 9 and all(torch.equal(pool.read(le.slot, 0, 36), data[:36]) for le in leases)
    for le in [*leases, filler, big]:
        le.release()
    assert pool.used() == 0 and pool.free_blocks() == 40 and pool.shared_blocks() == 0
    assert block_keys(context, 16) == keys


@pytest.fixture(scope="module")
def tiny():
    return load_model(ModelSpec("tiny", "float32", 0), "cpu")


def engine(tiny, **kw) -> DecodeEngine:
    return cpu_engine(tiny, max_batch=4, max_seq_len=128, prefix_cache=True, **kw)


def turn(e: DecodeEngine, prompt: list[int], new: int):
    """One request through the prefix cache, decoded alone; its context kept. (tokens, digests, how it reused)."""
    lease = e.cache.acquire(prompt, True, None, len(prompt) + new)
    start = lease.reuse.length if lease.reuse else 0
    r = e.prefill(prompt, lease, True, None, start).result(timeout=60)
    q: queue.Queue = queue.Queue()
    lease.hold()
    e.scheduler.add(Sequence(0, lease, len(prompt), r.first, new - 1, q.put, True))
    toks, digs = [r.first], [r.digest]
    while not (t := q.get(timeout=60)).last:
        assert not isinstance(t, Ended), t
        toks.append(t.token_id)
        digs.append(t.logits_digest)
    toks.append(t.token_id)
    digs.append(t.logits_digest)
    lease.keep = np.asarray(prompt + toks[:-1])
    lease.release()
    return toks, digs, lease.reuse.how if lease.reuse else None


def test_an_opening_taken_by_reference_decodes_what_a_copied_one_does(tiny):
    opening = random_prompt(512, 40, seed=5)[0].tolist()
    copying, sharing = engine(tiny), engine(tiny, kv_block_tokens=8, kv_blocks=64)
    try:
        runs = {}
        for e in (copying, sharing):
            runs[e] = [turn(e, opening + [3, 1], 6)] + [turn(e, opening + [50 + i] * 3, 6) for i in range(3)]
        assert [how for *_, how in runs[copying]] == [None, "copied", "copied", "copied"]
        assert [how for *_, how in runs[sharing]] == [None, "shared", "shared", "shared"]
        assert [r[:2] for r in runs[copying]] == [r[:2] for r in runs[sharing]]  # tokens and logits, bit for bit
    finally:
        copying.close()
        sharing.close()
