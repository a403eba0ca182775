"""The decode worker's KV pool: one preallocated block on the device, handed out by slot.

Why slots (gpt-fast's static cache, per-row lengths) and not pages: a slot is one request's
whole context, so a request's prefix of one layer is a plain strided view that every
transport can land into (one device-local copy per layer, as it arrives), and the step reads
row b's K/V at `slots[b]` with no block table. The price is capacity: every slot reserves
`--max-seq-len` tokens, so the pool holds `--max-batch` requests of any length up to that.

A slot is leased, not owned: the request holds it until it ends, and the receive loop holds it
while a frame is landing in it, so a request that gives up while its cache is still arriving
never lets a second request's cache be written over by the late frame.

With a prefix cache (prefix_cache.py, the pool's `keeper`), a slot let go with `lease.keep` set (the tokens
whose KV it holds) stays cached instead of free, and a lease taken when no slot is free takes back the least
recently used cached one. `used()` counts leased slots only; cached ones are as good as free.

Layout, one tensor: (layers, 2, slots + 1, kv_heads, max_seq, head_dim). The extra last slot is
scratch: rows that pad a batch up to its CUDA-graph bucket point there.
"""

from __future__ import annotations

import logging
import threading

import torch

from kvtransfer.geometry import CacheGeometry

log = logging.getLogger("kvtransfer.decode.pool")


class PoolFull(Exception):
    """No free slot (the caller decides how long to wait)."""


class Lease:
    """One slot, released when its last holder lets go."""

    def __init__(self, pool: "KVPool", slot: int):
        self.pool, self.slot, self._holders = pool, slot, 1
        self.keep = None  # (n,) token ids whose KV the slot holds at positions 0..n - 1: cached when let go
        self.ready = None  # torch.cuda.Event: copies into (or out of) the slot queued on a copy stream; wait for it
        # before writing the slot (None: nothing queued)
        self.reuse = None  # prefix_cache.Reuse: the prompt's prefix already in the slot once `ready` fired

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
            if self._holders:
                return
            if self.ready is not None:  # a copy into the slot may still read its source (rare: a request that
                self.ready.synchronize()  # gave up before waiting for it)
            keeper = self.pool.keeper
            if keeper is None or self.keep is None or not keeper.keep(self.slot, self.keep):
                self.pool._free.append(self.slot)
            listeners = list(self.pool._listeners)
        for wake in listeners:  # outside the lock: a listener may take a slot
            wake()


class KVPool:
    def __init__(self, geometry: CacheGeometry, device: torch.device, slots: int, max_seq: int):
        if slots < 1 or max_seq < 2:
            raise ValueError(f"KV pool needs >= 1 slot of >= 2 tokens (got --max-batch {slots}, --max-seq-len {max_seq})")
        self.geometry, self.device, self.slots, self.max_seq = geometry, device, slots, max_seq
        g = geometry
        # (layers, 2, slots + 1, kv_heads, max_seq, head_dim); zeros: masked kernels never see NaN garbage
        self.kv = torch.zeros((g.num_layers, 2, slots + 1, g.kv_heads, max_seq, g.head_dim), dtype=g.dtype,
                              device=device)
        self.scratch = slots
        # The block table every step's kernels read (kernels/triton_paging.py), (slots + 1, 1) int32 on the device:
        # slot s is block s here, one block of the whole context, the scratch slot's row names the scratch block.
        self.page = max_seq  # positions per block
        self.table = torch.arange(slots + 1, dtype=torch.int32, device=device).view(slots + 1, 1)
        self._lock = threading.Lock()
        self._free = list(range(slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._listeners: set = set()  # called (on the releasing thread) each time a slot is freed
        self.keeper = None  # the prefix cache, when there is one (it sets itself here)
        log.info("KV pool: %d slots x %d tokens x %d B/token = %.2f GiB on %s (+1 scratch slot)", slots, max_seq,
                 g.bytes_per_token, self.capacity_bytes / 2**30, device)

    @property
    def capacity_bytes(self) -> int:
        return self.slots * self.max_seq * self.geometry.bytes_per_token

    def used(self) -> int:
        """Slots leased to requests (cached slots are not)."""
        with self._lock:
            return self.slots - len(self._free) - (self.keeper.cached_slots_locked() if self.keeper else 0)

    def try_lease(self) -> Lease:
        """A free slot, else (with a prefix cache) a cached one taken back; raises PoolFull."""
        with self._lock:
            if self.keeper is not None:
                slot, ready = self.keeper.take_slot()
                lease = Lease(self, slot)
                lease.ready = ready
                return lease
            if not self._free:
                raise PoolFull()
            return Lease(self, self._free.pop())

    def subscribe(self, wake) -> None:
        """Call `wake()` (no arguments, must not block) on whichever thread frees a slot, until unsubscribed."""
        with self._lock:
            self._listeners.add(wake)

    def unsubscribe(self, wake) -> None:
        with self._lock:
            self._listeners.discard(wake)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's K and V pools, each (slots + 1, kv_heads, max_seq, head_dim)."""
        return self.kv[i, 0], self.kv[i, 1]

    def views(self, slot: int, seq_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k, v) over `slot`'s first `seq_len` positions, each (1, kv_heads, seq_len, head_dim): where a
        transport or a local prefill lands a cache. Strided views into the pool, not copies."""
        if not 0 < seq_len <= self.max_seq:
            raise ValueError(f"{seq_len} tokens do not fit a slot of --max-seq-len {self.max_seq}")
        s = self.kv[:, :, slot:slot + 1, :, :seq_len]  # (layers, 2, 1, kv_heads, seq, head_dim)
        return [(s[i, 0], s[i, 1]) for i in range(self.geometry.num_layers)]
