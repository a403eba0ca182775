"""Preemption (issue #38) in the engine, on CPU: a paged pool far smaller than what its requests will need.

What is claimed (and tested here):
- rows grow a block at a time as they decode; when a step needs a block and none is free, the newest running request
  (highest rid) is preempted: it ends with Ended(PREEMPTED) and its blocks are free at once, though the step in
  flight and the request still hold its lease; the oldest request always runs to its end;
- a preempted request readmitted as the servicer does it (its context prefilled again into a new lease, decoding on
  from the last token it made, its index and its draw positions continued) makes the tokens an unpressured run
  makes (the tiny model's margins are far above the recompute tolerance), with no token repeated or lost;
- seeded sampling continues after a preemption: the same tokens as unpressured;
- every block comes back once everything ended.
The servers' side (admission ahead of new arrivals, the client's stream, Load): tests/test_preempt_servers.py.
"""

from __future__ import annotations

import queue
from collections import deque

import pytest
import torch

from kvtransfer.engine.engine import DecodeEngine
from kvtransfer.engine.pool import PoolFull
from kvtransfer.engine.sampler import SamplingParams
from kvtransfer.engine.sequence import EndCause, Ended, Sequence
from kvtransfer.model.prefill import random_prompt
from kvtransfer.model.spec import ModelSpec, load_model
from support.enginekit import cpu_engine

PAGE = 4


@pytest.fixture(scope="module")
def tiny():
    return load_model(ModelSpec("tiny", "float32", 0), "cpu")


def engine(tiny, blocks: int, **kw) -> DecodeEngine:
    return cpu_engine(tiny, max_batch=4, max_seq_len=64, kv_block_tokens=PAGE, kv_blocks=blocks, **kw)


def run(e: DecodeEngine, prompts, new: int, sampling=None, reloads=None):
    """Each prompt decodes `new` tokens, all sent at once; each takes a lease as admission does (its context and a
    block of reserve, in arrival order) and a preempted one is readmitted as decode_server does it, ahead of the
    others (with a prefix cache, through it: a swapped context is reloaded, the rest prefilled). Returns (per
    prompt its tokens, the (rid, how) preempted in order); `reloads` gets (context, its row's KV once reloaded,
    whether that was the whole context)."""
    q: queue.Queue = queue.Queue()
    made, leases, preempted = {}, {}, []
    swaps = e.cache is not None and e.cache.host is not None
    waiting = deque((rid, p) for rid, p in enumerate(prompts, 1))  # (rid, context: its last token's KV not made)

    def admit():
        while waiting:
            rid, tokens = waiting[0]
            try:
                lease = (e.cache.acquire(tokens, rid in made, None, len(tokens) + PAGE) if e.cache is not None
                         else e.pool.try_lease(len(tokens) + PAGE))
            except PoolFull:
                return
            waiting.popleft()
            if rid not in made:  # a new request: the prompt's prefill chooses its first token
                made[rid] = [e.prefill(tokens, lease, False, sampling).result(timeout=60).first]
                tokens = tokens + made[rid][-1:]
            else:
                reused = lease.reuse.length if lease.reuse is not None else 0
                if reused and reloads is not None:
                    reloads.append((tokens[:reused], e.pool.read(lease.slot, 0, reused).clone(),
                                    reused == len(tokens) - 1))
                if reused < len(tokens) - 1:  # its first token is one already made
                    e.prefill(tokens[:-1], lease, False, None, reused).result(timeout=60)
            leases[rid] = lease
            lease.hold()
            e.scheduler.add(Sequence(rid, lease, len(tokens) - 1, tokens[-1], new - len(made[rid]),
                                     lambda item, rid=rid: q.put((rid, item)), index=len(made[rid]) - 1,
                                     sampling=sampling, tokens=list(tokens) if swaps else None))
    admit()
    live = len(prompts)
    while live:
        rid, item = q.get(timeout=120)
        if isinstance(item, Ended):
            assert item.cause is EndCause.PREEMPTED, item
            preempted.append((rid, item.reason))
            leases.pop(rid).release()  # the request's own hold (freeing nothing: the blocks went already)
            waiting.appendleft((rid, prompts[rid - 1] + made[rid]))
        else:
            assert item.index == len(made[rid]), (rid, item.index, len(made[rid]))  # nothing repeated or lost
            made[rid].append(item.token_id)
            if item.last:
                leases.pop(rid).release()
                live -= 1
        admit()
    return [made[r] for r in range(1, len(prompts) + 1)], preempted


