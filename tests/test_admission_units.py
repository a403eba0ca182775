"""The admission queue (decode_server/admission.py) in one event loop over a real KV pool on CPU.

What is claimed (and tested here): waiters get memory in arrival order; a new arrival never takes what a waiter is
owed; a release wakes the head (from any thread), a head that gets its lease wakes the next, and a waiter that
leaves (cancelled, or its deadline passed: DEADLINE_EXCEEDED) passes its turn on; --admission-wait-s and
--max-waiting refuse with RESOURCE_EXHAUSTED naming the flag. The head's periodic re-check is pushed out to 60 s,
so every hand-over here is the queue's own wake-up: a missing one fails at the 10 s guard, which no passing run
comes near (nothing here asserts a duration).
"""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
import torch

from decode_server import admission
from decode_server.admission import AdmissionQueue
from decode_server.peer.remote import RequestError
from kvtransfer.engine.pool import KVPool
from kvtransfer.geometry import CacheGeometry

GUARD_S = 10  # turns a wake-up that never comes into a failure; nothing waits on the clock otherwise


@pytest.fixture(autouse=True)
def no_polling(monkeypatch):
    monkeypatch.setattr(admission, "ADMISSION_RECHECK_S", 60.0)


def pool_of(slots: int) -> KVPool:
    return KVPool(CacheGeometry(1, 1, 2, torch.float32), torch.device("cpu"), slots=slots, max_seq=4)


def far() -> float:
    return time.perf_counter() + 3600


async def until(cond) -> None:
    """Let the loop run until `cond()` (counted in loop turns, not time)."""
    for _ in range(1000):
        if cond():
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition never held")


async def queued(q: AdmissionQueue, n: int) -> list[asyncio.Task]:
    """n waiters, each in the queue before the next arrives."""
    tasks = []
    for _ in range(n):
        tasks.append(asyncio.create_task(q.acquire(far())))
        await until(lambda: q.waiting == len(tasks))
    return tasks


def test_a_release_on_another_thread_wakes_the_head():
    pool = pool_of(1)

    async def scenario():
        q = AdmissionQueue(pool, max_waiting=8)
        held = pool.try_lease()
        (waiter,) = await queued(q, 1)
        threading.Thread(target=held.release).start()
        got = await asyncio.wait_for(waiter, GUARD_S)
        assert got.slot == held.slot and q.waiting == 0
        got.release()
        q.close()
    asyncio.run(scenario())
    assert not pool._listeners


def test_waiters_get_memory_in_arrival_order():
    """Five waiters behind a held slot; each lets go of its lease once it has it: they get it in arrival order."""
    pool = pool_of(1)
    order = []

    async def scenario():
        q = AdmissionQueue(pool, max_waiting=8)
        held = pool.try_lease()
        tasks = await queued(q, 5)

        async def served(i, task):
            lease = await task
            order.append(i)
            await asyncio.sleep(0)
            lease.release()
        held.release()
        await asyncio.wait_for(asyncio.gather(*(served(i, t) for i, t in enumerate(tasks))), GUARD_S)
    asyncio.run(scenario())
    assert order == [0, 1, 2, 3, 4]


def test_a_new_arrival_does_not_take_what_the_head_is_owed():
    """A slot is freed while one request waits, and a new one arrives before the waiter has run: the waiter gets
    the slot, the newcomer waits behind it and gets the next one."""
    pool = pool_of(1)

    async def scenario():
        q = AdmissionQueue(pool, max_waiting=8)
        held = pool.try_lease()
        (first,) = await queued(q, 1)
        held.release()  # the head's wake-up is queued on the loop
        newcomer = asyncio.create_task(q.acquire(far()))  # and runs after this arrival's first step
        lease = await asyncio.wait_for(first, GUARD_S)
        await until(lambda: q.waiting == 1)
        assert not newcomer.done()
        lease.release()
        (await asyncio.wait_for(newcomer, GUARD_S)).release()
    asyncio.run(scenario())


