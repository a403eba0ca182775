"""Where position n of a row lives in the KV pool: the one lookup every attention kernel shares.

Why one place: the pool is either slot-shaped (one block of the whole context per row, `PAGED` False: the row's
slot is its block and position n its offset) or paged (`PAGED` True: fixed blocks of `PAGE` positions, row r's
position n in block `table[r, n // PAGE]` at offset `n % PAGE`, vLLM's block table). The decode, chunk and
rope+store kernels call these, so a layout change is made here once.

Pool, one layer: (blocks, kv_heads, PAGE, head_dim) paged, (slots, kv_heads, width, head_dim) not; contiguous, and
the K and V pools share strides, so one offset serves both. Offsets are int64: a pool of more than 4 GiB of bf16
has more than 2^31 elements.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tile_offsets(Table, row, stride_tr, n0, offs_n, mask_n, stride_s, stride_t,
                 PAGE: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr):
    """(BLOCK_N,) int64 element offsets of positions offs_n = n0 + arange(BLOCK_N) of `row` (its slot when not
    PAGED, its table row when PAGED). n0 is a multiple of BLOCK_N. When PAGE is a multiple of BLOCK_N the tile sits
    in one block: one scalar load of the table. Masked positions read table entry 0 (a valid block): the caller
    masks their K/V loads."""
    if PAGED:
        base = Table + row * stride_tr
        if PAGE % BLOCK_N == 0:
            block = tl.load(base + n0 // PAGE).to(tl.int64)
            off = block * stride_s + (offs_n % PAGE).to(tl.int64) * stride_t
        else:
            blocks = tl.load(base + offs_n // PAGE, mask=mask_n, other=0).to(tl.int64)
            off = blocks * stride_s + (offs_n % PAGE).to(tl.int64) * stride_t
    else:
        off = row * stride_s + offs_n.to(tl.int64) * stride_t
    return off


@triton.jit
def position_offset(Table, row, stride_tr, pos, num_blocks, stride_s, stride_t, width,
                    PAGE: tl.constexpr, PAGED: tl.constexpr):
    """(offset, in_range) of one position `pos` (int64 scalar) of `row`: where rope+store writes. Out of range (a
    position past the row's table or the slot, a block or slot outside the pool) is skipped by the caller."""
    if PAGED:
        inside = (pos >= 0) & (pos < width * PAGE) & (row >= 0)
        block = tl.load(Table + row * stride_tr + pos // PAGE, mask=inside, other=-1).to(tl.int64)
        in_range = inside & (block >= 0) & (block < num_blocks)
        off = block * stride_s + (pos % PAGE) * stride_t
    else:  # the slot layout: width is the slot's positions (a runtime int: see table_args)
        in_range = (row >= 0) & (row < num_blocks) & (pos >= 0) & (pos < width)
        off = row * stride_s + pos * stride_t
    return off, in_range


def table_args(table, k_pool) -> tuple:
    """(Table, stride_tr, width, PAGE, PAGED) kernel arguments: the table (rows, width) or, without one, the slot
    layout (the slot tensor stands in as an unread pointer; width = the pool's positions per slot, PAGE 1). Either
    way width x PAGE is a row's positions.

    Why the slot layout's positions are a runtime int and not the constexpr PAGE: a constexpr is part of the
    compiled kernel's key, and the fused prefill's one-slot block has the prompt's own length (kvtransfer/model/
    fused_prefill.py), so every new prompt length compiled rope+store again, on the serving thread."""
    if table is None:
        return k_pool, 0, k_pool.shape[2], 1, False
    return table, table.stride(0), table.shape[1], k_pool.shape[2], True
