"""The prefix cache's bookkeeping and copies, on a small CPU pool (no model): hit, miss, partial hit, claim vs
copy, eviction to the host tier and reload (byte for byte), the break-even rule, a poisoned entry never used,
the least-recently-used order kept by copies and partial reloads too (a hot shared opening outlives a colder
entry), a copy's source never taken back for it, the device before the host at equal length, and the pool's
accounting through all of it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtransfer.engine.pool import KVPool, PoolFull
from kvtransfer.engine.prefix_cache import DEVICE, HOST, PrefixCache
from kvtransfer.engine.prefix_index import PrefixIndex, block_keys, common_prefix
from kvtransfer.engine.reload_rule import Speeds
from kvtransfer.geometry import CacheGeometry

GEO = CacheGeometry(num_layers=2, kv_heads=2, head_dim=4, dtype=torch.float32)
B = 4  # block tokens in these tests
PAGE = 8


def ids(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 1000, n).astype(np.int64)


def make(slots: int = 3, max_seq: int = 64, host_pages: int = 0) -> PrefixCache:
    pool = KVPool(GEO, torch.device("cpu"), slots, max_seq)
    gib = host_pages * PAGE * GEO.bytes_per_token / 2**30
    cache = PrefixCache(pool, 0.0, block=B)
    if host_pages:
        from kvtransfer.engine.host_tier import HostTier
        cache.host = HostTier(GEO, pool.device, gib, None, page_tokens=PAGE)
    return cache


def fill(cache: PrefixCache, slot: int, n: int, salt: float) -> torch.Tensor:
    """Write distinct values into the slot's first n positions; returns them, (layers, 2, heads, n, dim)."""
    kv = cache.pool.kv[:, :, slot, :, :n]
    kv.copy_(torch.arange(kv.numel(), dtype=torch.float32).view(kv.shape) + salt)
    return kv.clone()


def finish(cache: PrefixCache, lease, tokens: np.ndarray, salt: float) -> torch.Tensor:
    """A request that held `lease` ends with `tokens`' KV in its slot."""
    kv = fill(cache, lease.slot, len(tokens), salt)
    lease.keep = tokens
    lease.release()
    return kv


# --- the index ---

def test_block_keys_chain_and_common_prefix():
    a, b = ids(12, 1), ids(12, 1)
    b[9] += 1
    ka, kb = block_keys(a, B), block_keys(b, B)
    assert len(ka) == 3 and ka[:2] == kb[:2] and ka[2] != kb[2]  # a change in block 2 changes key 2 on
    c = a.copy()
    c[0] += 1
    assert block_keys(c, B)[2] != ka[2]  # and a change in block 0 changes every later key (the chain)
    assert common_prefix(a, b) == 9 and common_prefix(a, a[:5]) == 5


def test_match_takes_the_longest_verified_prefix_past_the_last_block():
    idx = PrefixIndex(B)
    base = ids(20, 2)
    idx.add("short", base[:8])
    idx.add("long", base[:18])
    prompt = np.concatenate([base[:14], ids(6, 3)])
    m = idx.match(prompt)
    assert [x.entry.where for x in m] == ["long"] and m[0].length == 14  # 3 whole blocks, then token by token
    assert idx.match(ids(20, 4)) == []
    assert idx.add("tiny", base[:B - 1]) is None and "tiny" not in idx  # no whole block: nothing to match


def test_a_poisoned_entry_is_never_used():
    idx = PrefixIndex(B)
    good = ids(16, 5)
    e = idx.add("bad", good)
    e.tokens[2] += 1  # its tokens no longer say what its keys do (corruption)
    assert idx.match(good) == []
    assert idx.poisoned == 1 and "bad" not in idx


def test_lru_order_and_pins():
    idx = PrefixIndex(B)
    for w in "abc":
        idx.add(w, ids(8, ord(w)))
    idx.touch("a")
    assert idx.oldest().where == "b"
    idx._lru["b"].pins = 1
    assert idx.oldest().where == "c"