PROMPTS = [random_prompt(512, n, seed=n)[0].tolist() for n in (9, 14, 6, 11)]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_the_newest_request_is_preempted_and_continues_as_if_unpressured(tiny, sampled):
    sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=1234) if sampled else None
    roomy, tight = engine(tiny, 64), engine(tiny, 14)  # 14 blocks of 4: two requests of 40 tokens do not fit
    try:
        want, none = run(roomy, PROMPTS, 30, sampling)
        assert none == []
        got, preempted = run(tight, PROMPTS, 30, sampling)
        assert preempted and preempted[0][0] != 1  # the oldest request is never the first victim
        assert {how for _, how in preempted} == {"recompute"}
        assert got == want
        assert all(len(t) == 30 for t in got)
        assert tight.pool.used() == 0 and tight.pool.free_blocks() == 14
    finally:
        roomy.close()
        tight.close()


def test_a_preempted_lease_frees_its_blocks_at_once_and_nothing_when_let_go(tiny):
    e = engine(tiny, 6)
    try:
        a = e.pool.try_lease(8)  # 2 blocks
        b = e.pool.try_lease(16)  # 4 blocks: the pool is full
        b.hold()  # e.g. the step in flight
        with e.pool._lock:
            e.pool.preempt_locked(b)
        assert e.pool.free_blocks() == 4 and e.pool.used() == 1
        c = e.pool.try_lease(16)  # b's blocks and row, at once
        b.release()
        b.release()  # its last holder: frees nothing (c holds them now)
        assert e.pool.free_blocks() == 0 and e.pool.used() == 2
        for le in (a, c):
            le.release()
        assert e.pool.free_blocks() == 6 and e.pool.used() == 0
    finally:
        e.close()


HOST_GIB = 16 * 256 * 1024 / 2**30  # 16 host-tier pages of 256 tokens (tiny: 1 KiB a token)


def test_a_swapped_request_gets_its_bytes_back_and_continues_as_unpressured(tiny):
    """With the host tier, a preempted context is copied out and reloaded on resume: the row then holds exactly the
    bytes it held when preempted, and every request makes the tokens it makes unpressured."""
    roomy = engine(tiny, 64)
    tight = engine(tiny, 14, prefix_cache=True, host_cache_gib=HOST_GIB)
    tight.cache.speeds = None  # the break-even rule out of the way: every context that fits the tier is swapped
    swapped_out = {}
    store = tight.cache.swap_out_locked

    def spy(slot, tokens, hashed=None):  # the preempted row's bytes, as the swap finds them (a context shorter than
        data = tight.pool.read(slot, 0, len(tokens)).clone()  # a prefix block is not swapped: recomputed)
        if store(slot, tokens, hashed):
            swapped_out[tuple(tokens.tolist())] = data
            return True
        return False
    tight.cache.swap_out_locked = spy
    try:
        want, _ = run(roomy, PROMPTS, 30)
        reloads = []
        got, preempted = run(tight, PROMPTS, 30, reloads=reloads)
        assert got == want
        assert "swap" in {how for _, how in preempted} and tight.cache.stats.swapped == len(swapped_out) > 0
        assert len(reloads) == len(swapped_out)
        for tokens, data, whole in reloads:
            assert whole  # the whole context came back: nothing of it prefilled again
            assert torch.equal(data, swapped_out[tuple(tokens)])  # bit for bit
        assert tight.pool.used() == 0 and tight.pool.free_blocks() + tight.cache.cached_blocks() == 14
    finally:
        roomy.close()
        tight.close()


