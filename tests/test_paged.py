"""The paged KV pool on CPU: its accounting, its gathers and scatters, and the engine over it.

What is claimed (and tested here):
- a lease takes a row and the blocks its tokens need; rows and blocks are separate limits, and every block comes
  back when the last holder lets go (or is kept, trimmed to the tokens it holds, by the prefix cache);
- `read`/`write`/`read_layer`/`write_layer`/`copy_prefix` move exactly a row's positions through its blocks;
- the engine over a paged pool, its blocks handed out in shuffled order, gives the same tokens and the same logits,
  bit for bit, as over the slot layout (CPU reference kernels: the same values in the same order), whole prompts
  and mixed steps with chunked prompts alike;
- the prefix cache over blocks: claimed, copied and reloaded prefixes hold the bytes they should, and the blocks
  of evicted rows go back to the pool.
"""

from __future__ import annotations

import queue

import numpy as np
import pytest
import torch

from kvtransfer.engine.engine import DecodeEngine
from kvtransfer.engine.pool import KVPool, PoolFull
from kvtransfer.engine.prefix_cache import PrefixCache
from kvtransfer.engine.sequence import Ended, Sequence
from kvtransfer.geometry import CacheGeometry
from kvtransfer.model.prefill import random_prompt
from kvtransfer.model.spec import ModelSpec, load_model
from support.enginekit import cpu_engine

GEO = CacheGeometry(num_layers=2, kv_heads=2, head_dim=4, dtype=torch.float32)


def shuffle_free_blocks(pool: KVPool, seed: int) -> None:
    """Hand the pool's free blocks out in a random order from now on (so a row's blocks are scattered)."""
    rng = np.random.default_rng(seed)
    rng.shuffle(pool._free_blocks)


def test_a_lease_takes_a_row_and_the_blocks_its_tokens_need_and_gives_both_back():
    pool = KVPool(GEO, torch.device("cpu"), slots=3, max_seq=64, page=8, blocks=10)
    assert (pool.width, pool.blocks, pool.free_blocks()) == (8, 10, 10)
    a = pool.try_lease(17)  # 3 blocks
    assert len(a.blocks) == 3 and pool.free_blocks() == 7
    with pytest.raises(PoolFull):
        pool.try_lease(64)  # 8 blocks: 7 free, though two rows are
    assert pool.used() == 1 and pool.free_blocks() == 7  # the refused lease took nothing
    b = pool.try_lease(56)  # 7 blocks
    with pytest.raises(PoolFull):
        pool.try_lease(1)  # a row is free, no block is
    table = pool.table.tolist()
    assert table[a.slot][:3] == a.blocks and table[a.slot][3:] == [pool.null] * 5
    assert table[b.slot][:7] == b.blocks and table[pool.scratch] == [pool.null] * 8
    assert sorted(a.blocks + b.blocks) == list(range(10))
    a.hold()
    a.release()
    assert pool.free_blocks() == 0  # still held
    a.release()
    b.release()
    assert pool.used() == 0 and pool.free_blocks() == 10 and pool.table[:3].eq(pool.null).all()
    c = pool.try_lease()  # None: a whole context
    assert len(c.blocks) == 8
    c.release()


def test_positions_move_through_scattered_blocks():
    pool = KVPool(GEO, torch.device("cpu"), slots=2, max_seq=32, page=4, blocks=16)
    shuffle_free_blocks(pool, 1)
    a, b = pool.try_lease(30), pool.try_lease(30)
    assert a.blocks != sorted(a.blocks)
    data = torch.randn(30, GEO.num_layers, 2, GEO.kv_heads, GEO.head_dim)  # token-major, as the host tier's
    pool.write(a.slot, 0, data[:13])
    pool.write(a.slot, 13, data[13:])
    assert torch.equal(pool.read(a.slot, 0, 30), data) and torch.equal(pool.read(a.slot, 5, 9), data[5:9])
    k, v = pool.read_layer(a.slot, 1, 30)  # (1, heads, 30, dim)
    assert torch.equal(k[0].transpose(0, 1), data[:, 1, 0]) and torch.equal(v[0].transpose(0, 1), data[:, 1, 1])
    pool.write_layer(b.slot, 0, 3, k[:, :, :20], v[:, :, :20])
    kb, vb = pool.read_layer(b.slot, 0, 23)
    assert torch.equal(kb[:, :, 3:], k[:, :, :20]) and torch.equal(vb[:, :, 3:], v[:, :, :20])
    pool.copy_prefix(a.slot, b.slot, 10)  # whole blocks: positions 0..11
    assert torch.equal(pool.read(b.slot, 0, 10), data[:10])
    assert pool.kv[:, :, pool.null].eq(0).all()  # nothing touched the scratch block
    with pytest.raises(ValueError, match="holds 32 positions"):
        pool.read(a.slot, 0, 33)


