"""Triton flash-decoding (split-K) attention over the KV pool, slot-shaped or paged (triton_paging.py).

Why: a decode step is memory bound on reading K/V; one program per (row, head) cannot fill an
H200 when B is small and the rows are long, so each row's valid length is cut into
`num_splits` chunks read in parallel (stage 1) and merged by log-sum-exp (stage 2).

Design after SGLang's Triton decode attention (`_fwd_grouped_kernel_stage1` and `_fwd_kernel_stage2` in
python/sglang/srt/layers/attention/triton_ops/decode_attention.py, Apache-2.0, itself after LightLLM), rewritten for
this pool: row b finds its positions through `triton_paging.tile_offsets` (its slot's (max_seq, D) matrix, or its
blocks through the block table). As there, one program takes all G query heads of one kv head (padded to BLOCK_H = 16
rows for tl.dot, masked), so K/V are read once per group and never repeated in memory; and a row's valid length is cut
into num_splits equal chunks (rounded up to BLOCK_N), so every split of a long row does work. Splits whose chunk starts
at or past the length (short rows, padded rows of length 1) exit at once and stage 2 (triton_attention_split.py) skips
them. A split takes at most LONG_CHUNK positions: a row longer than count x LONG_CHUNK takes more splits (the grid
holds the longest row's), so one long row among short ones is read by many programs, not held by a few. At one split
in the grid (a batch that fills the SMs by itself, in a pool whose rows fit one chunk, or with the cap off) stage 1
writes the output and no merge runs: the merge of one split is exact, so the bits are the same, and a layer pays one
launch, not two. The batch-invariant mode passes `split_size` instead: every row cut at multiples of it, so a row's
splits depend on its own length only, merged by triton_attention_split.py. Each K/V tile goes through the online
softmax step the chunk kernel shares (triton_softmax.py).

num_splits is a Python int from static shapes only (B, kv heads, max_seq, SM count), so one captured CUDA graph stays
valid for any lengths: see `choose_num_splits`. It is a runtime kernel argument, so batch buckets with different split
counts share one compiled kernel. Scores and the softmax run in fp32 in the log2 domain (exp2); P is rounded to the KV
dtype for the P @ V dot, as flash attention does and as HF rounds the fp32 softmax to the model dtype before @ V. fp32
pools use IEEE dots (no TF32); so do CPU tensors, which only run under the Triton interpreter (its tl.dot gives wrong
results for bf16 inputs; Triton 3.6).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvtransfer.kernels.triton_attention_split import (  # noqa: F401
    INVARIANT_SPLIT_SIZE,
    merge_fixed_splits,
    merge_splits,
    no_chunk_cap,
    row_length_and_chunk,
)
from kvtransfer.kernels.triton_paging import table_args, tile_offsets
from kvtransfer.kernels.triton_softmax import dot, online_softmax_step

BLOCK_N = 64  # positions per inner step of stage 1
BLOCK_H = 16  # query heads per stage-1 program (tl.dot needs M >= 16): G is padded / tiled by it
STAGE1_WARPS = 4  # stage 1's launch (bench/probes/chunk_attention.py --decode-sweep times others)
STAGE1_STAGES = 2
MAX_SPLITS = 256  # bounds the stage-2 tile (all splits of a row are merged in one shot)
PROGRAMS_PER_SM = 2  # choose_num_splits' aim: stage-1 programs a split count makes, per SM (was 6 before 2026-12-06)
# The most positions one split of a row takes (a multiple of BLOCK_N; 0: no cap): see decode_attention_triton's
# max_chunk. Chosen against 2,048 and 4,096 and no cap with one 32k row among 1k ones, and priced where no row is
# long (the grid's empty splits, no one-launch path): bench/results/fused-h100-2026-12-07 call 5, and the README.
LONG_CHUNK = 1024
_LOG2E = 1.4426950408889634


@functools.lru_cache(maxsize=16)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(batch: int, kv_heads: int, head_blocks: int, max_seq: int, sm_count: int) -> int:
    """Splits per row, from static shapes only (so one CUDA graph serves any lengths).

    Aim for PROGRAMS_PER_SM * SMs stage-1 programs in all when the rows are full (programs per split = B * Hkv *
    head_blocks), capped so that a full-length row's chunk is >= BLOCK_N positions, and at MAX_SPLITS. Measured
    (bench/results/splits-h100-2026-12-06: `python -m bench.probes.chunk_attention --split-sweep`, one H100, Qwen2.5-7B's
    heads): fewer, longer programs read faster than ~1.2 waves of them (5 resident per SM), as each program's fixed
    cost (its query, its partial output, the merge) is paid once per split. 132 SMs, 4 kv heads: B=1 -> 66 splits
    (chunks of 512 at 32k); B=8 -> 9; B=32 -> 3; B=64 -> 2 (chunks of 512 at 1k); B >= 66 -> 1. The count cuts a
    row into chunks of ceil(L / count); `decode_attention_triton`'s max_chunk (LONG_CHUNK) caps them, and the grid
    grows to cdiv(max_seq, LONG_CHUNK) splits where that is more.
    """
    per_split = max(1, batch * kv_heads * head_blocks)
    want = triton.cdiv(PROGRAMS_PER_SM * sm_count, per_split)
    cap = max(1, min(MAX_SPLITS, triton.cdiv(max_seq, BLOCK_N)))
    return max(1, min(want, cap))


def default_num_splits(batch: int, q_heads: int, kv_heads: int, max_seq: int, device: torch.device) -> int:
    """`choose_num_splits` for these shapes on `device` (8 SMs assumed off CUDA: interpreter)."""
    head_blocks = triton.cdiv(q_heads // kv_heads, BLOCK_H)
    sm_count = _sm_count(device.index if device.index is not None else torch.cuda.current_device()) if device.type == "cuda" else 8
    return choose_num_splits(batch, kv_heads, head_blocks, max_seq, sm_count)


def capped_splits(max_seq: int, num_splits: int, block_n: int = BLOCK_N, max_chunk: int | None = None
                  ) -> tuple[int, int]:
    """(the grid's splits, the positions a split takes at most; 0: no cap) for `num_splits` by count in rows of
    `max_seq` positions. max_chunk None: LONG_CHUNK, read at the call. The cap grows to keep the grid at MAX_SPLITS,
    and the grid holds the longest row's splits: max(num_splits, cdiv(max_seq, cap))."""
    max_chunk = LONG_CHUNK if max_chunk is None else int(max_chunk)
    if not max_chunk:
        return num_splits, 0
    if max_chunk < 0 or max_chunk % block_n:
        raise ValueError(f"max_chunk {max_chunk} must be a positive multiple of {block_n} (or 0: no cap)")
    max_chunk = max(max_chunk, triton.cdiv(triton.cdiv(max_seq, MAX_SPLITS), block_n) * block_n)
    return max(num_splits, triton.cdiv(max_seq, max_chunk)), max_chunk


@triton.jit
def decode_program(
    Q, K, V, Slots, Table, Lengths, MidO, MidLse, Out, b, pid_h, split,
    qk_scale_log2,
    stride_qb, stride_qh,
    stride_ks, stride_kh, stride_kt, stride_tr,
    stride_ob, stride_oh,
    max_seq, num_splits, divisor, max_chunk,
    Q_HEADS: tl.constexpr, GROUPS: tl.constexpr, HEAD_BLOCKS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, UPCAST_DOT: tl.constexpr,
    PAGE: tl.constexpr, PAGED: tl.constexpr, SPLIT_SIZE: tl.constexpr, FINAL: tl.constexpr,
):
    """Stage 1's program (b, pid_h, split): one split of row b for the query heads of one kv head's head block.
    SPLIT_SIZE 0: S chunks of ceil(L / S); > 0: split j covers [j * SPLIT_SIZE, (j + 1) * SPLIT_SIZE) of every row.
    FINAL (one split, no merge: the fused mixed kernel, triton_mixed_attention.py): the program writes the row's
    output into Out (strides stride_ob, stride_oh; its dtype) instead of its partial into MidO / MidLse. The merge
    of one split is exact (weight 1, the other 0), so both give the same bits."""
    kv_head = pid_h // HEAD_BLOCKS
    head_block = pid_h % HEAD_BLOCKS

    length, chunk = row_length_and_chunk(Lengths, b, max_seq, divisor, max_chunk, BLOCK_N, SPLIT_SIZE)
    start = split * chunk
    end = tl.minimum(start + chunk, length)
    offs_g = head_block * BLOCK_H + tl.arange(0, BLOCK_H)  # head index inside the group
    mask_h = offs_g < GROUPS
    heads = kv_head * GROUPS + offs_g  # (BLOCK_H,) query heads of this kv head
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    b64 = b.to(tl.int64)
    if start < end:
        q = tl.load(
            Q + b64 * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
            mask=mask_h[:, None] & mask_d[None, :], other=0.0,
        )  # (BLOCK_H, BLOCK_D)
        slot = tl.load(Slots + b).to(tl.int64)  # the row's slot, or its block-table row when PAGED
        k_base = K + kv_head.to(tl.int64) * stride_kh
        v_base = V + kv_head.to(tl.int64) * stride_kh

        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            off = tile_offsets(Table, slot, stride_tr, n0, offs_n, mask_n, stride_ks, stride_kt,
                               PAGE, BLOCK_N, PAGED)  # (BLOCK_N,) int64
            k = tl.load(
                k_base + off[None, :] + offs_d[:, None],
                mask=mask_n[None, :] & mask_d[:, None], other=0.0,
            )  # (BLOCK_D, BLOCK_N)
            # Every step has >= 1 valid position, so m_new is finite for every row.
            s = tl.where(mask_n[None, :], dot(q, k, UPCAST_DOT) * qk_scale_log2, float("-inf"))  # (BLOCK_H, BLOCK_N)
            v = tl.load(
                v_base + off[:, None] + offs_d[None, :],
                mask=mask_n[:, None] & mask_d[None, :], other=0.0,
            )  # (BLOCK_N, BLOCK_D)
            acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, s, v, UPCAST_DOT)

        if FINAL:
            tl.store(
                Out + b64 * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                (acc / l_i[:, None]).to(Out.dtype.element_ty),
                mask=mask_h[:, None] & mask_d[None, :],
            )
        else:
            row = (b64 * Q_HEADS + heads) * num_splits + split  # (BLOCK_H,) index into (B, Hq, S)
            tl.store(
                MidO + row[:, None] * HEAD_DIM + offs_d[None, :],
                acc / l_i[:, None],
                mask=mask_h[:, None] & mask_d[None, :],
            )
            tl.store(MidLse + row, m_i + tl.math.log2(l_i), mask=mask_h)
    elif FINAL:  # a row of length 0: zeros, as the merge writes for a row with no split active
        tl.store(Out + b64 * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 tl.zeros([BLOCK_H, BLOCK_D], dtype=Out.dtype.element_ty), mask=mask_h[:, None] & mask_d[None, :])