def test_a_preemption_wakes_the_admission_queue_with_what_is_left_of_the_victims_blocks():
    from kvtransfer.engine.pool import KVPool
    from kvtransfer.engine.preempt import make_room
    from kvtransfer.geometry import CacheGeometry

    pool = KVPool(CacheGeometry(1, 1, 2, torch.float32), torch.device("cpu"), slots=2, max_seq=16, page=PAGE,
                  blocks=4)
    old, new = pool.try_lease(8), pool.try_lease(8)  # 2 blocks each: the pool is full
    ended, wakes = [], []
    pool.subscribe(lambda: wakes.append(pool.free_blocks()))

    def end(s, item):
        s.over = True
        s.lease.release()
        ended.append((s.rid, item.cause))
    running = [Sequence(1, old, 8, 0, 5, print), Sequence(2, new, 7, 0, 5, print)]  # rid 1 crosses into block 3
    assert make_room(running, end) == 1
    assert ended == [(2, EndCause.PREEMPTED)] and len(old.blocks) == 3
    assert wakes == [1]  # once, after the rows grew: the victim's other block is free for a waiter


def test_a_row_preempted_for_an_older_one_is_not_grown_and_preempts_nobody_else():
    """Guards make_room's skip of a crossing row already preempted in the same pass: two rows cross into a new
    block at once and one block is free after the newer is preempted for the older. Grown anyway, the newer's
    freed row would take blocks back (held by a row on the free list) or, finding none, preempt the oldest
    request too."""
    from kvtransfer.engine.pool import KVPool
    from kvtransfer.engine.preempt import make_room
    from kvtransfer.geometry import CacheGeometry

    pool = KVPool(CacheGeometry(1, 1, 2, torch.float32), torch.device("cpu"), slots=3, max_seq=16, page=PAGE,
                  blocks=5)
    old, new = pool.try_lease(8), pool.try_lease(8)  # 2 blocks each, 1 free
    extra = pool.try_lease(4)  # the free one, taken: both rows will find none
    ended = []

    def end(s, item):
        s.lease.release()
        ended.append((s.rid, item.cause))
    running = [Sequence(1, old, 8, 0, 5, print), Sequence(2, new, 8, 0, 5, print)]  # both cross into block 3
    assert make_room(running, end) == 1
    assert ended == [(2, EndCause.PREEMPTED)] and not running[0].over and len(old.blocks) == 3
    assert pool.row_blocks(new.slot) == [] and pool.free_blocks() == 1  # the victim's other block, free
    for le in (old, extra):
        le.release()
    assert pool.used() == 0 and pool.free_blocks() == 5


def test_a_row_whose_last_token_is_queued_is_never_the_victim():
    """Guards make_room's choice of victim: the newest running request that still has tokens to make. The newest
    row here has its last token in the step in flight (remaining 0) and frees its blocks at that delivery;
    preempted instead, it would throw that token away and prefill its whole context again for one token."""
    from kvtransfer.engine.pool import KVPool
    from kvtransfer.engine.preempt import make_room
    from kvtransfer.geometry import CacheGeometry

    pool = KVPool(CacheGeometry(1, 1, 2, torch.float32), torch.device("cpu"), slots=3, max_seq=16, page=PAGE,
                  blocks=6)
    leases = [pool.try_lease(8) for _ in range(3)]  # 2 blocks each: the pool is full
    ended = []

    def end(s, item):
        s.lease.release()
        ended.append((s.rid, item.cause))
    running = [Sequence(1, leases[0], 8, 0, 5, print), Sequence(2, leases[1], 7, 0, 5, print),
               Sequence(3, leases[2], 7, 0, 0, print)]  # rid 1 crosses into block 3; rid 3 ends at the next delivery
    assert make_room(running, end) == 1
    assert ended == [(2, EndCause.PREEMPTED)] and len(leases[0].blocks) == 3 and not running[2].over