# --- the cache over a pool ---

def test_a_finished_slot_is_cached_and_claimed_by_the_next_turn():
    cache = make()
    pool = cache.pool
    turn1 = ids(20, 6)
    lease = cache.acquire(turn1)
    assert lease.reuse is None and pool.used() == 1
    kv = finish(cache, lease, turn1, 0.5)
    assert pool.used() == 0 and cache.cached_slots() == 1
    turn2 = np.concatenate([turn1, ids(7, 7)])
    lease2 = cache.acquire(turn2)
    assert lease2.slot == lease.slot and lease2.reuse.how == "claimed" and lease2.reuse.length == 20
    assert lease2.reuse.tier == DEVICE and torch.equal(pool.kv[:, :, lease2.slot, :, :20], kv)
    assert cache.cached_slots() == 0 and pool.used() == 1
    lease2.release()  # ends without keep (a failure before its prefill finished): freed, not cached
    assert pool.used() == 0 and cache.cached_slots() == 0 and len(pool._free) == 3


def test_the_last_prompt_token_is_always_prefilled():
    cache = make()
    t = ids(16, 8)
    finish(cache, cache.acquire(t), t, 0.0)
    again = cache.acquire(t)  # the same prompt: all but its last token reused, the slot claimed
    assert again.reuse.length == 15 and again.reuse.how == "claimed"


def test_a_shared_prefix_is_copied_and_stays_cached():
    cache = make()
    pool = cache.pool
    system = ids(12, 9)
    a = np.concatenate([system, ids(10, 10)])
    la = cache.acquire(a)
    kv = finish(cache, la, a, 1.0)
    b = np.concatenate([system, ids(9, 11)])  # shares the first 12 tokens with the cached 22
    lb = cache.acquire(b)
    assert lb.slot != la.slot and lb.reuse.how == "copied" and lb.reuse.length == 12
    assert lb.reuse.bytes == 12 * GEO.bytes_per_token
    assert torch.equal(pool.kv[:, :, lb.slot, :, :12], kv[:, :, :, :12])
    assert (la.slot, ) == tuple(e.where[1] for e in cache.index.entries())  # the source is still cached


def test_miss_skip_and_suffix_limit():
    cache = make()
    t = ids(20, 12)
    finish(cache, cache.acquire(t), t, 0.0)
    longer = np.concatenate([t, ids(30, 13)])
    for take in (lambda: cache.acquire(ids(20, 14)),  # a miss
                 lambda: cache.acquire(longer, reuse=False),  # the request skips the cache
                 lambda: cache.acquire(longer, max_suffix=10)):  # 30 left to prefill: more than allowed
        lease = take()
        assert lease.reuse is None
        lease.release()
    assert cache.acquire(longer, max_suffix=40).reuse.length == 20


def test_the_oldest_cached_slot_is_taken_back_when_none_is_free():
    cache = make(slots=2)
    pool = cache.pool
    a, b = ids(8, 15), ids(8, 16)
    la = cache.acquire(a)
    lb = cache.acquire(b)
    finish(cache, la, a, 0.0)
    finish(cache, lb, b, 0.0)
    cache.acquire(a).release()  # a's slot claimed and freed: it is the free one now
    l1, l2 = cache.acquire(ids(8, 17)), pool.try_lease()  # the free slot, then b's taken back
    assert {l1.slot, l2.slot} == {la.slot, lb.slot} and cache.cached_slots() == 0
    with pytest.raises(PoolFull):
        pool.try_lease()
    assert cache.stats.evicted_device == 1


def test_eviction_to_the_host_tier_and_reload_byte_for_byte():
    cache = make(slots=1, host_pages=8)
    pool = cache.pool
    turn1 = ids(20, 18)
    kv = finish(cache, cache.acquire(turn1), turn1, 2.0)
    other = cache.acquire(ids(10, 19))  # takes the one slot back: turn 1's context goes to the host tier
    assert cache.stats.stored_bytes == 20 * GEO.bytes_per_token and cache.host_bytes() > 0
    assert [e.where[0] for e in cache.index.entries()] == [HOST]
    pool.kv[:, :, other.slot].zero_()
    other.release()
    turn2 = np.concatenate([turn1, ids(5, 20)])
    back = cache.acquire(turn2)
    assert back.reuse.tier == HOST and back.reuse.how == "reloaded" and back.reuse.length == 20
    assert back.reuse.bytes == 20 * GEO.bytes_per_token
    assert torch.equal(pool.kv[:, :, back.slot, :, :20], kv)
    assert cache.host_bytes() == 0 and len(cache.index) == 0  # moved back whole: the host copy is let go
    assert cache.stats.evicted_host == 0


def test_a_partial_host_hit_reloads_only_the_shared_part_and_keeps_the_entry():
    cache = make(slots=1, host_pages=8)
    pool = cache.pool
    system = ids(12, 21)
    a = np.concatenate([system, ids(12, 22)])
    kv = finish(cache, cache.acquire(a), a, 3.0)
    cache.acquire(ids(6, 23)).release()  # pushes a to the host tier
    b = np.concatenate([system, ids(4, 24)])
    lb = cache.acquire(b)
    assert lb.reuse.tier == HOST and lb.reuse.length == 12
    assert torch.equal(pool.kv[:, :, lb.slot, :, :12], kv[:, :, :, :12])
    assert [e.where[0] for e in cache.index.entries()] == [HOST]  # a's 24 tokens stay on the host


def test_the_host_tier_drops_its_oldest_for_room_and_skips_what_cannot_fit():
    cache = make(slots=1, host_pages=4)  # 32 tokens of host pages
    for seed in (30, 31, 32):
        t = ids(16, seed)  # 2 pages each: the third evicts the first
        finish(cache, cache.acquire(t), t, 0.0)
    cache.acquire(ids(4, 33)).release()
    hosts = [e for e in cache.index.entries() if e.where[0] == HOST]
    assert len(hosts) == 2 and cache.stats.evicted_host == 1
    big = ids(40, 34)  # longer than the whole tier
    finish(cache, cache.acquire(big), big, 0.0)
    cache.acquire(ids(4, 35)).release()
    assert not any(e.length == 40 for e in cache.index.entries())


def test_the_break_even_rule_sends_a_host_hit_to_recompute_when_the_link_is_slow():
    cache = make(slots=1, host_pages=8)
    t = ids(20, 36)
    finish(cache, cache.acquire(t), t, 0.0)
    cache.acquire(ids(4, 37)).release()
    bpt = GEO.bytes_per_token
    cache.speeds = Speeds(bpt, reload_bytes_per_s=bpt * 1e3, prefill_s_per_token=1e-4)  # reload 1 ms/token
    assert not cache.speeds.reload_pays(20)
    longer = np.concatenate([t, ids(4, 38)])
    assert cache.acquire(longer).reuse is None and cache.stats.host_recomputed == 1
    cache.speeds = Speeds(bpt, reload_bytes_per_s=bpt * 1e6, prefill_s_per_token=1e-4)
    assert cache.speeds.reload_pays(20) and "reloads" in cache.speeds.describe()


def test_a_slot_released_while_a_request_still_holds_it_is_cached_once():
    cache = make()
    t = ids(12, 39)
    lease = cache.acquire(t)
    lease.hold()  # the scheduler's hold
    lease.keep = t
    lease.release()
    assert cache.cached_slots() == 0 and cache.pool.used() == 1
    lease.release()
    assert cache.cached_slots() == 1 and cache.pool.used() == 0


def test_a_shared_opening_copied_out_counts_as_used_and_outlives_a_colder_entry():
    """A cached context reused by copy (a system prompt every request opens with) stays cached, so it must also be
    marked used: when a slot is next needed the colder entry cached after it goes first, not the hot opening."""
    cache = make(slots=3)
    system = ids(12, 40)
    a = np.concatenate([system, ids(10, 41)])
    kv = finish(cache, cache.acquire(a), a, 4.0)  # the opening's context, cached first (the older entry)
    cold = ids(8, 42)
    finish(cache, cache.acquire(cold), cold, 0.0)  # a one-off, cached after it
    lb = cache.acquire(np.concatenate([system, ids(9, 43)]))  # copies the opening out: its last free slot
    assert lb.reuse.how == "copied" and cache.cached_slots() == 2 and not cache.pool._free
    other = cache.acquire(ids(8, 44))  # no slot free: the least recently used cached one is taken back
    assert cache.stats.evicted_device == 1
    assert [e.tokens.tolist() for e in cache.index.entries()] == [a.tolist()]  # the cold one went, not the opening
    lb.release()
    lc = cache.acquire(np.concatenate([system, ids(6, 45)]))
    assert lc.reuse.how == "copied" and lc.reuse.length == 12
    assert torch.equal(cache.pool.kv[:, :, lc.slot, :, :12], kv[:, :, :, :12])
    other.release()
    assert cache.acquire(cold).reuse is None  # the cold context is gone


def test_a_partial_host_reload_counts_as_used_and_outlives_a_colder_host_entry():
    """The same on the host tier: an entry reloaded in part stays there, marked used, so the tier drops the
    colder entry first when it needs room."""
    cache = make(slots=1, host_pages=4)  # 32 tokens of host pages: two contexts of 16
    system = ids(12, 46)
    a = np.concatenate([system, ids(4, 47)])
    kv = finish(cache, cache.acquire(a), a, 5.0)
    cold = ids(16, 48)
    finish(cache, cache.acquire(cold), cold, 0.0)  # pushes a to the host tier
    cache.acquire(ids(4, 49)).release()  # pushes cold there too: a is the older host entry
    assert [e.where[0] for e in cache.index.entries()] == [HOST, HOST]
    lb = cache.acquire(np.concatenate([system, ids(5, 50)]))  # reloads a's first 12 tokens: a stays on the host
    assert lb.reuse.how == "reloaded" and lb.reuse.length == 12
    third = ids(16, 51)
    lb.keep = None
    lb.release()
    finish(cache, cache.acquire(third), third, 0.0)
    cache.acquire(ids(4, 52)).release()  # third goes to the host tier: the tier is full, its oldest entry drops
    assert cache.stats.evicted_host == 1
    hosted = [e.tokens.tolist() for e in cache.index.entries() if e.where[0] == HOST]
    assert a.tolist() in hosted and cold.tolist() not in hosted, hosted
    back = cache.acquire(np.concatenate([system, ids(3, 53)]))
    assert back.reuse.how == "reloaded" and torch.equal(cache.pool.kv[:, :, back.slot, :, :12], kv[:, :, :, :12])


def test_a_copy_never_takes_back_its_own_source_slot():
    """The entry being copied out is pinned while a slot is found for the copy: with another cached entry, that one
    is taken back even when it is the younger; with none, the entry itself is claimed (nothing copied)."""
    cache = make(slots=2)
    system = ids(12, 60)
    a = np.concatenate([system, ids(10, 61)])
    kv = finish(cache, cache.acquire(a), a, 7.0)  # the older entry
    young = ids(8, 62)
    finish(cache, cache.acquire(young), young, 0.0)
    lb = cache.acquire(np.concatenate([system, ids(5, 63)]))
    assert lb.reuse.how == "copied" and lb.reuse.length == 12 and cache.stats.evicted_device == 1
    assert torch.equal(cache.pool.kv[:, :, lb.slot, :, :12], kv[:, :, :, :12])
    assert [e.tokens.tolist() for e in cache.index.entries()] == [a.tolist()]  # the younger one went
    lc = cache.acquire(np.concatenate([system, ids(6, 64)]))  # no slot to spare: a's slot is claimed
    assert lc.reuse.how == "claimed" and lc.reuse.length == 12 and cache.stats.evicted_device == 1
    assert torch.equal(cache.pool.kv[:, :, lc.slot, :, :12], kv[:, :, :, :12]) and len(cache.index) == 0


