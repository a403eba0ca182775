"""Between the scheduler thread and a Generate call: the request's token stream, and its slot made ready.

Why here: the scheduler must never wait on a client, and a client must never hold up the
batch. Tokens cross from the scheduler's thread to the servicer's event loop through an
unbounded asyncio queue whose use is bounded by a count: a client that leaves more than
`limit` tokens unread has its sequence stopped (its slot freed at the next step), and its
stream ends with RESOURCE_EXHAUSTED saying so. (How a request gets its slot: admission.py.)
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque

from kvtransfer.engine.pool import Lease
from kvtransfer.engine.sequence import EndCause, Ended, Sequence, Token


class Mailbox:
    """Hands items from the scheduler thread to one event loop, waking the loop once per burst.

    Why: a step makes one token for each of B streams; one `call_soon_threadsafe` per token wakes the
    loop B times per step (a self-pipe write each, and a GIL hand-over to the loop thread that the
    scheduler thread then waits to get back). Posted items queue up; only the first post of a burst
    schedules the drain, which delivers everything queued by then.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._items: deque = deque()
        self._lock = threading.Lock()
        self._scheduled = False

    def post(self, queue: asyncio.Queue, item) -> None:
        with self._lock:
            self._items.append((queue, item))
            if self._scheduled:
                return
            self._scheduled = True
        self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            items, self._items, self._scheduled = self._items, deque(), False
        for queue, item in items:
            queue.put_nowait(item)


class TokenStream:
    """The sink of one Sequence (called on the scheduler thread) and its reader (the servicer's loop, the one
    `box` wakes: the servicer keeps one Mailbox for all its streams)."""

    def __init__(self, box: Mailbox, limit: int):
        self.loop, self.limit = box.loop, limit
        self.box = box
        self.queue: asyncio.Queue = asyncio.Queue()
        self.sent = self.read = 0  # written by one thread each; reads of an int are atomic
        self.seq: Sequence | None = None

    def sink(self, item: Token | Ended) -> None:
        self.sent += 1
        self.box.post(self.queue, item)
        if self.seq is not None and self.sent - self.read > self.limit:
            self.seq.stop(f"the client left {self.limit} tokens unread (--stream-buffer-tokens); read the stream "
                          "as it comes", EndCause.SLOW_READER)

    async def next(self, deadline: float) -> Token | Ended:
        """The next token or end; asyncio.TimeoutError at the deadline."""
        item = await asyncio.wait_for(self.queue.get(), max(deadline - time.perf_counter(), 0.001))
        self.read += 1
        return item


async def slot_ready(lease: Lease, poll_s: float = 0.0005) -> None:
    """Wait (without blocking the loop) for the copies queued into or out of the lease's slot (lease.ready:
    a host-tier store of the context it held, a reused prefix copied or reloaded into it)."""
    ev = lease.ready
    while ev is not None and not ev.query():
        await asyncio.sleep(poll_s)