def test_one_release_may_admit_several():
    """Two slots freed in one go, two waiters: both admitted (the head that got one wakes the next)."""
    pool = pool_of(2)

    async def scenario():
        q = AdmissionQueue(pool, max_waiting=8)
        a, b = pool.try_lease(), pool.try_lease()
        tasks = await queued(q, 2)
        a.release()
        b.release()  # both wake-ups queued before either waiter runs: both find the same head
        got = await asyncio.wait_for(asyncio.gather(*tasks), GUARD_S)
        assert sorted(lease.slot for lease in got) == [0, 1]
    asyncio.run(scenario())


def test_a_head_that_leaves_passes_its_turn_on():
    """The head is woken by a release and cancelled before it runs: the next waiter gets the slot."""
    pool = pool_of(1)

    async def scenario():
        q = AdmissionQueue(pool, max_waiting=8)
        held = pool.try_lease()
        first, second = await queued(q, 2)
        held.release()
        first.cancel()
        lease = await asyncio.wait_for(second, GUARD_S)
        assert first.cancelled() and q.waiting == 0 and lease.slot == held.slot
    asyncio.run(scenario())


def test_a_waiter_whose_deadline_passes_leaves_and_the_next_is_served():
    pool = pool_of(1)

    async def scenario():
        q = AdmissionQueue(pool, max_waiting=8)
        held = pool.try_lease()
        short = asyncio.create_task(q.acquire(time.perf_counter() + 0.2))
        await until(lambda: q.waiting == 1)
        behind = asyncio.create_task(q.acquire(far()))
        await until(lambda: q.waiting == 2)
        with pytest.raises(RequestError) as e:
            await asyncio.wait_for(short, GUARD_S)
        assert q.waiting == 1
        held.release()
        (await asyncio.wait_for(behind, GUARD_S)).release()
        return e.value
    err = asyncio.run(scenario())
    assert err.code is grpc.StatusCode.DEADLINE_EXCEEDED, err.message
    assert "waited for KV memory" in err.message and "--max-batch 1" in err.message, err.message


def test_admission_wait_s_refuses_naming_the_flag():
    pool = pool_of(1)

    async def scenario():
        q = AdmissionQueue(pool, max_waiting=8, wait_s=0.1)
        held = pool.try_lease()
        with pytest.raises(RequestError) as e:
            await asyncio.wait_for(q.acquire(far()), GUARD_S)
        assert q.waiting == 0
        held.release()
        return e.value
    err = asyncio.run(scenario())
    assert err.code is grpc.StatusCode.RESOURCE_EXHAUSTED, err.message
    assert "--admission-wait-s" in err.message and "--max-batch 1" in err.message, err.message


def test_a_full_queue_refuses_at_once_naming_the_flag():
    """--max-waiting 2: a third waiter is refused without joining; --max-waiting 0: a free slot is taken, a full pool
    refuses at once."""
    pool = pool_of(1)

    async def scenario():
        q = AdmissionQueue(pool, max_waiting=2)
        held = pool.try_lease()
        tasks = await queued(q, 2)
        with pytest.raises(RequestError) as full:
            await asyncio.wait_for(q.acquire(far()), GUARD_S)
        assert q.waiting == 2
        for t in tasks:
            t.cancel()
        none = AdmissionQueue(pool, max_waiting=0)
        with pytest.raises(RequestError) as zero:
            await asyncio.wait_for(none.acquire(far()), GUARD_S)
        held.release()
        (await asyncio.wait_for(none.acquire(far()), GUARD_S)).release()
        return full.value, zero.value
    full, zero = asyncio.run(scenario())
    assert full.code is grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-waiting 2" in full.message, full.message
    assert zero.code is grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-waiting 0" in zero.message, zero.message


