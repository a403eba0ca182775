"""Copies of a row's positions in and out of the KV pool's blocks: the paged layout's gathers and scatters.

Why apart from the pool (pool.py, which owns rows, blocks, leases and their counts): these move bytes, never
accounting. Paged, a row's positions are spread over blocks anywhere in the pool, so every read or write of them
goes through the row's block list (row r's position n is block rows[r][n // page] at offset n % page): `read` and
`write` token-major (the host tier's layout), `read_layer` and `write_layer` one layer (the transports' and the
prefill's layout), `copy_prefix` whole blocks from row to row. In the slot layout (one block of the whole context
per row) each is one strided view or copy, and `views` hands transports the views themselves. The block ids reach
the device through pinned memory without a host wait (`_up`).

A mixin: KVPool (pool.py) carries `kv` (layers, 2, blocks + 1, kv_heads, page, head_dim), `page`, `fixed`,
`max_seq`, `geometry`, `device`, `_rows` (each row's block ids, in order) and `blocks_for`, which these use.
"""

from __future__ import annotations

import torch


class BlockCopies:
    def views(self, slot: int, seq_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k, v) over `slot`'s first `seq_len` positions, each (1, kv_heads, seq_len, head_dim): strided
        views into the pool, not copies. The slot layout only (or positions inside one block): paged, use
        read_layer / write_layer."""
        if not 0 < seq_len <= self.max_seq:
            raise ValueError(f"{seq_len} tokens do not fit a slot of --max-seq-len {self.max_seq}")
        if seq_len > self.page:
            raise ValueError(f"{seq_len} positions span several {self.page}-token blocks: not one view")
        b = self._rows[slot][0]
        s = self.kv[:, :, b:b + 1, :, :seq_len]  # (layers, 2, 1, kv_heads, seq, head_dim)
        return [(s[i, 0], s[i, 1]) for i in range(self.geometry.num_layers)]


    def _up(self, t: torch.Tensor) -> torch.Tensor:
        """A small host tensor on its way to the device without a host wait: through pinned memory (torch's caching
        host allocator keeps it until the copy ran), queued on the current stream. A copy from pageable memory would
        wait for the stream, a whole decode step on the serving thread."""
        return t.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else t

    def _index(self, slot: int, p0: int, p1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(blocks, offsets), each (p1 - p0,) int64 on the device: where positions p0..p1 - 1 of `slot` live."""
        pos = torch.arange(p0, p1)
        rows = self._rows[slot]
        if len(rows) * self.page < p1:
            raise ValueError(f"slot {slot} holds {len(rows) * self.page} positions, not {p1}")
        blocks = torch.tensor(rows, dtype=torch.long)[pos // self.page]
        return self._up(blocks), self._up(pos % self.page)

    def read(self, slot: int, p0: int, p1: int) -> torch.Tensor:
        """Positions p0..p1 - 1 of every layer, token-major: (p1 - p0, layers, 2, kv_heads, head_dim) (a view in the
        slot layout, a gathered copy paged)."""
        if self.fixed:
            return self.kv[:, :, slot, :, p0:p1].permute(3, 0, 1, 2, 4)
        blocks, offs = self._index(slot, p0, p1)
        return self.kv[:, :, blocks, :, offs]  # advanced indices on dims 2 and 4: (n, layers, 2, kv_heads, head_dim)

    def write(self, slot: int, p0: int, data: torch.Tensor) -> None:
        """data (n, layers, 2, kv_heads, head_dim) into positions p0..p0 + n - 1 of every layer."""
        p1 = p0 + data.shape[0]
        if self.fixed:
            self.kv[:, :, slot, :, p0:p1].copy_(data.permute(1, 2, 3, 0, 4))
            return
        blocks, offs = self._index(slot, p0, p1)
        self.kv[:, :, blocks, :, offs] = data

    def read_layer(self, slot: int, i: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's positions 0..n - 1 of `slot`: (k, v), each (1, kv_heads, n, head_dim)."""
        if self.fixed:
            b = self._rows[slot][0]
            return self.kv[i, 0, b:b + 1, :, :n], self.kv[i, 1, b:b + 1, :, :n]
        blocks, offs = self._index(slot, 0, n)
        kv = self.kv[i][:, blocks, :, offs]  # (n, 2, kv_heads, head_dim)
        return kv[:, 0].transpose(0, 1)[None], kv[:, 1].transpose(0, 1)[None]

    def layers_of(self, slot: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's (k, v) over `slot`'s positions 0..n - 1, each (1, kv_heads, n, head_dim) (read_layer)."""
        return [self.read_layer(slot, i, n) for i in range(self.geometry.num_layers)]

    def write_layer(self, slot: int, i: int, p0: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (1, kv_heads, n, head_dim) into layer i's positions p0..p0 + n - 1 of `slot`: one scatter each."""
        n = k.shape[2]
        if self.fixed:
            b = self._rows[slot][0]
            self.kv[i, 0, b, :, p0:p0 + n].copy_(k[0])
            self.kv[i, 1, b, :, p0:p0 + n].copy_(v[0])
            return
        if p0 % self.page:  # starts inside a block (a chunk's continuation): position by position
            blocks, offs = self._index(slot, p0, p0 + n)
            self.kv[i, 0][blocks, :, offs] = k[0].transpose(0, 1)  # (n, kv_heads, head_dim)
            self.kv[i, 1][blocks, :, offs] = v[0].transpose(0, 1)
            return
        # whole blocks, then the partial last block as a slice. Blocks that follow each other (a row's blocks mostly
        # do: the free list hands them out in order) are one slice, one plain strided copy each, as the slot layout's;
        # else one index_copy_ each (an index of blocks, not of positions, built on the host and uploaded per call:
        # per layer, a pinned allocation and an H2D copy more on the receiving stream, and an indexed kernel ~5x a
        # copy's time on CPU; bench/probes/grpc_landing.py)
        full, rest = divmod(n, self.page)
        first = p0 // self.page
        ids = self._rows[slot][first:first + full + (1 if rest else 0)]
        if len(ids) < full + (1 if rest else 0):
            raise ValueError(f"slot {slot} holds {len(self._rows[slot]) * self.page} positions, not {p0 + n}")
        run = full and ids[:full] == list(range(ids[0], ids[0] + full))  # one slice of the pool
        index = self._up(torch.tensor(ids[:full], dtype=torch.long)) if full and not run else None
        for dst, src in ((self.kv[i, 0], k[0]), (self.kv[i, 1], v[0])):  # dst (blocks, kv_heads, page, head_dim)
            if full:  # src (kv_heads, n, head_dim) -> (full, kv_heads, page, head_dim)
                whole = src[:, :full * self.page].unflatten(1, (full, self.page)).transpose(0, 1)
                if run:
                    dst[ids[0]:ids[0] + full].copy_(whole)
                else:
                    dst.index_copy_(0, index, whole)
            if rest:
                dst[ids[full], :, :rest].copy_(src[:, full * self.page:])

    def copy_prefix(self, src: int, dst: int, n: int, skip: int = 0) -> None:
        """Row src's first n positions into row dst (whole blocks: one indexed copy; the slot layout: one copy).
        `skip`: leading blocks not copied (dst shares them with src)."""
        if self.fixed:
            self.kv[:, :, dst, :, :n].copy_(self.kv[:, :, src, :, :n])
            return
        k = self.blocks_for(n)
        if k <= skip:
            return
        to = self._up(torch.tensor(self._rows[dst][skip:k], dtype=torch.long))
        frm = self._up(torch.tensor(self._rows[src][skip:k], dtype=torch.long))
        self.kv[:, :, to] = self.kv[:, :, frm]
