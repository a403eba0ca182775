"""A mixed step's attention in one launch: the prompt rows' chunk programs and the decode rows' programs in one grid.

Why: a mixed step (kvtransfer/engine/mixed.py) runs two attention kernels a layer, the decode rows' (memory bound:
each row streams its K/V) and the prompt rows' (tensor cores: triton_chunk_attention.py). Neither fills the GPU
well alone, and run one after the other their times add. On a side stream (kvtransfer/engine/side_stream.py)
they overlap only as far as the decode kernel's programs, which fill every SM, leave room, and each layer pays a
fork and a join. Here both kinds of programs are one grid: the chunk programs first (the longer ones start
first), then one program per (decode row, kv head's head block) over the row's whole length. The chunk programs
fill the SMs the decode kernel's split count was there to fill, so every decode row takes one split, whose
output is final: no merge kernel either. One launch a layer instead of three (stage 1, its merge, the chunk
kernel), no stream join.

When: `fuses` says, from static shapes only (one CUDA graph per bucket), when the decode rows at one split make at
least one program per SM, and `ops.mixed_attention_fuses` adds that the pool's rows hold no more than the decode
kernel's per-split cap (triton_attention.LONG_CHUNK): one program reads a decode row here, so one long row would
hold the launch. Fewer decode rows over long contexts want splits (triton_attention.choose_num_splits), and the
step keeps the two kernels there (kvtransfer/engine/runner.py, MIXED_ATTENTION).

Bits: a decode row's output equals the decode kernel's at num_splits=1 without the cap (max_chunk=0; the same program;
the merge of one split is exact), a prompt row's equals the chunk kernel's (the same program and tiles). So a decode
row's bits in a fused step differ from the two-kernel step's only where that one uses more splits (another sum order;
default mode, not batch-invariant). The batch-invariant mode never comes here."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtransfer.kernels import triton_attention as TA
from kvtransfer.kernels import triton_chunk_attention as TC
from kvtransfer.kernels.triton_paging import table_args

NUM_WARPS = 4  # both kernels' own launch
# The launch, from a sweep of grid order x warps 4/8 x stages 2/3 at 64 and 128 decode rows beside 448 / 384 prompt
# rows (bench/results/fused-h100-2026-12-07/call2/mixed-sweep.log): 3 stages the fastest at both, with the bits of 2;
# 8 warps slower (and other bits at 128 rows); the decode programs first slower. 2-byte dtypes only: fp32 tiles
# take 2 (3 would need 180 KB of shared memory, over an A100's 164 KB), as the chunk kernel.
NUM_STAGES = 3
DECODE_FIRST = False  # the grid's order: the chunk programs first (the longer ones start first); a sweep's


def fuses(decode_rows: int, kv_heads: int, head_blocks: int, sm_count: int) -> bool:
    """Whether a mixed step of `decode_rows` rows (its bucket) takes the fused kernel: their programs at one split
    fill one program an SM (64 rows x 4 kv heads of Qwen2.5-7B: 256 on 132 SMs). Static shapes only."""
    return decode_rows > 0 and decode_rows * kv_heads * head_blocks >= sm_count


def fuses_on(decode_rows: int, q_heads: int, kv_heads: int, device: torch.device) -> bool:
    """`fuses` for these heads on `device` (8 SMs assumed off CUDA: the interpreter, as default_num_splits)."""
    head_blocks = triton.cdiv(q_heads // kv_heads, TA.BLOCK_H)
    if device.type == "cuda":
        sm_count = TA._sm_count(device.index if device.index is not None else torch.cuda.current_device())
    else:
        sm_count = 8
    return fuses(decode_rows, kv_heads, head_blocks, sm_count)


@triton.jit(do_not_specialize=["blocks_per_piece", "chunk_programs", "decode_rows"])
def _mixed_attention(
    Qd, Qc, K, V, Slots, Lengths, Pieces, Table, Od, Oc,
    qk_scale_log2,
    stride_qr, stride_qh,
    stride_ks, stride_kh, stride_kt, stride_tr,
    stride_or, stride_oh,
    blocks_per_piece, chunk_programs, decode_rows, max_seq,
    Q_HEADS: tl.constexpr, GROUPS: tl.constexpr, HEAD_BLOCKS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK_BLOCK_N: tl.constexpr, DECODE_BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr, UPCAST_DOT: tl.constexpr, PAGE: tl.constexpr, PAGED: tl.constexpr,
    DECODE_FIRST: tl.constexpr,
):
    # grid (chunk_programs + decode_rows * Hkv * HEAD_BLOCKS,): program p < chunk_programs is the chunk kernel's
    # (p % (P * blocks_per_piece), p // (P * blocks_per_piece)); the rest the decode kernel's (b, pid_h, split 0)
    # with b fastest, as their own grids order them. Qd/Od: the decode rows (decode_rows, Hq, D); Qc/Oc: the prompt
    # rows (pieces' first rows count from there). Both share q's and out's strides. DECODE_FIRST (a sweep's): the
    # decode programs take the grid's first ids instead; each program does the same work either way.
    pid = tl.program_id(0)
    if DECODE_FIRST:
        decode_programs = tl.num_programs(0) - chunk_programs
        pid = (pid + chunk_programs) % (chunk_programs + decode_programs)
    if pid < chunk_programs:
        piece_blocks = chunk_programs // Q_HEADS
        TC.chunk_program(Qc, K, V, Pieces, Table, Oc, pid % piece_blocks, pid // piece_blocks, qk_scale_log2,
                         stride_qr, stride_qh, stride_ks, stride_kh, stride_kt, stride_tr, stride_or, stride_oh,
                         blocks_per_piece, GROUPS, HEAD_DIM, BLOCK_D, BLOCK_M, CHUNK_BLOCK_N, UPCAST_DOT, PAGE,
                         PAGED)
    else:
        did = pid - chunk_programs
        TA.decode_program(Qd, K, V, Slots, Table, Lengths, Od, Od, Od, did % decode_rows, did // decode_rows, 0,
                          qk_scale_log2, stride_qr, stride_qh, stride_ks, stride_kh, stride_kt, stride_tr,
                          stride_or, stride_oh, max_seq, 1, 1, tl.cdiv(max_seq, DECODE_BLOCK_N) * DECODE_BLOCK_N,
                          Q_HEADS, GROUPS, HEAD_BLOCKS, HEAD_DIM, BLOCK_D,
                          DECODE_BLOCK_N, BLOCK_H, UPCAST_DOT, PAGE, PAGED, 0, True)


def mixed_attention_triton(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, decode_rows: int,
                           slots: torch.Tensor, lengths: torch.Tensor, pieces: torch.Tensor, scale: float,
                           block_table: torch.Tensor | None = None, out: torch.Tensor | None = None,
                           num_stages: int | None = None, num_warps: int | None = None,
                           decode_first: bool | None = None) -> torch.Tensor:
    """Shapes as `kvtransfer.kernels.ops.mixed_attention` (checked there): q (B, Hq, D) unit stride on D, rows
    :decode_rows decode rows (slots, lengths (decode_rows,)), the rest the pieces' (P, 4) prompt rows -> `out`
    (B, Hq, D) (None: a new tensor, zero on prompt rows outside every piece). num_stages, num_warps, decode_first:
    a sweep's (None: NUM_STAGES, NUM_WARPS, DECODE_FIRST, read at the call)."""
    rows, q_heads, head_dim = q.shape
    kv_heads = k_pool.shape[1]
    table, stride_tr, width, page, paged = table_args(block_table, k_pool)
    if out is None:
        out = torch.zeros_like(q)
    d = decode_rows
    groups = q_heads // kv_heads
    head_blocks = triton.cdiv(groups, TA.BLOCK_H)
    blocks = max(1, triton.cdiv(rows - d, TC.BLOCK_M))  # as the chunk kernel's own launch over q[d:]
    chunk_programs = pieces.shape[0] * blocks * q_heads if rows > d else 0
    grid = (chunk_programs + d * kv_heads * head_blocks,)
    if grid[0] == 0:
        return out
    # an empty side gets its neighbour's pointer (never read: no program of that kind)
    qd, qc = (q[:d], q[d:]) if 0 < d < rows else (q, q)
    od, oc = (out[:d], out[d:]) if 0 < d < rows else (out, out)
    _mixed_attention[grid](
        qd, qc, k_pool, v_pool, slots, lengths, pieces, table, od, oc,
        float(scale) * TA._LOG2E,
        q.stride(0), q.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), stride_tr,
        out.stride(0), out.stride(1),
        blocks, chunk_programs, max(d, 1), width * page,
        Q_HEADS=q_heads, GROUPS=groups, HEAD_BLOCKS=head_blocks, HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_M=TC.BLOCK_M, CHUNK_BLOCK_N=TC.BLOCK_N,
        DECODE_BLOCK_N=TA.BLOCK_N, BLOCK_H=TA.BLOCK_H, UPCAST_DOT=TA._upcast_dots(q), PAGE=page, PAGED=paged,
        DECODE_FIRST=DECODE_FIRST if decode_first is None else bool(decode_first),
        num_warps=num_warps or NUM_WARPS,
        num_stages=num_stages or (NUM_STAGES if q.element_size() == 2 else 2),  # fp32 tiles: 3 stages overflow sm_80
    )
    return out
