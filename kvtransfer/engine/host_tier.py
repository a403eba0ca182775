"""The pinned host tier: contexts evicted from the KV pool wait here, in page-locked RAM, to be copied back.

Why pinned, and why pages: a copy from pageable RAM to the device goes through a bounce buffer at a fraction of
the link's speed and is synchronous (bench/results/offload-h200-2026-11-29 measured pinned ~9x faster than
pageable), so the tier is one page-locked arena, allocated once at start. It is cut into pages of
PAGE_TOKENS tokens so that contexts of any length share it without fragmenting; an entry is a list of pages.

Every copy runs on one copy stream (the copy engine), queued from the request's thread, never on the step's
stream: a slot going out (`store`) and a context coming back (`load`) never wait for a decode step, nor a
step for them. One stream also orders them: a page freed by a `load` or a drop and filled again by a later
`store` is only overwritten after the copies queued before it. The caller waits for a copy's event on the host
before it writes the slot (a slot going out) or prefills after it (a context coming back). On CPU the copies
are plain and done on return.

Layout of a page, token-major so that a page's first n tokens are one contiguous run:
(PAGE_TOKENS, layers, 2, kv_heads, head_dim); a slot's positions p0..p1 are permuted into it on the device.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from kvtransfer.geometry import CacheGeometry

log = logging.getLogger("kvtransfer.decode.host_tier")

GIB = 1 << 30
PAGE_TOKENS = 256


@dataclass(eq=False)
class HostEntry:
    pages: list[int]
    length: int  # tokens held


class HostTier:
    """`store(read, entry)` copies a slot's first entry.length tokens out; `load(entry, n, write)` copies n back,
    through the pool's token-major read and write of one slot. Page allocation is the caller's to lock."""

    def __init__(self, geometry: CacheGeometry, device: torch.device, gib: float, stream: torch.cuda.Stream | None,
                 page_tokens: int = PAGE_TOKENS):
        g = geometry
        self.geometry, self.device, self.page_tokens = g, device, page_tokens
        self.page_bytes = page_tokens * g.bytes_per_token
        pages = int(gib * GIB) // self.page_bytes
        if pages < 1:
            raise ValueError(f"--host-cache-gib {gib:g} holds no page of {page_tokens} tokens "
                             f"({self.page_bytes / 2**20:.1f} MiB); give at least {self.page_bytes / GIB:.3f}")
        cuda = device.type == "cuda"
        # (pages, page_tokens, layers, 2, kv_heads, head_dim)
        self.arena = torch.empty((pages, page_tokens, g.num_layers, 2, g.kv_heads, g.head_dim), dtype=g.dtype,
                                 pin_memory=cuda)
        self.free = list(range(pages - 1, -1, -1))
        self.stream = stream  # the prefix cache's copy stream (None on CPU)
        log.info("host tier: %d pages of %d tokens = %.2f GiB of %s RAM", pages, page_tokens,
                 pages * self.page_bytes / GIB, "pinned" if cuda else "host")

    @property
    def pages(self) -> int:
        return self.arena.shape[0]

    def pages_for(self, n: int) -> int:
        return -(-n // self.page_tokens)

    def used_bytes(self) -> int:
        return (self.pages - len(self.free)) * self.page_bytes

    def take(self, n: int) -> HostEntry | None:
        """Pages for n tokens, or None when too few are free (the caller evicts and asks again)."""
        k = self.pages_for(n)
        if k > len(self.free):
            return None
        return HostEntry([self.free.pop() for _ in range(k)], n)

    def give_back(self, entry: HostEntry) -> None:
        self.free.extend(entry.pages)
        entry.pages = []

    def _spans(self, entry: HostEntry, n: int):
        for i, page in enumerate(entry.pages):
            p0 = i * self.page_tokens
            if p0 >= n:
                break
            yield page, p0, min(n, p0 + self.page_tokens)

    def store(self, read, entry: HostEntry) -> torch.cuda.Event | None:
        """Queue the copy of a slot's first entry.length tokens into entry's pages; the event follows it.
        read(p0, p1) -> the slot's positions p0..p1 - 1, (p1 - p0, layers, 2, heads, dim) (KVPool.read)."""
        with self._on_stream():
            for page, p0, p1 in self._spans(entry, entry.length):
                part = read(p0, p1).contiguous()  # (p1 - p0, layers, 2, heads, dim)
                self.arena[page, :p1 - p0].copy_(part, non_blocking=True)
            return self._event()

    def load(self, entry: HostEntry, n: int, write) -> torch.cuda.Event | None:
        """Queue the copy of entry's first n tokens into a slot's positions 0..n - 1; the event follows it.
        write(p0, data) puts data (n, layers, 2, heads, dim) at the slot's positions p0.. (KVPool.write)."""
        with self._on_stream():
            for page, p0, p1 in self._spans(entry, n):
                write(p0, self.arena[page, :p1 - p0].to(self.device, non_blocking=True))  # (p1 - p0, layers, 2, ..)
            return self._event()

    def _on_stream(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()

    def _event(self) -> torch.cuda.Event | None:
        if self.stream is None:
            return None
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev
