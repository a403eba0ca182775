"""The decode worker's KV pool: preallocated blocks on the device, a block table, and rows handed out by lease.

Two limits, kept apart: rows (`slots`, --max-batch) bound how many requests run at once; blocks bound the memory.
A row is a request's place in the step (its row of the block table, what the kernels index by); its blocks hold
its K/V, `page` positions each: row r's position n is block table[r, n // page] at offset n % page
(kernels/triton_paging.py reads it so). A lease takes a free row and the blocks its tokens need (admission reserves
the prompt and a small reserve; the scheduler grows a decoding row a block at a time, `grow_locked`), and gives both
back when its last holder lets go, or at once when the scheduler preempts it (`preempt_locked`, preempt.py).

The slot layout is the case page == max_seq (the default): one block of the whole context per row, row r owning
block r for good, so `kv[:, :, r]` is row r's cache and `views` hands transports strided views of it. Paged
(page < max_seq), a row's positions are spread over blocks anywhere in the pool: `read`/`write` (token-major, the
host tier's layout), `read_layer`/`write_layer` (one layer, the transports' and prefill's layout) gather and
scatter them, one indexed copy each, and `copy_prefix` copies whole blocks from row to row (pool_copies.py).

A lease is held, not owned: the request holds it until it ends, and the receive loop holds it while a frame is
landing in its blocks, so a request that gives up while its cache is still arriving never lets a second request's
cache be written over by the late frame.

With a prefix cache (prefix_cache.py, the pool's `keeper`), a row let go with `lease.keep` set (the tokens whose KV
it holds) stays cached with its blocks instead of free, and a lease that finds no free row, or too few free blocks,
takes back the least recently used cached rows.

Blocks are counted by reference (paged): a prompt that starts with a cached context takes that context's full
blocks into its own row (`share_locked`: no copy, the same block ids in both rows of the table) and a block is
free only when no row holds it. A shared block is never written: it is a full block inside the shared opening,
and every row holding it writes only past its own context, which runs past that block (prefix_cache.py).
`used()` counts leased rows only; cached ones are as good as free.
Blocks freed by taking back a cached row may still be read by a copy on the cache's copy stream (to the host tier,
or into another row): `fence` is an event after those copies, and every lease that takes blocks while it has not
fired carries it as `ready` (its holder waits for it before writing).

Layout, one tensor: (layers, 2, blocks + 1, kv_heads, page, head_dim). The extra last block is scratch: rows that
pad a batch up to its CUDA-graph bucket (the scratch row, `scratch`) and table entries past a row's blocks name it.
"""

from __future__ import annotations

import logging
import threading

import torch

from kvtransfer.engine.pool_copies import BlockCopies
from kvtransfer.geometry import CacheGeometry

log = logging.getLogger("kvtransfer.decode.pool")


class PoolFull(Exception):
    """No free row, or too few free blocks (the caller decides how long to wait)."""


class Lease:
    """One row and its blocks, released when the last holder lets go."""

    def __init__(self, pool: "KVPool", slot: int, blocks: list[int]):
        self.pool, self.slot, self.blocks, self._holders = pool, slot, blocks, 1
        self.keep = None  # (n,) token ids whose KV the row holds at positions 0..n - 1: cached when let go
        self.hashed = None  # (tokens, their block keys): the prompt's, from the prefix cache's acquire; when `keep`
        # starts with those tokens, caching it hashes only what follows them
        self.ready = None  # torch.cuda.Event: copies into (or out of) the row's blocks queued on a copy stream; wait
        # for it before writing them (None: nothing queued)
        self.reuse = None  # prefix_cache.Reuse: the prompt's prefix already in the row once `ready` fired
        self.gone = False  # preempted: its row and blocks went back to the pool while still held; letting go of it
        # then frees nothing

    def hold(self) -> None:
        with self.pool._lock:
            if self._holders == 0:
                raise RuntimeError(f"slot {self.slot} was already released")
            self._holders += 1

    def release(self) -> None:
        with self.pool._lock:
            if self._holders == 0:
                return
            self._holders -= 1
            if self._holders or self.gone:
                return
            if self.ready is not None:  # a copy into the row may still read its source (rare: a request that
                self.ready.synchronize()  # gave up before waiting for it)
            keeper = self.pool.keeper
            if keeper is None or self.keep is None or not keeper.keep(self.slot, self.keep, self.hashed):
                self.pool._free_row_locked(self.slot)
        self.pool.freed()


