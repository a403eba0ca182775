"""Gaps in the paged pool's tests found by planting bugs (mutation testing), each closed by a unit test on CPU.

What is claimed (and tested here):
- `KVPool.write_layer` lands a layer's positions wherever they start inside a block (a prefill after a reused
  prefix, or a chunk, starts at any offset), and touches nothing else; a row's blocks that follow each other are
  written as one slice (no block index built and uploaded per layer: the gRPC landing's per-layer scatter, #37);
- a lease refused for blocks gives its row back, with a prefix cache as without one;
- a lease short of blocks takes back only as many cached rows as it needs, least recently used first: the others
  stay cached and are still hit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtransfer.engine.pool import KVPool, PoolFull
from kvtransfer.engine.prefix_cache import PrefixCache
from kvtransfer.geometry import CacheGeometry

GEO = CacheGeometry(num_layers=2, kv_heads=2, head_dim=4, dtype=torch.float32)
PAGE = 4


@pytest.mark.parametrize("n", [1, 3, PAGE, PAGE + 1, 2 * PAGE + 3])
def test_write_layer_lands_positions_at_every_offset_inside_a_block(n):
    """Guards the choice between write_layer's two paths (position by position from inside a block, whole blocks
    from a block's start): a write starting at any offset lands at exactly p0..p0 + n - 1 of its layer, through
    scattered blocks, and nowhere else (a path taken at the wrong offset writes the data shifted)."""
    for p0 in range(2 * PAGE + 1):
        pool = KVPool(GEO, torch.device("cpu"), slots=2, max_seq=32, page=PAGE, blocks=16)
        np.random.default_rng(p0).shuffle(pool._free_blocks)
        pool.try_lease(32)  # another row's blocks around this one's
        lease = pool.try_lease(p0 + n)
        k, v = torch.randn(1, GEO.kv_heads, n, GEO.head_dim), torch.randn(1, GEO.kv_heads, n, GEO.head_dim)
        pool.write_layer(lease.slot, 1, p0, k, v)
        got_k, got_v = pool.read_layer(lease.slot, 1, p0 + n)
        assert torch.equal(got_k[:, :, p0:], k) and torch.equal(got_v[:, :, p0:], v), (p0, n)
        assert got_k[:, :, :p0].eq(0).all() and got_v[:, :, :p0].eq(0).all(), (p0, n)
        assert pool.kv[0].eq(0).all()  # the other layer
        assert int(pool.kv.ne(0).sum()) == 2 * k.numel(), (p0, n)  # no other position of any row, nor scratch



@pytest.mark.parametrize("ids", [[3, 4, 5, 6, 7], [3, 4, 6, 7, 8], [7, 3, 5, 4, 6], [3, 5, 4, 6, 7]],
                         ids=["run", "gap", "shuffled", "ends-of-a-run"])
def test_write_layer_copies_blocks_that_follow_each_other_as_one_slice(ids, monkeypatch):
    """Guards write_layer's slice path: a row whose whole blocks follow each other is written by a plain copy, with
    no block index uploaded (on CUDA a pinned allocation and an H2D copy per layer received; with the indexed
    scatter, it measured ~5x the copy on CPU, bench/probes/grpc_landing.py); blocks with a gap or out of order still
    go through the index (blocks whose first and last would bound a run, but shuffled inside, too). Either way every
    position lands where read_layer finds it, and nowhere else."""
    pool = KVPool(GEO, torch.device("cpu"), slots=2, max_seq=32, page=PAGE, blocks=16)
    pool._free_blocks = [b for b in range(16) if b not in ids] + ids[::-1]  # pop() hands out `ids` in order
    n = 4 * PAGE + 2  # 4 whole blocks and 2 positions of the fifth
    lease = pool.try_lease(n)
    assert lease.blocks == ids
    uploads = []
    up = pool._up
    monkeypatch.setattr(pool, "_up", lambda t: uploads.append(t) or up(t))
    k, v = torch.randn(1, GEO.kv_heads, n, GEO.head_dim), torch.randn(1, GEO.kv_heads, n, GEO.head_dim)
    pool.write_layer(lease.slot, 1, 0, k, v)
    assert len(uploads) == (0 if ids == [3, 4, 5, 6, 7] else 1)
    got_k, got_v = pool.read_layer(lease.slot, 1, n)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    assert int(pool.kv.ne(0).sum()) == 2 * k.numel()  # no other block, layer or the scratch block

def test_a_lease_refused_for_blocks_through_the_prefix_cache_gives_its_row_back():
    """Guards try_lease's keeper path: the row it took before finding too few blocks goes back to the free rows.
    Kept, every refusal would leak a row until no request could be admitted at all."""
    pool = KVPool(GEO, torch.device("cpu"), slots=2, max_seq=32, page=PAGE, blocks=4)
    PrefixCache(pool, 0.0, block=PAGE)
    for _ in range(3):
        with pytest.raises(PoolFull):
            pool.try_lease(32)  # 8 blocks of a pool of 4
    assert pool.used() == 0 and pool.free_blocks() == 4
    a, b = pool.try_lease(8), pool.try_lease(8)  # both rows, both still there
    assert {a.slot, b.slot} == {0, 1} and pool.free_blocks() == 0
    a.release()
    b.release()
    assert pool.used() == 0 and pool.free_blocks() == 4


def test_a_lease_short_of_blocks_takes_back_only_the_cached_rows_it_needs():
    """Guards PrefixCache.free_blocks_locked's stopping rule: cached rows are taken back, least recently used
    first, only while free blocks run short. One taken too many loses a cached context that the next turn would
    have claimed (a full prefill instead of none)."""
    pool = KVPool(GEO, torch.device("cpu"), slots=4, max_seq=32, page=PAGE, blocks=8)
    cache = PrefixCache(pool, 0.0, block=PAGE)
    older, newer = np.arange(1, 9, dtype=np.int64), np.arange(101, 109, dtype=np.int64)  # 2 blocks each
    for tokens in (older, newer):
        lease = cache.acquire(tokens, need=len(tokens))
        lease.keep = tokens
        lease.release()
    assert cache.cached_slots() == 2 and pool.free_blocks() == 4
    big = cache.acquire(np.arange(500, 524), need=24)  # 6 blocks: 4 free, the older row's 2 make 6
    assert len(big.blocks) == 6 and pool.free_blocks() == 0
    assert cache.cached_slots() == 1 and cache.stats.evicted_device == 1
    big.release()
    turn = cache.acquire(np.concatenate([newer, [7, 7]]), need=12)  # the newer context is still there to claim
    assert turn.reuse is not None and turn.reuse.how == "claimed" and turn.reuse.length == 8
    turn.release()
