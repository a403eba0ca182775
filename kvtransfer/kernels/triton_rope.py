"""Triton RoPE + KV-pool write for one decode step.

Why: HF applies RoPE to q and k with several elementwise kernels and the engine then
scatters k and v into the pool; fusing them saves launches and round trips per layer, which
matter in a decode step at small B.

Math: HF's rotate_half convention, out[:D/2] = x1*cos1 - x2*sin1, out[D/2:] = x2*cos2 + x1*sin2,
with cos/sin first rounded to the activation dtype (as HF's rotary embedding returns them).
Difference from the reference: the products and the sum are computed in fp32 and rounded
once, where HF rounds q*cos, rotate_half(q)*sin and their sum separately in bf16/fp16; the
results differ by at most about one unit in the last place of the activation dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtransfer.kernels.triton_paging import position_offset, table_args


@triton.jit
def _rotate(X, row_off, stride_h, offs_h, mask, c1, c2, s1, s2, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # X rows (heads) at X + row_off + h * stride_h; returns fp32 (BLOCK_H, BLOCK_HALF) halves.
    ptr = X + row_off + offs_h[:, None] * stride_h + tl.arange(0, BLOCK_HALF)[None, :]
    x1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2


# width and the pool's slot stride follow the fused prefill's block, which has the prompt's own length: not
# specialized, so any length runs the kernel compiled for the first (triton_paging.table_args)
@triton.jit(do_not_specialize=["stride_ps", "width"])
def _rope_store_kernel(
    Q, K, V, Cos, Sin, KPool, VPool, Slots, Table, Positions, QOut,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
    stride_cb, stride_sb, stride_ob, stride_oh,
    stride_ps, stride_ph, stride_pt, stride_tr,
    num_blocks, width,
    Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, PAGED: tl.constexpr,
):
    # grid (B,): one program rotates all heads of one row and writes its K/V position.
    HALF: tl.constexpr = HEAD_DIM // 2
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    mask_half = offs < HALF
    act_ty = Q.dtype.element_ty
    # cos/sin: (B, D), rounded to the activation dtype first, as HF hands them over.
    c1 = tl.load(Cos + b * stride_cb + offs, mask=mask_half, other=0.0).to(act_ty).to(tl.float32)[None, :]
    c2 = tl.load(Cos + b * stride_cb + HALF + offs, mask=mask_half, other=0.0).to(act_ty).to(tl.float32)[None, :]
    s1 = tl.load(Sin + b * stride_sb + offs, mask=mask_half, other=0.0).to(act_ty).to(tl.float32)[None, :]
    s2 = tl.load(Sin + b * stride_sb + HALF + offs, mask=mask_half, other=0.0).to(act_ty).to(tl.float32)[None, :]

    # q: (Hq, D) -> rotated into QOut (B, Hq, D)
    offs_hq = tl.arange(0, BLOCK_HQ)
    mask_q = (offs_hq < Q_HEADS)[:, None] & mask_half[None, :]
    q1, q2 = _rotate(Q, b * stride_qb, stride_qh, offs_hq, mask_q, c1, c2, s1, s2, HALF, BLOCK_HALF)
    o_ptr = QOut + b * stride_ob + offs_hq[:, None] * stride_oh + offs[None, :]
    tl.store(o_ptr, q1.to(QOut.dtype.element_ty), mask=mask_q)
    tl.store(o_ptr + HALF, q2.to(QOut.dtype.element_ty), mask=mask_q)

    # k (rotated) and v (plain) -> pools at (slot, :, pos, :), or (table[slot, pos // PAGE], :, pos % PAGE, :) when
    # PAGED; skipped if the slot, the block or pos are out of range.
    slot = tl.load(Slots + b).to(tl.int64)
    pos = tl.load(Positions + b).to(tl.int64)
    base, in_range = position_offset(Table, slot, stride_tr, pos, num_blocks, stride_ps, stride_pt, width,
                                     PAGE, PAGED)  # int64: pools can exceed 2^31 elements
    offs_hk = tl.arange(0, BLOCK_HKV)
    mask_k = (offs_hk < KV_HEADS)[:, None] & mask_half[None, :] & in_range
    k1, k2 = _rotate(K, b * stride_kb, stride_kh, offs_hk, mask_k, c1, c2, s1, s2, HALF, BLOCK_HALF)
    kp = KPool + base + offs_hk[:, None] * stride_ph + offs[None, :]
    tl.store(kp, k1.to(KPool.dtype.element_ty), mask=mask_k)
    tl.store(kp + HALF, k2.to(KPool.dtype.element_ty), mask=mask_k)

    offs_d = tl.arange(0, BLOCK_D)
    mask_v = (offs_hk < KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :] & in_range
    v = tl.load(V + b * stride_vb + offs_hk[:, None] * stride_vh + offs_d[None, :], mask=mask_v, other=0.0)
    tl.store(VPool + base + offs_hk[:, None] * stride_ph + offs_d[None, :], v.to(VPool.dtype.element_ty), mask=mask_v)


def rope_store_triton(q, k, v, cos, sin, k_pool, v_pool, slots, positions, block_table=None) -> torch.Tensor:
    """Shapes as `kvtransfer.kernels.ops.rope_store` (checked there); returns a new rotated q.

    Requires unit stride on the last dim of q, k, v, cos, sin; pools contiguous and alike. block_table: None (row b
    writes slot slots[b]) or (R, W) int32 (row b writes through table row slots[b]).
    """
    batch, q_heads, head_dim = q.shape
    num_blocks, kv_heads = k_pool.shape[:2]
    table, stride_tr, width, page, paged = table_args(block_table, k_pool)
    q_out = torch.empty((batch, q_heads, head_dim), dtype=q.dtype, device=q.device)
    _rope_store_kernel[(batch,)](
        q, k, v, cos, sin, k_pool, v_pool, slots, table, positions, q_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), sin.stride(0), q_out.stride(0), q_out.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), stride_tr,
        num_blocks, width,
        Q_HEADS=q_heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        BLOCK_HQ=max(2, triton.next_power_of_2(q_heads)), BLOCK_HKV=max(2, triton.next_power_of_2(kv_heads)),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2), BLOCK_D=triton.next_power_of_2(head_dim),
        PAGE=page, PAGED=paged, num_warps=4,
    )
    return q_out