@triton.jit
def _decode_stage1(
    Q, K, V, Slots, Table, Lengths, MidO, MidLse, Out,
    qk_scale_log2,
    stride_qb, stride_qh,
    stride_ks, stride_kh, stride_kt, stride_tr,
    stride_ob, stride_oh,
    max_seq, num_splits, divisor, max_chunk,
    Q_HEADS: tl.constexpr, GROUPS: tl.constexpr, HEAD_BLOCKS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, UPCAST_DOT: tl.constexpr,
    PAGE: tl.constexpr, PAGED: tl.constexpr, SPLIT_SIZE: tl.constexpr, FINAL: tl.constexpr,
):
    # grid (B, Hkv * HEAD_BLOCKS, NUM_SPLITS); MidO (B, Hq, S, D), MidLse (B, Hq, S) fp32. K and V share strides.
    # FINAL (one split by count, no merge): each program writes its rows' output into Out (B, Hq, D) instead.
    decode_program(Q, K, V, Slots, Table, Lengths, MidO, MidLse, Out, tl.program_id(0), tl.program_id(1),
                   tl.program_id(2), qk_scale_log2, stride_qb, stride_qh, stride_ks, stride_kh, stride_kt, stride_tr,
                   stride_ob, stride_oh, max_seq, num_splits, divisor, max_chunk, Q_HEADS, GROUPS, HEAD_BLOCKS,
                   HEAD_DIM, BLOCK_D,
                   BLOCK_N, BLOCK_H, UPCAST_DOT, PAGE, PAGED, SPLIT_SIZE, FINAL)


