"""Decode attention's stage 2: the merges of a row's split partials (stage 1 is triton_attention.py).

Why a module of its own: stage 1 cuts each row's length into splits read in parallel; the merges here fold the
splits' (output, log-sum-exp) pairs into the row's output, in one of two modes.

By count (the default, `merge_splits`): a row of length L is cut into the split COUNT chosen from the batch size
(triton_attention.choose_num_splits), chunks of ceil(L / count) rounded up to BLOCK_N and at most the per-split cap
(triton_attention.LONG_CHUNK: a longer row takes more splits, the grid holding max(count, cdiv(max_seq, cap))), and all
of a row's splits merge in one tile of next_pow2 of the grid's splits. So the positions each split sums, and the merge's
reduction tree, change with the batch: a row's output changes bits with its neighbours.

Fixed size (the batch-invariant mode, docs/batch-invariance.md: `merge_fixed_splits`): every row is cut at the same
absolute positions, split j covering [j * split_size, min((j + 1) * split_size, L)) (stage 1 with SPLIT_SIZE set),
and the merge folds a row's cdiv(L, split_size) partials in index order, MERGE_TILE splits at a time: a tile shape
that is a constant, never the count rounded to a power of two, and a number of tiles that is a function of the
row's own length. So every reduction a row's output goes through depends on its length, its keys and values and
the model's shapes alone.

The grid's split dimension is static in both (one CUDA graph serves any lengths); splits past a row's length exit
at once in stage 1 and are never read here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The mode's default split size, in positions. A constant of the mode (the same on every server, so neither the
# pool size nor the SM count may choose it), a multiple of BLOCK_N (64): 4 stage-1 tiles per split, so the
# program's fixed cost (its query load, its partial's D + 1 fp32 per query head) stays ~3% of the K/V it reads
# (Qwen2.5-7B, G = 7: 28 D bytes written per 1,024 D read). `choose_num_splits` cuts longer chunks where decode
# attention matters most (512 at batch 1 over 32k: 66 splits, 128 here; 512 at batch 64 over 1k: 2 splits, 4 here),
# so the mode makes more programs there; a short row at batch 1 gets fewer (cdiv(L, 256) splits).
INVARIANT_SPLIT_SIZE = 256
MERGE_TILE = 16  # splits per stage-2 step (BLOCK_S): a constant; rows of more splits fold tiles in order
_MERGE_ELEMS = 4096  # fp32 partial-output elements per stage-2 step (both modes)
STAGE2_WARPS = 4  # the by-count merge's launch (bench/probes/chunk_attention.py --pair-sweep times others)
STAGE2_HEADS = 1  # query heads a by-count merge program takes, one after another


def no_chunk_cap(max_seq: int, block: int) -> int:
    """A max_chunk that never binds: max_seq rounded up to the tile (no row's chunk is longer than the row)."""
    return max(block, -(-int(max_seq) // block) * block)


@triton.jit
def row_length_and_chunk(Lengths, b, max_seq, divisor, max_chunk, BLOCK: tl.constexpr, SPLIT_SIZE: tl.constexpr):
    """Valid positions of row b (clamped to the pool) and positions per split: ceil(L / divisor) rounded up to
    BLOCK and at most max_chunk (a multiple of BLOCK; a row longer than divisor x max_chunk takes cdiv(L, max_chunk)
    splits, the grid holding that many), or SPLIT_SIZE when set (the fixed-split mode). Stage 1 and stage 2 must
    agree exactly."""
    length = tl.minimum(tl.maximum(tl.load(Lengths + b).to(tl.int32), 0), max_seq)
    if SPLIT_SIZE > 0:
        chunk = SPLIT_SIZE
    else:
        chunk = tl.minimum(tl.cdiv(tl.cdiv(length, divisor), BLOCK) * BLOCK, max_chunk)
    return length, chunk


@triton.jit
def _decode_stage2(
    MidO, MidLse, Lengths, Out,
    stride_ob, stride_oh,
    max_seq, num_splits, divisor, max_chunk,
    Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DS: tl.constexpr, HEADS: tl.constexpr,
):
    # grid (B, cdiv(Hq, HEADS), cdiv(D, BLOCK_DS)): merges all splits of (row, head) over BLOCK_DS dims at once,
    # for HEADS heads in turn (each the same tile, so the bits do not depend on HEADS).
    b = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_d = tl.program_id(2)
    length, chunk = row_length_and_chunk(Lengths, b, max_seq, divisor, max_chunk, BLOCK_N, 0)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = pid_d * BLOCK_DS + tl.arange(0, BLOCK_DS)
    mask_d = offs_d < HEAD_DIM
    # The same test as stage 1's `start < end`: inactive splits were never written.
    active = (offs_s < num_splits) & (offs_s * chunk < length)
    for i in tl.static_range(HEADS):
        h = pid_h * HEADS + i
        if h < Q_HEADS:
            row = (b.to(tl.int64) * Q_HEADS + h) * num_splits + offs_s  # (BLOCK_S,)
            lse = tl.load(MidLse + row, mask=active, other=float("-inf"))
            part = tl.load(
                MidO + row[:, None] * HEAD_DIM + offs_d[None, :],
                mask=active[:, None] & mask_d[None, :], other=0.0,
            )  # (BLOCK_S, BLOCK_DS)
            m = tl.max(lse, 0)
            m = tl.where(m == float("-inf"), 0.0, m)  # length 0: no split active, output zeros
            w = tl.math.exp2(lse - m)  # (BLOCK_S,), the largest is exactly 1 when any split is active
            acc = tl.sum(w[:, None] * part, 0)
            denom = tl.maximum(tl.sum(w, 0), 1e-30)
            tl.store(Out + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d, (acc / denom).to(Out.dtype.element_ty),
                     mask=mask_d)


def merge_splits(mid_o: torch.Tensor, mid_lse: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor, max_seq: int,
                 block_n: int, warps: int | None = None, heads: int | None = None, divisor: int | None = None,
                 max_chunk: int | None = None) -> None:
    """Stage 2 by count: mid_o (B, Hq, S, D), mid_lse (B, Hq, S) fp32 -> out (B, Hq, D), in place. block_n: stage
    1's tile (the splits' edges); warps, heads: the launch (None: STAGE2_WARPS, STAGE2_HEADS, read at the call).
    divisor, max_chunk: stage 1's (None: S, and no cap)."""
    batch, q_heads, num_splits, head_dim = mid_o.shape
    divisor = num_splits if divisor is None else divisor
    max_chunk = no_chunk_cap(max_seq, block_n) if max_chunk is None else max_chunk
    heads = heads or STAGE2_HEADS
    block_s = max(2, triton.next_power_of_2(num_splits))
    block_ds = min(max(16, triton.next_power_of_2(head_dim)), max(16, _MERGE_ELEMS // block_s))
    _decode_stage2[(batch, triton.cdiv(q_heads, heads), triton.cdiv(head_dim, block_ds))](
        mid_o, mid_lse, lengths, out,
        out.stride(0), out.stride(1),
        max_seq, num_splits, divisor, max_chunk,
        Q_HEADS=q_heads, HEAD_DIM=head_dim,
        BLOCK_N=block_n, BLOCK_S=block_s, BLOCK_DS=block_ds, HEADS=heads,
        num_warps=warps or STAGE2_WARPS,
    )


@triton.jit
def merge_split_partials(MidO, MidLse, base, n_splits, offs_d, mask_d,
                         HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DS: tl.constexpr):
    """Merge one (row, head)'s first n_splits partials, in index order, BLOCK_S at a time -> (BLOCK_DS,) fp32.

    MidO[(base + j) * HEAD_DIM + d] = split j's acc / l, MidLse[base + j] = its m + log2 l (log2 units). Each tile
    is a log-sum-exp step of a fixed shape, carried like flash attention's online softmax: (m, acc, denom) rescaled
    by exp2(m_old - m_new). n_splits == 0 (a row of length 0) gives zeros. Meant to be shared with a chunk
    kernel that cuts prompt rows at the same positions."""
    m = float("-inf")
    acc = tl.zeros([BLOCK_DS], dtype=tl.float32)
    denom = 0.0
    for s0 in range(0, n_splits, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        active = offs_s < n_splits
        row = base + offs_s  # (BLOCK_S,) int64
        lse = tl.load(MidLse + row, mask=active, other=float("-inf"))
        part = tl.load(
            MidO + row[:, None] * HEAD_DIM + offs_d[None, :],
            mask=active[:, None] & mask_d[None, :], other=0.0,
        )  # (BLOCK_S, BLOCK_DS)
        m_new = tl.maximum(m, tl.max(lse, 0))  # finite: the tile holds >= 1 active split
        alpha = tl.math.exp2(m - m_new)  # 0 on the first tile
        w = tl.math.exp2(lse - m_new)  # (BLOCK_S,)
        acc = acc * alpha + tl.sum(w[:, None] * part, 0)
        denom = denom * alpha + tl.sum(w, 0)
        m = m_new
    return acc / tl.maximum(denom, 1e-30)


@triton.jit
def _decode_stage2_fixed(
    MidO, MidLse, Lengths, Out,
    stride_ob, stride_oh,
    max_seq, num_splits,
    Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    SPLIT_SIZE: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DS: tl.constexpr,
):
    # grid (B, Hq, cdiv(D, BLOCK_DS)); MidO (B, Hq, num_splits, D), MidLse (B, Hq, num_splits) fp32 -> Out (B, Hq, D).
    b = tl.program_id(0)
    h = tl.program_id(1)
    pid_d = tl.program_id(2)
    # The same length (clamped to the pool) and split test as stage 1: split j is active iff j * SPLIT_SIZE < L.
    length = tl.minimum(tl.maximum(tl.load(Lengths + b).to(tl.int32), 0), max_seq)
    n_splits = tl.cdiv(length, SPLIT_SIZE)
    offs_d = pid_d * BLOCK_DS + tl.arange(0, BLOCK_DS)
    mask_d = offs_d < HEAD_DIM
    base = (b.to(tl.int64) * Q_HEADS + h) * num_splits
    out = merge_split_partials(MidO, MidLse, base, n_splits, offs_d, mask_d, HEAD_DIM, BLOCK_S, BLOCK_DS)
    tl.store(Out + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=mask_d)


def merge_block_ds(head_dim: int) -> int:
    """Head dims per stage-2 program: from the head dim alone (the tile is (MERGE_TILE, BLOCK_DS))."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    return min(block_d, max(16, _MERGE_ELEMS // MERGE_TILE))


def merge_fixed_splits(mid_o: torch.Tensor, mid_lse: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor,
                       max_seq: int, split_size: int) -> None:
    """Stage 2 of the fixed-split mode: mid_o (B, Hq, S, D), mid_lse (B, Hq, S) fp32 -> out (B, Hq, D), in place."""
    batch, q_heads, num_splits, head_dim = mid_o.shape
    block_ds = merge_block_ds(head_dim)
    _decode_stage2_fixed[(batch, q_heads, triton.cdiv(head_dim, block_ds))](
        mid_o, mid_lse, lengths, out,
        out.stride(0), out.stride(1),
        max_seq, num_splits,
        Q_HEADS=q_heads, HEAD_DIM=head_dim,
        SPLIT_SIZE=split_size, BLOCK_S=MERGE_TILE, BLOCK_DS=block_ds,
        num_warps=4,
    )
