"""Preemption (issue #38): before each step, every decoding row gets the block its next position needs; when none is
free, the newest running request gives its blocks back and is readmitted later.

Why: admission reserves a request's prompt and a small reserve, not its whole answer limit (decode_server/reuse.py),
so the pool holds the requests that fit now rather than the few whose longest possible answers would. The price is
that a step may find no free block for a row that crosses into a new one. Then, as vLLM's scheduler does
(v1/core/sched/scheduler.py: it pops the last of its running list and frees its blocks; SGLang's retract_decode
likewise retracts running requests to the waiting queue), the newest running request is preempted: its row and
blocks go back to the pool now, and the request is readmitted ahead of every new arrival and continues from the
tokens it already made (decode_server/request_path.py: its context is prefilled again here, "recompute").

Swap: with the host tier (--host-cache-gib), when the break-even rule (reload_rule.py, the speeds measured at
start) says copying the victim's context back beats prefilling it again, the context goes to the pinned host
tier first, as a host entry of the prefix cache (prefix_cache.swap_out_locked; vLLM's v0 swapped blocks to CPU the
same way), and the readmitted request reloads it there (PrefixCache.acquire finds it): the same bytes, so it
decodes on exactly as if it had never left. Whatever the tier cannot hold (a context shorter than one prefix
block, or longer than the whole tier), or the rule sends to recompute, is recomputed.

The rules kept here:
- Oldest first: rows are grown in admission order (Sequence.rid), and the victim is the running request with the
  highest rid, so the oldest request always progresses (a request alone always fits: prompt + max_new_tokens <=
  --max-seq-len <= the pool, decode_server/validate.py and sizing.py). A resumed request keeps its rid, so it is
  not the first victim again. A row whose last token is already queued (remaining 0) is never a victim: it ends at
  the next delivery.
- The prefix cache's rows go first: `grow_locked` takes back cached rows before it says the pool is full.
- The step still in flight may write into the victim's blocks (its row in it: the token it makes there is dropped,
  and made again after the resume). So the pool's `fence` is set after that step (and after every copy on the
  prefix cache's stream) before the blocks are freed: a lease that takes them on another stream waits for it, and
  this thread's own steps are queued after it on the same stream.
- The victim ends with Ended(PREEMPTED): its sequence leaves the batch, its holds are let go (they free nothing:
  `Lease.gone`), and the servicer, not the client, sees that end.
- Once every row grew, the pool's listeners are told (`KVPool.freed`): what is left of the victims' blocks is the
  admission queue's head's to take (a preempted request's own resume goes ahead of the rest). Without it a waiter
  would find those blocks only at its next once-a-second recheck (decode_server/admission.py).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from kvtransfer.engine.pool import KVPool, PoolFull
from kvtransfer.engine.sequence import EndCause, Ended, Sequence

log = logging.getLogger("kvtransfer.decode.scheduler")

RECOMPUTE, SWAP = "recompute", "swap"


def make_room(running: list[Sequence], end) -> int:
    """Before a step: each running sequence that decodes in it holds the block of the position it writes
    (`length`), the oldest first; where none is free, the newest running sequence is preempted (`end(seq,
    Ended(PREEMPTED, how))` on this thread, outside the pool's lock) until one is. Returns how many were preempted
    (they are `over`; the caller drops them from `running`)."""
    pool: KVPool | None = running[0].lease.pool if running else None
    if pool is None or pool.fixed:
        return 0  # nothing runs, or a row owns a whole context
    # the rows crossing into a new block at this step (most steps: none; a row's blocks change on this thread only)
    short = [s for s in running if not s.over and s.remaining > 0 and
             len(pool.row_blocks(s.slot)) * pool.page <= s.length]
    preempted = 0
    for s in sorted(short, key=lambda s: s.rid):
        if s.over:  # preempted for an older one
            continue
        while True:
            victim = None
            with pool._lock:
                try:
                    ready = pool.grow_locked(s.slot, pool.blocks_for(s.length + 1))
                except PoolFull:
                    victim = max((v for v in running if not v.over and v.remaining > 0), key=lambda v: v.rid)
                    _fence_locked(pool)
                    how = SWAP if pool.preempt_locked(victim.lease, _to_swap(pool, victim)) else RECOMPUTE
                    victim.over = True  # before it leaves the lock: no later pass takes it for a victim again
            if victim is None:
                if ready is not None:  # blocks freed by a copy still reading them (the prefix cache's): after it
                    torch.cuda.current_stream(pool.device).wait_event(ready)
                break
            preempted += 1
            log.debug("request %d preempted at %d tokens (%s): request %d needs a block and none is free", victim.rid,
                      victim.length, how, s.rid)
            end(victim, Ended(EndCause.PREEMPTED, how))
            if victim is s:
                break
    if preempted:  # what the rows grown here left of the victims' blocks: the admission queue's head may take it
        pool.freed()
    return preempted


def _to_swap(pool: KVPool, s: Sequence) -> np.ndarray | None:
    """The context to swap to the host tier (the ids whose KV delivered steps wrote), or None: recompute it (no host
    tier, the sequence keeps no tokens, or the break-even rule says a prefill of it is cheaper than a reload)."""
    cache = pool.keeper
    if s.tokens is None or getattr(cache, "host", None) is None:
        return None
    n = len(s.tokens) - 1
    if cache.speeds is not None and not cache.speeds.reload_pays(n):
        return None
    return np.asarray(s.tokens[:n], dtype=np.int64)


def _fence_locked(pool: KVPool) -> None:
    """pool.fence after every write queued into the pool so far (this thread's stream: the step in flight) and
    every copy queued on the prefix cache's stream (pool.py: a lease taking freed blocks carries it)."""
    if pool.device.type != "cuda":
        return
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(pool.device))
    stream = getattr(pool.keeper, "stream", None)
    if stream is not None:
        stream.wait_event(ev)
        ev = torch.cuda.Event()
        ev.record(stream)
    pool.fence = ev