def _upcast_dots(q: torch.Tensor) -> bool:
    # fp32 pools: IEEE dots, no TF32. CPU tensors run only under the Triton interpreter, whose
    # tl.dot mishandles bf16: there the dots run in fp32 on the same rounded values.
    return q.dtype == torch.float32 or q.device.type != "cuda"


def decode_attention_triton(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    block_table: torch.Tensor | None = None,
    split_size: int | None = None,
    out: torch.Tensor | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    block_n: int | None = None,
    stage2: tuple[int, int] | None = None,
    max_chunk: int | None = None,
) -> torch.Tensor:
    """Split-K decode attention; shapes as `kvtransfer.kernels.ops.decode_attention` (checked there).

    num_warps, num_stages: stage 1's launch (None: STAGE1_WARPS, STAGE1_STAGES, read at the call; a probe's sweep).
    A program's tiles and their order do not depend on them. stage2: the merge's (warps, query heads a program), as
    `merge_splits` (a probe's sweep). block_n: positions per stage-1 tile (None: BLOCK_N; a
    power of two >= 16, a probe's sweep); it moves the splits' edges, so the output's bits may change with it.

    q: (B, Hq, D) with unit stride on D; pools (S, Hkv, T, D) contiguous; returns (B, Hq, D): `out` when given
    (unit stride on D), else a new tensor.
    block_table: None (slot layout: row b reads slot slots[b]) or (R, W) int32 (paged: row b reads blocks
    block_table[slots[b]], T positions each). The split count depends on the context a row can hold (T, or W * T),
    never on the paging. num_splits: None picks `choose_num_splits` (static shapes only); an int overrides (bench).
    split_size: None as above; a positive multiple of BLOCK_N (the batch-invariant mode, INVARIANT_SPLIT_SIZE
    there) cuts every row at multiples of it, cdiv(max_seq, split_size) splits, merged by triton_attention_split.
    One split by count and no stage2: stage 1 writes `out` itself (FINAL), the merge's bits, zeros on a row of
    length 0. max_chunk (by count only; None: LONG_CHUNK, read at the call; 0: no cap): the most positions a split
    takes. The count above still cuts a row into chunks of ceil(L / count), but a row longer than count x max_chunk
    takes cdiv(L, max_chunk) splits, and the grid holds cdiv(max_seq, max_chunk) of them: one long row among short
    ones no longer holds the step for its few long programs. A row short enough keeps its edges, so its bits are
    those of the uncapped count whenever the grid does not grow.
    """
    batch, q_heads, head_dim = q.shape
    kv_heads = k_pool.shape[1]
    table, stride_tr, width, page, paged = table_args(block_table, k_pool)
    max_seq = width * page  # the positions a row can hold
    block_n = BLOCK_N if block_n is None else block_n
    if block_n < 16 or block_n & (block_n - 1) or (split_size is not None and block_n != BLOCK_N):
        raise ValueError(f"block_n {block_n} must be a power of two >= 16, without split_size")
    groups = q_heads // kv_heads
    head_blocks = triton.cdiv(groups, BLOCK_H)
    if split_size is not None:
        split_size = int(split_size)
        if num_splits is not None or split_size <= 0 or split_size % BLOCK_N:
            raise ValueError(f"split_size {split_size} must be a positive multiple of {BLOCK_N}, without num_splits")
        num_splits = triton.cdiv(max_seq, split_size)  # static: no MAX_SPLITS cap, the merge folds tiles in order
    else:
        if num_splits is None:
            num_splits = default_num_splits(batch, q_heads, kv_heads, max_seq, q.device)
        num_splits = max(1, min(int(num_splits), MAX_SPLITS))
    divisor, cap = num_splits, no_chunk_cap(max_seq, block_n)
    if split_size is None:
        num_splits, max_chunk = capped_splits(max_seq, num_splits, block_n, max_chunk)
        cap = min(cap, max_chunk) if max_chunk else cap
    block_d = max(16, triton.next_power_of_2(head_dim))
    out = torch.empty((batch, q_heads, head_dim), dtype=q.dtype, device=q.device) if out is None else out
    # One split by count and no merge sweep: stage 1 writes the output itself (the merge of one split is exact,
    # so the bits are the merge's; one launch a layer instead of two). The fixed-size mode always merges.
    final = split_size is None and num_splits == 1 and stage2 is None
    if final:
        mid_o = mid_lse = out  # never read or written
    else:
        mid_o = torch.empty((batch, q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((batch, q_heads, num_splits), dtype=torch.float32, device=q.device)
    _decode_stage1[(batch, kv_heads * head_blocks, num_splits)](
        q, k_pool, v_pool, slots, table, lengths, mid_o, mid_lse, out,
        float(scale) * _LOG2E,
        q.stride(0), q.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), stride_tr,
        out.stride(0), out.stride(1),
        max_seq, num_splits, divisor, cap,
        Q_HEADS=q_heads, GROUPS=groups, HEAD_BLOCKS=head_blocks, HEAD_DIM=head_dim,
        BLOCK_D=block_d, BLOCK_N=block_n, BLOCK_H=BLOCK_H,
        UPCAST_DOT=_upcast_dots(q), PAGE=page, PAGED=paged, SPLIT_SIZE=split_size or 0, FINAL=final,
        num_warps=num_warps or STAGE1_WARPS, num_stages=num_stages or STAGE1_STAGES,
    )
    if final:
        return out
    if split_size is not None:
        merge_fixed_splits(mid_o, mid_lse, lengths, out, max_seq, split_size)
        return out
    merge_splits(mid_o, mid_lse, lengths, out, max_seq, block_n, *(stage2 or (None, None)), divisor=divisor,
                 max_chunk=cap)
    return out