class KVPool(BlockCopies):
    """Rows, blocks and leases; the copies of a row's positions are BlockCopies' (pool_copies.py)."""

    def __init__(self, geometry: CacheGeometry, device: torch.device, slots: int, max_seq: int, page: int = 0,
                 blocks: int = 0):
        if slots < 1 or max_seq < 2:
            raise ValueError(f"KV pool needs >= 1 slot of >= 2 tokens (got --max-batch {slots}, --max-seq-len {max_seq})")
        if page < 0:
            raise ValueError(f"a KV block needs >= 1 token (got {page})")
        page = min(page or max_seq, max_seq)  # a block never outgrows the context a row can hold
        self.geometry, self.device, self.slots, self.max_seq, self.page = geometry, device, slots, max_seq, page
        self.width = -(-max_seq // page)  # blocks a row can hold
        self.fixed = self.width == 1 and not blocks  # the slot layout: row r owns block r
        self.blocks = slots if self.fixed else (blocks or slots * self.width)
        if self.blocks < 1:
            raise ValueError(f"KV pool needs >= 1 block (got {blocks})")
        g = geometry
        # (layers, 2, blocks + 1, kv_heads, page, head_dim); zeros: masked kernels never see NaN garbage
        self.kv = torch.zeros((g.num_layers, 2, self.blocks + 1, g.kv_heads, page, g.head_dim), dtype=g.dtype,
                              device=device)
        self.scratch = slots  # the padding rows' row; its table row names only the scratch block
        self.null = self.blocks  # the scratch block
        # The block table every step's kernels read in place, (slots + 1, width) int32 on the device, and its host copy
        self._rows: list[list[int]] = [[r] if self.fixed else [] for r in range(slots)]
        self.table = torch.full((slots + 1, self.width), self.null, dtype=torch.int32, device=device)
        if self.fixed:
            self.table[:slots, 0] = torch.arange(slots, dtype=torch.int32, device=device)
        self._lock = threading.Lock()
        self._free = list(range(slots - 1, -1, -1))  # pop() hands out row 0 first
        self._free_blocks = [] if self.fixed else list(range(self.blocks - 1, -1, -1))
        self._refs = [0] * self.blocks  # paged: the rows holding each block (free at 0)
        self._shared = 0  # blocks whose count is above 1 (Load.shared_blocks, read on every scrape: kept, not counted)
        self._listeners: set = set()  # called (on the releasing thread) each time a row is freed (`freed`)
        self.keeper = None  # the prefix cache, when there is one (it sets itself here)
        self.fence = None  # torch.cuda.Event after copies still reading freed blocks (see the module docstring)
        log.info("KV pool: %d rows, %d blocks x %d tokens x %d B/token = %.2f GiB on %s (+1 scratch block)", slots,
                 self.blocks, page, g.bytes_per_token, self.capacity_bytes / 2**30, device)

    @property
    def capacity_bytes(self) -> int:
        return self.blocks * self.page * self.geometry.bytes_per_token

    def blocks_for(self, tokens: int) -> int:
        return 1 if self.fixed else -(-max(1, tokens) // self.page)

    def used(self) -> int:
        """Rows leased to requests (cached rows are not)."""
        with self._lock:
            return self.slots - len(self._free) - (self.keeper.cached_slots_locked() if self.keeper else 0)

    def free_blocks(self) -> int:
        """Blocks held by no row (cached rows' blocks are not free, though they are taken back on demand; a block
        several rows share counts once)."""
        with self._lock:
            return len(self._free) if self.fixed else len(self._free_blocks)

    def try_lease(self, tokens: int | None = None) -> Lease:
        """A free row with blocks for `tokens` positions (None: a whole context), else (with a prefix cache) cached
        rows taken back for them; raises PoolFull."""
        need = self.blocks_for(self.max_seq if tokens is None else min(tokens, self.max_seq))
        with self._lock:
            if self.keeper is not None:
                slot, ready = self.keeper.take_slot()
                try:
                    ready = self.grow_locked(slot, need) or ready
                except PoolFull:
                    self._free_row_locked(slot)
                    raise
                lease = Lease(self, slot, self._rows[slot])
                lease.ready = ready
                return lease
            if not self._free or (not self.fixed and len(self._free_blocks) < need):
                raise PoolFull()
            slot = self._free.pop()
            lease = Lease(self, slot, self._rows[slot])
            lease.ready = self.grow_locked(slot, need)  # blocks a preempted row gave back: after the step in flight
            return lease

    def grow_locked(self, slot: int, need: int):
        """Row `slot` holds at least `need` blocks after this (free ones, else cached rows' taken back through the
        keeper); returns the event its writer must wait for (None: none). Raises PoolFull, the row unchanged."""
        have = self._rows[slot]
        more = need - len(have)
        if self.fixed or more <= 0:
            return None
        if len(self._free_blocks) < more and self.keeper is not None:
            self.keeper.free_blocks_locked(more)
        if len(self._free_blocks) < more:
            raise PoolFull()
        new = [self._free_blocks.pop() for _ in range(more)]
        for b in new:
            self._refs[b] = 1
        have.extend(new)
        self.table[slot, len(have) - more:len(have)].copy_(self._up(torch.tensor(new, dtype=torch.int32)),
                                                         non_blocking=True)
        fence = self.fence
        return fence if fence is not None and not fence.query() else None

    def trim_locked(self, slot: int, tokens: int) -> None:
        """Row `slot` keeps only the blocks of its first `tokens` positions (a row going into the prefix cache gives
        back what its answer limit reserved and never filled)."""
        keep = self.blocks_for(tokens)
        rows = self._rows[slot]
        if self.fixed or len(rows) <= keep:
            return
        self._unref_locked(rows[keep:])
        del rows[keep:]
        self.table[slot, keep:].fill_(self.null)

    def share_locked(self, src: int, dst: int, k: int) -> None:
        """Row `dst` (holding no block) takes row `src`'s first k blocks by reference: positions 0..k x page - 1 of
        both are the same memory from now on, and neither row writes them (they are full, inside a context both
        hold: prefix_cache.py)."""
        if self.fixed or self._rows[dst]:
            raise RuntimeError(f"slot {dst} cannot share blocks (slot layout, or it holds blocks already)")
        shared = self._rows[src][:k]
        for b in shared:
            self._refs[b] += 1
            self._shared += self._refs[b] == 2
        self._rows[dst] = shared
        if shared:
            self.table[dst, :k].copy_(self._up(torch.tensor(shared, dtype=torch.int32)), non_blocking=True)

    def shared_blocks(self) -> int:
        """Blocks held by more than one row (a shared opening's, each counted once)."""
        with self._lock:
            return self._shared

    def _unref_locked(self, blocks: list[int]) -> None:
        """A row lets go of `blocks`: each one no other row holds is free again."""
        for b in reversed(blocks):
            self._refs[b] -= 1
            self._shared -= self._refs[b] == 1
            if self._refs[b] == 0:
                self._free_blocks.append(b)

    def preempt_locked(self, lease: Lease, keep=None) -> bool:
        """Take a held lease's row and blocks back now (the scheduler preempts its request: a step needs blocks and
        none is free); its holders let go of it later and free nothing. `keep`: the token ids whose KV the row
        holds, for the keeper to swap them to the host tier first (prefix_cache.swap_out_locked). The caller has set
        `fence` after every write still queued into the row. True when they were swapped."""
        if lease.gone:
            raise RuntimeError(f"slot {lease.slot} was already preempted")
        lease.gone = True
        if keep is not None and self.keeper is not None and self.keeper.swap_out_locked(lease.slot, keep, lease.hashed):
            return True
        self._free_row_locked(lease.slot)
        return False

    def _free_row_locked(self, slot: int) -> None:
        """Row `slot` and its blocks back to the free lists (a cached row taken back, or a lease let go)."""
        if not self.fixed:
            self._unref_locked(self._rows[slot])
            self._rows[slot] = []
            self.table[slot].fill_(self.null)
        self._free.append(slot)

    def freed(self) -> None:
        """Tell the listeners that memory was freed (call without the lock: a listener may take a row)."""
        with self._lock:
            listeners = list(self._listeners)
        for wake in listeners:
            wake()

    def subscribe(self, wake) -> None:
        """Call `wake()` (no arguments, must not block) on whichever thread frees a row, until unsubscribed."""
        with self._lock:
            self._listeners.add(wake)

    def unsubscribe(self, wake) -> None:
        with self._lock:
            self._listeners.discard(wake)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's K and V pools, each (blocks + 1, kv_heads, page, head_dim)."""
        return self.kv[i, 0], self.kv[i, 1]

    def row_blocks(self, slot: int) -> list[int]:
        return self._rows[slot]