def test_a_resumed_request_goes_ahead_of_a_woken_head_which_waits_its_turn():
    """Preempted requests (resumed=rid) come back ahead of every new arrival, the oldest request first, even ahead
    of a head already woken for memory: the woken one then waits for its turn, yielding the loop (an Event left set
    would make it spin without ever awaiting, and the whole server with it), while the resumed one waits for the
    memory it needs; each is served in that order."""
    pool = KVPool(CacheGeometry(1, 1, 2, torch.float32), torch.device("cpu"), slots=4, max_seq=8, page=2, blocks=4)

    def blocks(n):
        return lambda: pool.try_lease(2 * n)

    async def scenario():
        q = AdmissionQueue(pool, max_waiting=8)
        a, b = pool.try_lease(2), pool.try_lease(6)  # 1 + 3 blocks: the pool is full
        new = asyncio.create_task(q.acquire(far(), blocks(1)))
        await until(lambda: q.waiting == 1)
        r9 = asyncio.create_task(q.acquire(far(), blocks(1), resumed=9))
        await until(lambda: q.waiting == 2)  # ahead of the new arrival: the head now
        a.release()  # one block: wakes r9, whose turn is queued on the loop behind what follows
        r3 = asyncio.create_task(q.acquire(far(), blocks(4), resumed=3))  # older: ahead of r9, needs the whole pool
        ticks = 0

        async def loop_runs():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)
        ticker = asyncio.create_task(loop_runs())
        await until(lambda: ticks > 50)  # the loop turns: nobody spins in it
        assert not (r3.done() or r9.done() or new.done()) and q.waiting == 3
        b.release()
        first = await asyncio.wait_for(r3, GUARD_S)
        assert not r9.done() and not new.done()
        first.release()
        second = await asyncio.wait_for(r9, GUARD_S)
        (await asyncio.wait_for(new, GUARD_S)).release()
        second.release()
        ticker.cancel()
        q.close()
    errors = []

    def body():
        try:
            asyncio.run(scenario())
        except BaseException as e:  # noqa: BLE001 - raised again below, on the test's thread
            errors.append(e)
    loop = threading.Thread(target=body, daemon=True)
    loop.start()  # in a thread: a loop that spins never reaches a guard inside it
    loop.join(GUARD_S)
    assert not loop.is_alive(), "the event loop never came back: a waiter spins in it"
    if errors:
        raise errors[0]


def test_a_resumed_request_is_never_refused_for_the_queues_length_or_admission_wait_s():
    """Guards the exemptions of a preempted request coming back (`resumed`): it was admitted once, so neither
    --max-waiting (a full queue, or 0) nor --admission-wait-s refuses it; only its deadline ends its wait. Refused,
    its client would get RESOURCE_EXHAUSTED in the middle of an answer it had been streaming. A new arrival in the
    same queue is still refused."""
    pool = pool_of(1)

    async def scenario():
        q = AdmissionQueue(pool, max_waiting=1, wait_s=0.05)
        held = pool.try_lease()
        (waiter,) = await queued(q, 1)  # the queue is full: a new arrival is refused
        with pytest.raises(RequestError):
            await asyncio.wait_for(q.acquire(far()), GUARD_S)
        resumed = asyncio.create_task(q.acquire(far(), resumed=7))
        await until(lambda: q.waiting == 2)  # joined a full queue, ahead of the waiter
        with pytest.raises(RequestError):  # --admission-wait-s refuses the new arrival
            await asyncio.wait_for(waiter, GUARD_S)
        await asyncio.sleep(0.2)  # the resumed one's timer, were it under --admission-wait-s, would fire first
        assert not resumed.done()
        held.release()
        got = await asyncio.wait_for(resumed, GUARD_S)
        none = AdmissionQueue(pool, max_waiting=0)  # --max-waiting 0: a resumed request waits all the same
        again = asyncio.create_task(none.acquire(far(), resumed=8))
        await until(lambda: none.waiting == 1)
        got.release()
        (await asyncio.wait_for(again, GUARD_S)).release()
        q.close()
        none.close()
    asyncio.run(scenario())