def test_at_equal_length_a_device_entry_is_taken_before_a_host_reload():
    """Two cached contexts share the prompt's opening equally, one in the pool and one on the host tier: the pool's is
    taken (a claim or one device copy), not a reload over the host link."""
    cache = make(slots=1, host_pages=8)
    system = ids(12, 65)
    a = np.concatenate([system, ids(8, 66)])
    finish(cache, cache.acquire(a), a, 8.0)
    cache.acquire(ids(4, 67)).release()  # pushes a to the host tier
    b = np.concatenate([system, ids(9, 68)])
    lb = cache.acquire(b)  # a's opening reloaded for b
    assert lb.reuse.tier == HOST and lb.reuse.length == 12
    kv = finish(cache, lb, b, 9.0)  # b cached in the pool, a still on the host
    assert sorted(e.where[0] for e in cache.index.entries()) == [DEVICE, HOST]
    lc = cache.acquire(np.concatenate([system, ids(7, 69)]))
    assert lc.reuse.tier == DEVICE and lc.reuse.length == 12, lc.reuse
    assert torch.equal(cache.pool.kv[:, :, lc.slot, :, :12], kv[:, :, :, :12])


def test_caching_a_row_hashes_only_what_follows_the_prompt_acquire_hashed(monkeypatch):
    """acquire hashes the prompt's blocks once, outside the pool's lock, and the lease keeps them: when the row is
    cached (its release, under the lock) only the blocks after the prompt are hashed (a 32k prompt's ~2,000 blocks
    held the scheduler's lock for ~4-5 ms more). The keys filed are block_keys' of the whole context all the same,
    and a context that does not start with the prompt is hashed whole."""
    import kvtransfer.engine.prefix_index as PI

    hashed, real = [], PI.hashlib.blake2b
    monkeypatch.setattr(PI.hashlib, "blake2b", lambda data, **k: hashed.append(1) or real(data, **k))
    cache = make(max_seq=64)
    for tokens, want in ((ids(21, 30), 0), (ids(41, 31), 5)):  # the prompt itself; the prompt + 20 made tokens:
        prompt = tokens[:21]  # the prompt's 5 whole blocks known, blocks 5..9 hashed
        lease = cache.acquire(prompt)
        hashed.clear()
        lease.keep = tokens.copy()  # the request's own array of the same ids
        lease.release()
        assert len(hashed) == want
        e = cache.index.entries()[-1]
        assert e.keys == block_keys(tokens, B) and cache.index.match(tokens)[0].length == len(tokens)
    lease = cache.acquire(ids(21, 32))
    other = ids(30, 33)  # not the prompt's tokens
    hashed.clear()
    lease.keep = other
    lease.release()
    assert len(hashed) == 30 // B and cache.index.entries()[-1].keys == block_keys(other, B)


def test_a_row_evicted_to_the_host_tier_keeps_its_keys(monkeypatch):
    """A cached row taken back goes to the host tier filed under its device entry's keys: none hashed again (only
    the new prompt's, in its acquire)."""
    import kvtransfer.engine.prefix_index as PI

    hashed, real = [], PI.hashlib.blake2b
    monkeypatch.setattr(PI.hashlib, "blake2b", lambda data, **k: hashed.append(1) or real(data, **k))
    cache = make(slots=1, host_pages=8)
    turn1 = ids(20, 18)
    finish(cache, cache.acquire(turn1), turn1, 2.0)
    hashed.clear()
    cache.acquire(ids(10, 19)).release()  # takes the one slot back: turn 1's context goes to the host tier
    assert len(hashed) == 10 // B
    assert [(e.where[0], e.keys) for e in cache.index.entries()] == [(HOST, block_keys(turn1, B))]
