"""The decode worker's prefix cache: a finished request's KV stays in its pool slot until the slot is needed,
and a later prompt that starts with it prefills only the rest.

Why in the pool's slots: a conversation's next turn is its last prompt, the answer and new text, and the slot
that decoded the answer already holds the KV of all but the answer's last token. Keeping it costs nothing
while slots are free; a slot is taken back (least recently used first) only when a request needs one.

How a prompt takes a cached prefix (`acquire`: its block keys hashed first, outside the lock, and kept by the lease
for caching the row later; then under the pool's lock, so two requests never take one slot):
- the index (prefix_index.py) proposes the entries sharing the most whole blocks with the prompt, and each is
  checked token for token; the reused length L is the verified common prefix, at most the prompt's length
  less one (the last prompt token is always prefilled: its logits choose the first token);
- a device entry wholly inside the prompt is claimed: its slot becomes the request's, nothing is copied;
- a device entry longer than what the prompt shares (a shared system prompt, a branch) stays cached; paged, the
  fresh slot takes its full blocks inside the L shared tokens by reference (KVPool.share_locked: no copy, the
  blocks held once however many requests start with them) and a copy of the partial block after them, if any;
  in the slot layout its first L tokens are copied with one device copy. Neither the entry nor the request ever
  writes a shared block: each writes only past its own context, and a shared block ends at or before L, inside
  both (an entry is shared from only when it holds more than L tokens, and a request's context holds L + 1);
- a host-tier entry (host_tier.py, --host-cache-gib) is copied back into a fresh slot when the break-even rule
  (reload_rule.py, speeds measured at start) says a reload beats recomputing its L tokens;
- a slot taken back from the cache goes to the host tier first when there is one (its copy queued before the
  slot is handed on).
All copies run on one copy stream; the lease's `ready` event follows the last of them, and its holder waits for
it on the host before it writes the slot (decode_server waits before prefilling). The rest of the prompt is
then prefilled after the reused positions (the chunk-after-past attention of chunked prefill).

What it equals: a reused prefix's KV was made by another forward (a decode step's rows, or another prompt's
prefill), so a request served from it equals the same request from scratch within chunked prefill's tolerance,
not bit for bit. A cached context is only the tokens whose KV a delivered step wrote: the prompt and every
generated token but the last.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from kvtransfer.engine.host_tier import HostEntry, HostTier
from kvtransfer.engine.pool import KVPool, Lease, PoolFull
from kvtransfer.engine.prefix_index import BLOCK_TOKENS, Entry, PrefixIndex, block_keys, known_keys
from kvtransfer.engine.reload_rule import Speeds

log = logging.getLogger("kvtransfer.decode.prefix_cache")

DEVICE, HOST = "device", "host"


@dataclass(frozen=True)
class Reuse:
    """What a request's slot holds of its prompt once the lease's `ready` event has fired."""

    tier: str  # DEVICE or HOST
    length: int  # prompt tokens 0..length - 1 are in the slot: prefill the rest
    how: str  # "claimed" (the cached slot itself), "shared" (paged: its full blocks by reference, the partial one
    # copied), "copied" (the slot layout: on the device) or "reloaded" (from the host tier)
    bytes: int  # KV bytes copied for it (0 when claimed)


@dataclass
class Stats:
    """Counts since start (the server exports them)."""

    evicted_device: int = 0  # cached slots taken back for a request
    evicted_host: int = 0  # host-tier entries dropped for room
    stored_bytes: int = 0  # copied out to the host tier
    host_recomputed: int = 0  # host hits the break-even rule sent to recompute
    swapped: int = 0  # preempted rows whose context went to the host tier (preempt.py)


class PrefixCache:
    def __init__(self, pool: KVPool, host_gib: float = 0.0, block: int = BLOCK_TOKENS):
        self.pool, self.geometry = pool, pool.geometry
        self.index = PrefixIndex(block)
        cuda = pool.device.type == "cuda"
        self.stream = torch.cuda.Stream(pool.device) if cuda else None  # every copy in or out of a cached slot
        self.host = HostTier(pool.geometry, pool.device, host_gib, self.stream) if host_gib > 0 else None
        self._host_entries: dict[int, HostEntry] = {}
        self._host_ids = iter(range(1, 1 << 62))
        self.speeds: Speeds | None = None  # the break-even rule's speeds (measured by the engine at start)
        self.stats = Stats()
        pool.keeper = self

    @property
    def block(self) -> int:
        return self.index.block

    # --- counts (any thread) ---

    def cached_slots(self) -> int:
        with self.pool._lock:
            return self.cached_slots_locked()

    def cached_slots_locked(self) -> int:
        return sum(1 for e in self.index.entries() if e.where[0] == DEVICE)

    def cached_blocks(self) -> int:
        """Pool blocks held by cached rows, each once however many rows share it (the slot layout: one a row)."""
        with self.pool._lock:
            return len({b for e in self.index.entries() if e.where[0] == DEVICE for b in self.pool.row_blocks(
                e.where[1])})

    def host_bytes(self) -> int:
        with self.pool._lock:
            return self.host.used_bytes() if self.host is not None else 0

    # --- the pool's hooks (its lock held) ---

    def keep(self, slot: int, tokens: np.ndarray, hashed: tuple[np.ndarray, list[bytes]] | None = None) -> bool:
        """A released slot's KV covers `tokens`: cache it (False: too short to match, the slot is freed). `hashed`:
        the lease's (prompt, its block keys), reused for the blocks `tokens` shares with that prompt (under the pool's
        lock, a 32k prompt's keys cost ~4-5 ms of hashing: the scheduler thread waits for the lock meanwhile)."""
        if self.index.add((DEVICE, slot), tokens, known_keys(tokens, hashed, self.block)) is None:
            return False
        self.pool.trim_locked(slot, len(tokens))  # paged: the blocks its answer limit reserved and did not fill
        return True

    def swap_out_locked(self, slot: int, tokens: np.ndarray, hashed: tuple[np.ndarray, list[bytes]] | None = None
                        ) -> bool:
        """A preempted row (preempt.py): its context (`tokens`, the ids whose KV it holds) copied to the host tier
        as a host entry, then its row and blocks freed, fenced after that copy, as a cached row taken back is. False,
        nothing done, without a host tier or for a context the tier cannot hold (shorter than a block, or longer
        than the whole tier): the caller frees the row. `hashed`: as keep's."""
        if self.host is None or len(tokens) < self.block or self.host.pages_for(len(tokens)) > self.host.pages:
            return False
        e = self.index.add((DEVICE, slot), tokens, known_keys(tokens, hashed, self.block))
        if e is None:
            return False
        self._evict(e)
        self.stats.evicted_device -= 1  # not a cached row
        self.stats.swapped += 1
        return True

    def take_slot(self) -> tuple[int, torch.cuda.Event | None]:
        """A row for a new lease: a free one, else the least recently used cached one (its context copied to the
        host tier first, when there is one: the event follows that copy). Paged, a row taken back gives its blocks
        back to the pool first (the pool's fence follows the copies that may still read them). Raises PoolFull."""
        if self.pool._free:
            return self.pool._free.pop(), None
        e = self.index.oldest(lambda e: e.where[0] == DEVICE)
        if e is None:
            raise PoolFull()
        ready = self._evict(e)
        if not self.pool.fixed:
            return self.pool._free.pop(), None
        return e.where[1], ready

    def free_blocks_locked(self, want: int) -> None:
        """Paged: take back least recently used cached rows until `want` blocks are free, or none is left."""
        while len(self.pool._free_blocks) < want:
            e = self.index.oldest(lambda e: e.where[0] == DEVICE)
            if e is None:
                return
            self._evict(e)

    def _evict(self, e: Entry) -> torch.cuda.Event | None:
        """A cached row taken back: stored to the host tier first when there is one; paged, its row and blocks go
        back to the pool, fenced after every copy queued so far. Returns the event its next writer waits for."""
        self.index.remove(e.where)
        self.stats.evicted_device += 1
        slot = e.where[1]
        ready = self._store(slot, e.tokens, e.keys) or self._mark()
        if not self.pool.fixed:
            self.pool.fence = ready
            self.pool._free_row_locked(slot)
        return ready

    def _mark(self) -> torch.cuda.Event | None:
        """An event after every copy queued so far: a slot taken from the cache is written only after it, so a
        copy still reading the slot (another request's prefix) is never overwritten under it."""
        if self.stream is None:
            return None
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def _store(self, slot: int, tokens: np.ndarray, keys: list[bytes]) -> torch.cuda.Event | None:
        """The row's context to the host tier, filed under its `keys` (its entry's: no hashing again)."""
        if self.host is None or len(tokens) < self.block or self.host.pages_for(len(tokens)) > self.host.pages:
            return None  # longer than the whole tier: checked before any entry is dropped for room
        while (entry := self.host.take(len(tokens))) is None:
            old = self.index.oldest(lambda e: e.where[0] == HOST)
            if old is None:  # longer than the whole tier
                return None
            self._drop_host(old)
        hid = next(self._host_ids)
        self._host_entries[hid] = entry
        self.index.add((HOST, hid), tokens, keys)
        self.stats.stored_bytes += len(tokens) * self.geometry.bytes_per_token
        return self.host.store(lambda p0, p1: self.pool.read(slot, p0, p1), entry)

    def _drop_host(self, e: Entry) -> None:
        self.index.remove(e.where)
        self.host.give_back(self._host_entries.pop(e.where[1]))
        self.stats.evicted_host += 1

    # --- requests (the server's thread) ---

    def acquire(self, tokens, reuse: bool = True, max_suffix: int | None = None, need: int | None = None) -> Lease:
        """A lease on a slot for the prompt `tokens`, with `lease.reuse` set when a cached prefix was taken (then
        only tokens[reuse.length:] need a prefill) and `lease.ready` when copies into the slot are queued.
        `max_suffix`: take a prefix only when at most this many prompt tokens are left to prefill. `need`: the
        positions the request reserves (paged: its blocks; None: a whole context). Raises PoolFull."""
        arr = np.asarray(tokens, dtype=np.int64)
        blocks = self.pool.blocks_for(self.pool.max_seq if need is None else min(need, self.pool.max_seq))
        keys = block_keys(arr, self.block)  # outside the lock: a 32k prompt's are ~4 ms of hashing
        with self.pool._lock:
            lease = self._acquire_locked(arr, keys, reuse, max_suffix, blocks)
        lease.hashed = arr.copy(), keys  # caching the row later hashes only what follows the prompt (a copy: the
        # caller's array may change)
        return lease

    def _acquire_locked(self, arr: np.ndarray, keys: list[bytes], reuse: bool, max_suffix: int | None,
                        blocks: int) -> Lease:
        """acquire's work under the pool's lock: the prefix to take, if any, and the slot."""
        choice = self._choose(arr, max_suffix, keys) if reuse else None
        if choice is None:
            slot, ready = self._fresh(blocks)
            return self._lease(slot, ready, None)
        m, n = choice
        e = m.entry
        if e.where[0] == DEVICE:
            if m.length < e.length:  # the entry holds more than the prompt shares: share or copy, keep it
                src, shared = e.where[1], 0 if self.pool.fixed else n // self.pool.page  # full blocks shared
                e.pins += 1
                try:
                    slot, ready = self._fresh(blocks, src, shared)
                except PoolFull:
                    slot = None
                finally:
                    e.pins -= 1
                if slot is not None:
                    self.index.touch(e.where)
                    ready = self._copy(src, slot, n, ready, shared)
                    copied = n - shared * self.pool.page
                    return self._lease(slot, ready, Reuse(DEVICE, n, "shared" if shared else "copied",
                                                          copied * self.geometry.bytes_per_token))
            e.pins += 1  # claimed: its slot is the request's now (after copies reading it), grown to `need`
            try:
                ready = self.pool.grow_locked(e.where[1], blocks)
            finally:
                e.pins -= 1
            self.index.remove(e.where)
            return self._lease(e.where[1], self._mark() or ready, Reuse(DEVICE, n, "claimed", 0))
        e.pins += 1  # a host entry: not dropped while the slot is found
        try:
            slot, ready = self._fresh(blocks)
        finally:
            e.pins -= 1
        entry = self._host_entries[e.where[1]]
        ready = self.host.load(entry, n, lambda p0, data: self.pool.write(slot, p0, data)) or ready
        if m.length >= e.length:  # moved back whole: the slot is its copy now (a page given back is only written
            self._drop_host(e)  # by a later store, after this load on the one copy stream)
            self.stats.evicted_host -= 1  # not an eviction
        else:
            self.index.touch(e.where)
        return self._lease(slot, ready, Reuse(HOST, n, "reloaded", n * self.geometry.bytes_per_token))

    def _choose(self, arr: np.ndarray, max_suffix: int | None, keys: list[bytes]):
        """The (match, reused length) to take, or None: the longest verified prefix, the device before the host
        at equal length; a host hit only when the break-even rule says reload. keys: block_keys(arr)."""
        matches = self.index.match(arr, keys)
        matches.sort(key=lambda m: (-min(m.length, len(arr) - 1), m.entry.where[0] != DEVICE))
        for m in matches:
            n = min(m.length, len(arr) - 1)
            if n < self.block or (max_suffix is not None and len(arr) - n > max_suffix):
                return None
            if m.entry.where[0] == HOST and self.speeds is not None and not self.speeds.reload_pays(n):
                self.stats.host_recomputed += 1
                log.debug("host-tier hit of %d tokens: reload %.2f ms > recompute %.2f ms: recomputing", n,
                          self.speeds.reload_s(n) * 1e3, self.speeds.recompute_s(n) * 1e3)
                continue
            if m.entry.where[0] == HOST and self.speeds is not None:
                log.debug("host-tier hit of %d tokens: reload %.2f ms < recompute %.2f ms: reloading", n,
                          self.speeds.reload_s(n) * 1e3, self.speeds.recompute_s(n) * 1e3)
            return m, n
        return None

    def _fresh(self, blocks: int, src: int = 0, shared: int = 0) -> tuple[int, torch.cuda.Event | None]:
        """A row with `blocks` blocks for a new lease (take_slot, then its blocks), the first `shared` of them row
        `src`'s by reference; raises PoolFull."""
        slot, ready = self.take_slot()
        try:
            if shared:
                self.pool.share_locked(src, slot, shared)
            return slot, self.pool.grow_locked(slot, blocks) or ready
        except PoolFull:
            self.pool._free_row_locked(slot)
            raise

    def _copy(self, src: int, dst: int, n: int, after: torch.cuda.Event | None, skip: int = 0
              ) -> torch.cuda.Event | None:
        """One device copy of slot src's first n positions into slot dst but the `skip` blocks they share, on the
        copy stream (after any store queued out of dst)."""
        if self.stream is None:
            self.pool.copy_prefix(src, dst, n, skip)
            return None
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            self.pool.copy_prefix(src, dst, n, skip)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        return ev

    def _lease(self, slot: int, ready, reuse: Reuse | None) -> Lease:
        lease = Lease(self.pool, slot, self.pool.row_blocks(slot))
        lease.ready, lease.reuse = ready, reuse
        return lease
