"""Causal attention of prompt-chunk rows over their row's cache (slot or block table), flash style (Triton).

Why: a mixed step (kvtransfer/engine/mixed.py) carries up to MAX_PIECES prompt chunks as rows of the
decode step. Through the decode kernel each such row streams its slot's K/V on its own: an
n-token prompt then reads ~n^2/2 positions per layer, several times what flash attention over the
same rows reads (`python -m bench.probes.probe_round --only mixed` measures both).
Here one program takes BLOCK_M consecutive rows of one chunk and one query head, and reads
each K/V tile once for all of them, on tensor cores.

Inputs are static-shaped, so a CUDA graph replays it for any pieces: `pieces` is a (P, 4) int32
device tensor, one row per chunk: first row in q, rows, slot, position of its first row (unused
pieces have 0 rows; a piece whose slot is negative names rows to zero, a step's padding). Row r of a chunk
sits at position start + r of its slot and attends over positions 0..start + r of it (its own K/V already
written, as the step writes all before any row attends). The tiles of keys below a program's first row are
every row's past: they are read without masks, and only the tiles from there to the last row's position
compare positions. The output may be a slice of the step's attention output (the decode rows' kernel writes
the rest, runner.py), so nothing is concatenated. The online softmax over each K/V tile is the
decode kernel's own (`triton_softmax.online_softmax_step`): the two kernels tile different axes (64
rows of one head here; one row's query heads over a split there) but round the same way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtransfer.kernels import triton_attention
from kvtransfer.kernels.triton_paging import table_args, tile_offsets
from kvtransfer.kernels.triton_softmax import dot, online_softmax_step

BLOCK_M = 64  # rows of one chunk per program (bench/probes/chunk_attention.py sweeps it with the warps and stages)
BLOCK_N = 64  # keys per tile
NUM_WARPS = 4
NUM_STAGES = 3


@triton.jit
def _tile(q, k_base, v_base, Table, slot, stride_tr, n0, end, pos, offs_d, mask_d, acc, l_i, m_i,
          qk_scale_log2, stride_ks, stride_kt,
          BLOCK_N: tl.constexpr, UPCAST_DOT: tl.constexpr, PAGE: tl.constexpr, PAGED: tl.constexpr,
          MASKED: tl.constexpr, EVEN_D: tl.constexpr):
    """One K/V tile at keys n0 .. n0 + BLOCK_N - 1 into the rows' online softmax. MASKED: keys past `end` or past a
    row's position are left out; unmasked, every key of the tile is below every row's position (and inside the
    cache): no compare, no select."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < end
    off = tile_offsets(Table, slot, stride_tr, n0, offs_n, mask_n, stride_ks, stride_kt,
                       PAGE, BLOCK_N, PAGED)  # (BLOCK_N,) int64
    k_ptrs = k_base + off[None, :] + offs_d[:, None]  # (BLOCK_D, BLOCK_N)
    v_ptrs = v_base + off[:, None] + offs_d[None, :]  # (BLOCK_N, BLOCK_D)
    if MASKED:
        k = tl.load(k_ptrs, mask=mask_n[None, :] & mask_d[:, None], other=0.0)
        # causal: key n <= the row's position; key 0 always qualifies, so every row has a finite score
        s = tl.where((offs_n[None, :] <= pos[:, None]) & mask_n[None, :],
                     dot(q, k, UPCAST_DOT) * qk_scale_log2, float("-inf"))  # (BLOCK_M, BLOCK_N)
        v = tl.load(v_ptrs, mask=mask_n[:, None] & mask_d[None, :], other=0.0)
    else:
        if EVEN_D:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        else:
            k = tl.load(k_ptrs, mask=mask_d[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=mask_d[None, :], other=0.0)
        s = dot(q, k, UPCAST_DOT) * qk_scale_log2  # (BLOCK_M, BLOCK_N)
    return online_softmax_step(acc, l_i, m_i, s, v, UPCAST_DOT)


@triton.jit
def chunk_program(
    Q, K, V, Pieces, Table, Out, pid, h,
    qk_scale_log2,
    stride_qr, stride_qh,
    stride_ks, stride_kh, stride_kt, stride_tr,
    stride_or, stride_oh,
    blocks_per_piece,
    GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST_DOT: tl.constexpr,
    PAGE: tl.constexpr, PAGED: tl.constexpr,
):
    """The program (pid, h): BLOCK_M rows (block pid % blocks_per_piece of piece pid // blocks_per_piece) of query
    head h. Pieces (P, 4) int32: first row, rows, slot (table row when PAGED; < 0: rows to zero), start position.
    K and V share strides. Its own kernel's program, and the fused mixed kernel's (triton_mixed_attention.py)."""
    piece = pid // blocks_per_piece
    block = pid % blocks_per_piece
    row0 = tl.load(Pieces + piece * 4)
    n_rows = tl.load(Pieces + piece * 4 + 1)
    if block * BLOCK_M < n_rows:
        slot = tl.load(Pieces + piece * 4 + 2).to(tl.int64)
        start = tl.load(Pieces + piece * 4 + 3)
        offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < n_rows
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        rows = (row0 + offs_m).to(tl.int64)  # (BLOCK_M,) rows of q / out
        out_ptrs = Out + rows[:, None] * stride_or + h * stride_oh + offs_d[None, :]
        out_mask = mask_m[:, None] & mask_d[None, :]
        if slot < 0:  # a step's padding rows: zeros
            tl.store(out_ptrs, tl.zeros([BLOCK_M, BLOCK_D], dtype=Out.dtype.element_ty), mask=out_mask)
        else:
            q = tl.load(Q + rows[:, None] * stride_qr + h * stride_qh + offs_d[None, :],
                        mask=out_mask, other=0.0)  # (BLOCK_M, BLOCK_D)
            kv_head = (h // GROUPS).to(tl.int64)
            k_base = K + kv_head * stride_kh
            v_base = V + kv_head * stride_kh
            pos = start + offs_m  # (BLOCK_M,) each row's position
            end = start + tl.minimum((block + 1) * BLOCK_M, n_rows)  # keys 0..end - 1 cover every row's past
            # keys below the block's first position are every row's past: whole tiles of them need no mask
            full = (start + block * BLOCK_M) // BLOCK_N * BLOCK_N
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
            for n0 in range(0, full, BLOCK_N):
                acc, l_i, m_i = _tile(q, k_base, v_base, Table, slot, stride_tr, n0, end, pos, offs_d, mask_d,
                                      acc, l_i, m_i, qk_scale_log2, stride_ks, stride_kt, BLOCK_N, UPCAST_DOT,
                                      PAGE, PAGED, False, BLOCK_D == HEAD_DIM)
            for n0 in range(full, end, BLOCK_N):
                acc, l_i, m_i = _tile(q, k_base, v_base, Table, slot, stride_tr, n0, end, pos, offs_d, mask_d,
                                      acc, l_i, m_i, qk_scale_log2, stride_ks, stride_kt, BLOCK_N, UPCAST_DOT,
                                      PAGE, PAGED, True, BLOCK_D == HEAD_DIM)
            tl.store(out_ptrs, (acc / l_i[:, None]).to(Out.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["blocks_per_piece"])  # one compile for every graph size and bucket
def _chunk_attention(
    Q, K, V, Pieces, Table, Out,
    qk_scale_log2,
    stride_qr, stride_qh,
    stride_ks, stride_kh, stride_kt, stride_tr,
    stride_or, stride_oh,
    blocks_per_piece,
    GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST_DOT: tl.constexpr,
    PAGE: tl.constexpr, PAGED: tl.constexpr,
):
    # grid (P * blocks_per_piece, Hq)
    chunk_program(Q, K, V, Pieces, Table, Out, tl.program_id(0), tl.program_id(1), qk_scale_log2, stride_qr,
                  stride_qh, stride_ks, stride_kh, stride_kt, stride_tr, stride_or, stride_oh, blocks_per_piece,
                  GROUPS, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, UPCAST_DOT, PAGE, PAGED)


def chunk_attention_triton(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, pieces: torch.Tensor,
                           scale: float, block_table: torch.Tensor | None = None, out: torch.Tensor | None = None,
                           block_m: int | None = None, num_warps: int | None = None,
                           num_stages: int | None = None) -> torch.Tensor:
    """Shapes as `kvtransfer.kernels.ops.chunk_attention` (checked there): q (R, Hq, D) unit stride on D, pools
    (S, Hkv, T, D) contiguous, pieces (P, 4) int32, block_table None (a piece's slot) or (rows, W) int32 (a
    piece's table row) -> `out` (R, Hq, D), unit stride on D (None: a new tensor, zero outside the pieces; given:
    its rows outside every piece are left as they are). block_m, num_warps, num_stages: the probe's sweep (None:
    this module's BLOCK_M, NUM_WARPS, NUM_STAGES (2 for fp32), read at the call)."""
    block_m, num_warps = block_m or BLOCK_M, num_warps or NUM_WARPS
    # 3 stages of fp32 tiles take ~180 KB of shared memory at D 128 (sm_90 has ~227 KB, an A100 ~164 KB): 2 there
    num_stages = num_stages or (NUM_STAGES if q.element_size() == 2 else 2)
    table, stride_tr, _, page, paged = table_args(block_table, k_pool)
    rows, q_heads, head_dim = q.shape
    groups = q_heads // k_pool.shape[1]
    if out is None:
        out = torch.zeros_like(q)
    blocks = max(1, triton.cdiv(rows, block_m))  # a piece has at most R rows
    upcast = triton_attention._upcast_dots(q)  # as the decode kernel (fp32 pools, the interpreter: fp32 dots)
    _chunk_attention[(pieces.shape[0] * blocks, q_heads)](
        q, k_pool, v_pool, pieces, table, out,
        scale * 1.4426950408889634,  # log2(e): exp2 in the kernel
        q.stride(0), q.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), stride_tr,
        out.stride(0), out.stride(1),
        blocks,
        GROUPS=groups, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, UPCAST_DOT=upcast, PAGE=page, PAGED=paged, num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
