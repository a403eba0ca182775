"""Admission: the requests waiting for KV memory, served first come, first served.

Why one queue (issue #37): before it, every freed pool slot woke every waiter and a new arrival could take the slot
before one that had waited 9 s; the wait was capped at --admission-wait-s (10 s) and beyond --max-inflight (64) a
request was refused at once. On CPU (tiny, --max-batch 2, 8 clients sending back to back for 25 s) a first token
took 0.31 s on average and 9.8 s at worst, and 4 of 372 requests were refused: a waiter could lose every race to
newer arrivals. At concurrency 128 on a GPU, 960 of 1,024 requests were refused at once.

The rules:
- Arrival order, no barging: a request joins the back of the queue and only the head may take what is free, so a
  new arrival tries at once only when nobody waits.
- One wake per release: the pool calls back (on whichever thread frees memory) and that wakes the head alone. A
  head that gets its lease leaves and wakes the next one (one release may free more than a request needs); a
  waiter that leaves without one (its deadline passed: DEADLINE_EXCEEDED saying it waited for KV memory; its
  client cancelled) is taken out, and the next one is woken if it was the head.
- A waiter waits as long as its deadline allows (the client's, capped by --request-timeout-s); --admission-wait-s,
  when set, refuses it sooner with RESOURCE_EXHAUSTED. --max-waiting bounds the queue: a request that would make it
  longer is refused at once with RESOURCE_EXHAUSTED naming the flag (0: no request waits).

- A preempted request (kvtransfer/engine/preempt.py) comes back ahead of every new arrival (`acquire(...,
  resumed=rid)`; among themselves, the oldest request first), and is never refused for the queue's length or
  --admission-wait-s: it was admitted once, and only its deadline ends its wait.

What is taken is `take()`: any callable that returns a lease or raises PoolFull (today a pool slot, through the
prefix cache when there is one), so the queue stays as it is when the pool's unit of memory changes. The queue
lives on the server's event loop; only the pool's callback comes from other threads.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque

import grpc

from decode_server.peer.remote import RequestError
from kvtransfer.engine.pool import Lease, PoolFull

log = logging.getLogger("kvtransfer.decode.admission")

# The head also tries again this often: a bounded delay, not a hang, should memory ever be freed without the pool's
# callback. Only the head polls, so this costs at most one wake a second.
ADMISSION_RECHECK_S = 1.0


class _Waiter:
    __slots__ = ("arrival", "event", "resumed")

    def __init__(self, arrival: int, resumed: int | None = None):
        self.arrival, self.event = arrival, asyncio.Event()
        self.resumed = resumed  # a preempted request's id (it goes ahead of new arrivals); None: a new arrival


def _busy(pool) -> str:
    """What is full, in the pool's words (the one place that names the pool's unit)."""
    if pool.fixed:
        return f"all {pool.slots} KV pool slots are busy (--max-batch {pool.slots})"
    return (f"the KV pool has no room now ({pool.free_blocks()} of {pool.blocks} blocks of {pool.page} tokens free, "
            f"{pool.slots - pool.used()} of {pool.slots} rows (--max-batch))")


class AdmissionQueue:
    """The requests waiting for KV memory of `pool`, at most `max_waiting`, each at most `wait_s` (0: until its
    deadline)."""

    def __init__(self, pool, max_waiting: int, wait_s: float = 0.0):
        self.pool, self.max_waiting, self.wait_s = pool, max_waiting, wait_s
        self._queue: deque[_Waiter] = deque()
        self._arrivals = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        pool.subscribe(self._freed)

    @property
    def waiting(self) -> int:
        """Requests in the queue now (Load.queued_requests, kvt_waiting_requests)."""
        return len(self._queue)

    def close(self) -> None:
        self.pool.unsubscribe(self._freed)

    def _freed(self) -> None:
        """The pool freed memory (any thread): wake the head on the loop. A waiter joins the queue before it tries,
        so a release that finds the queue empty happened before any try that failed."""
        loop = self._loop
        if loop is None or not self._queue:
            return
        try:
            loop.call_soon_threadsafe(self._wake_head)
        except RuntimeError:  # the loop is closed (shutdown): nobody is waiting any more
            pass

    def _wake_head(self) -> None:
        if self._queue:
            self._queue[0].event.set()

    async def acquire(self, deadline: float, take=None, resumed: int | None = None) -> Lease:
        """A lease from `take()` (default: pool.try_lease) once this request's turn comes and memory is free; waits
        at most until `deadline` (perf_counter) and --admission-wait-s. Raises RequestError when refused.
        `resumed`: the id of a preempted request coming back (ahead of new arrivals; refused only by its deadline)."""
        self._loop = asyncio.get_running_loop()
        take = take or self.pool.try_lease
        if resumed is None and self._queue and len(self._queue) >= self.max_waiting:
            raise self._full()
        t0 = time.perf_counter()
        give_up = min(deadline, t0 + self.wait_s) if self.wait_s and resumed is None else deadline
        w = _Waiter(next(self._arrivals), resumed)
        self._join(w)  # before the first try: a release after it wakes this one (see _freed)
        admitted = waited = False
        try:
            while True:
                w.event.clear()  # before the try: a release after it sets it again. Not the head (a resumed request
                # went ahead of it after it was woken): it waits for its turn, not on a wake-up meant for a head
                if self._queue[0] is w:  # only the head may take
                    try:
                        lease = take()
                    except PoolFull:
                        if self.max_waiting == 0 and resumed is None:
                            raise self._full() from None
                    else:
                        self._queue.popleft()
                        admitted = True
                        self._wake_head()  # the next one may fit too
                        log.debug("admission: arrival %d admitted %s", w.arrival,
                                  f"after waiting {time.perf_counter() - t0:.3f} s" if waited else "at once")
                        return lease
                left = give_up - time.perf_counter()
                if left <= 0:
                    raise self._gave_up(w, deadline)
                waited = True
                try:
                    async with asyncio.timeout(min(left, ADMISSION_RECHECK_S) if self._queue[0] is w else left):
                        await w.event.wait()
                except TimeoutError:
                    pass
        finally:
            if not admitted:  # left without a lease (deadline, cancel, refusal): out of the queue, the turn passed on
                head = self._queue[0] is w
                self._queue.remove(w)
                if head:
                    self._wake_head()

    def _join(self, w: _Waiter) -> None:
        """Into the queue: a new arrival at the back; a resumed request behind the resumed ones older than it, ahead
        of every new arrival (a head it displaces waits again: only the head takes)."""
        if w.resumed is None:
            self._queue.append(w)
            return
        at = 0
        while at < len(self._queue) and self._queue[at].resumed is not None and self._queue[at].resumed < w.resumed:
            at += 1
        self._queue.insert(at, w)

    def _full(self) -> RequestError:
        if self.max_waiting == 0:
            return RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{_busy(self.pool)} and --max-waiting 0 lets no request wait; retry later, or start "
                                "the decode server with a --max-waiting above 0")
        return RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"{len(self._queue)} requests are already waiting for KV memory (--max-waiting "
                            f"{self.max_waiting}) and {_busy(self.pool)}; "
                            "retry later, or raise --max-waiting")

    def _gave_up(self, w: _Waiter, deadline: float) -> RequestError:
        ahead = self._queue.index(w)
        if self.wait_s and time.perf_counter() < deadline:
            return RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{_busy(self.pool)} and this request got no KV memory within {self.wait_s:g} s "
                                f"(--admission-wait-s; {ahead} requests ahead of it); retry later, or raise "
                                "--admission-wait-s (0: wait as long as the request's deadline allows)")
        return RequestError(grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"the request's deadline passed while it waited for KV memory ({_busy(self.pool)}; "
                            f"{ahead} requests were ahead of it in the queue); give it more time, or retry later")