def test_the_prefix_cache_keeps_a_rows_blocks_trimmed_and_gives_them_back_when_taken():
    pool = KVPool(GEO, torch.device("cpu"), slots=4, max_seq=64, page=4, blocks=20)
    cache = PrefixCache(pool, 0.0, block=4)
    prompt = np.arange(3, 23, dtype=np.int64)  # 20 tokens
    lease = cache.acquire(prompt, need=60)  # 15 blocks reserved (prompt and answer limit)
    assert len(lease.blocks) == 15 and pool.free_blocks() == 5
    data = torch.randn(20, GEO.num_layers, 2, GEO.kv_heads, GEO.head_dim)
    pool.write(lease.slot, 0, data)
    lease.keep = prompt
    lease.release()
    assert cache.cached_slots() == 1 and pool.free_blocks() == 15  # kept: 5 blocks for its 20 tokens
    longer = np.concatenate([prompt, np.arange(100, 110)])
    claimed = cache.acquire(longer, need=40)  # the entry is inside the prompt: claimed, grown to 10 blocks
    assert claimed.reuse.how == "claimed" and claimed.reuse.length == 20 and len(claimed.blocks) == 10
    assert torch.equal(pool.read(claimed.slot, 0, 20), data)
    claimed.keep = prompt[:16]
    claimed.release()
    copied = cache.acquire(prompt[:12].tolist() + [999] * 4, need=16)  # shares 12 of the 16 cached: 3 full blocks
    assert copied.reuse.how == "shared" and torch.equal(pool.read(copied.slot, 0, 12), data[:12])
    assert copied.blocks[:3] == pool.row_blocks(cache.index.entries()[0].where[1])[:3]  # by reference
    assert cache.cached_slots() == 1 and pool.free_blocks() == 20 - 4 - 1 and pool.shared_blocks() == 3
    big = cache.acquire(np.arange(500, 550), need=64)  # 16 blocks: 15 free, the cached row taken back (1 more)
    assert big.reuse is None and cache.cached_slots() == 0 and pool.free_blocks() == 0 and pool.shared_blocks() == 0
    assert torch.equal(pool.read(copied.slot, 0, 12), data[:12])  # its blocks stayed with the request
    for le in (copied, big):
        le.release()
    assert pool.used() == 0 and pool.free_blocks() == 20


def test_the_host_tier_stores_and_reloads_a_paged_row_byte_for_byte():
    from kvtransfer.engine.host_tier import HostTier

    pool = KVPool(GEO, torch.device("cpu"), slots=2, max_seq=64, page=4, blocks=16)
    shuffle_free_blocks(pool, 3)
    cache = PrefixCache(pool, 0.0, block=4)
    cache.host = HostTier(GEO, pool.device, 64 * GEO.bytes_per_token / 2**30, None, page_tokens=8)
    first = np.arange(3, 33, dtype=np.int64)  # 30 tokens
    lease = cache.acquire(first, need=32)
    data = torch.randn(30, GEO.num_layers, 2, GEO.kv_heads, GEO.head_dim)
    pool.write(lease.slot, 0, data)
    lease.keep = first
    lease.release()
    other = cache.acquire(np.arange(700, 760), need=64)  # all 16 blocks: the cached row goes to the host tier
    assert cache.cached_slots() == 0 and cache.stats.evicted_device == 1
    other.release()
    back = cache.acquire(np.concatenate([first, [5, 6]]), need=40)
    assert back.reuse.how == "reloaded" and back.reuse.length == 30
    assert torch.equal(pool.read(back.slot, 0, 30), data)
    back.release()
    assert pool.free_blocks() == 16


# --- the engine over blocks ---

@pytest.fixture(scope="module")
def tiny():
    return load_model(ModelSpec("tiny", "float32", 0), "cpu")


def engine(tiny, **kw) -> DecodeEngine:
    e = cpu_engine(tiny, max_batch=4, max_seq_len=256, **kw)
    if not e.pool.fixed:
        shuffle_free_blocks(e.pool, 7)
    return e


def generate(e: DecodeEngine, prompts, steps=10):
    """Prefill each prompt, decode them together; per prompt (tokens, logits digests)."""
    runs = []
    for p in prompts:
        lease = e.pool.try_lease(len(p) + steps + 1)
        r = e.prefill(p, lease, True).result(timeout=60)
        cache = e.digest(lease.slot, len(p)).result(timeout=60)  # the prompt's KV, read through its blocks
        q = queue.Queue()
        runs.append((r.first, [cache, r.digest], q, Sequence(1, lease, len(p), r.first, steps, q.put, True)))
    for *_, s in runs:
        e.scheduler.add(s)
    out = []
    for first, digests, q, _ in runs:
        toks, digs = [first], digests
        while True:
            t = q.get(timeout=60)
            assert not isinstance(t, Ended), t
            toks.append(t.token_id)
            digs.append(t.logits_digest)
            if t.last:
                break
        out.append((toks, digs))
    return out


PROMPTS = [random_prompt(512, n, seed=n)[0].tolist() for n in (30, 77, 5, 120)]


@pytest.mark.parametrize("mixed", [False, True], ids=["whole-prompts", "mixed-steps"])
@pytest.mark.parametrize("page", [4, 16])
def test_the_engine_over_scattered_blocks_equals_the_slot_layout_bit_for_bit(tiny, page, mixed):
    kw = {"prefill_chunk": 32, "mixed_prefill": True} if mixed else {}
    slots, paged = engine(tiny, **kw), engine(tiny, kv_block_tokens=page, kv_blocks=320 // page, **kw)
    try:
        assert slots.pool.fixed and not paged.pool.fixed
        want = generate(slots, PROMPTS)
        got = generate(paged, PROMPTS)
        assert got == want  # tokens, the prompt's cache digest, every step's logits digest
        assert paged.pool.used() == 0 and paged.pool.free_blocks() == 320 // page
    finally:
        slots.close()
        paged.close()
