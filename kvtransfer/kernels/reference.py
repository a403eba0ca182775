"""Plain-torch references of the fused decode-step ops.

Why: these are what the decode engine runs on CPU (tests, CI) and what the Triton kernels are
checked against on the GPU. Each mirrors Hugging Face's eager math for Llama/Qwen2/Mistral in
the same dtype and the same order of roundings, so a CPU decode step reproduces HF's eager
results; obvious correctness wins over speed here. They may sync with the host (the attention
reference reads lengths on the host) and are not meant for CUDA-graph capture.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """HF's rotate_half: (x1, x2) -> (-x2, x1) over the last dim split in halves."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """HF's repeat_kv on a (Hkv, L, D) tensor: (Hkv, L, D) -> (Hkv * groups, L, D).

    Query head j reads kv head j // groups.
    """
    if groups == 1:
        return x
    hkv, length, dim = x.shape
    return x[:, None].expand(hkv, groups, length, dim).reshape(hkv * groups, length, dim)


def row_positions(pool: torch.Tensor, row: int, length: int, table: torch.Tensor | None) -> torch.Tensor:
    """A row's first `length` positions of one layer's pool -> (Hkv, length, D): slot `row` of a (S, Hkv, T, D)
    pool, or (paged) the blocks of table row `row`, T positions each, in order. Host sync: reads the table."""
    if table is None:
        return pool[row, :, :length]
    page = pool.shape[2]
    blocks = table[row, :-(-length // page)].long()  # (nb,)
    hkv, dim = pool.shape[1], pool.shape[3]
    return pool[blocks].transpose(0, 1).reshape(hkv, -1, dim)[:, :length]  # (nb, Hkv, T, D) -> (Hkv, L, D)


def decode_attention_ref(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per row over its slot's first lengths[b] positions, HF eager math.

    q: (B, Hq, D); pools: (S, Hkv, T, D); slots, lengths: (B,) -> out (B, Hq, D) in q.dtype.
    Per row: softmax((q @ k^T) * scale, fp32).to(q.dtype) @ v with K/V repeated per group.
    Host sync: reads slots/lengths on the host (CPU reference).
    """
    batch, hq, _ = q.shape
    groups = hq // k_pool.shape[1]
    out = torch.empty_like(q)
    for b, (slot, length) in enumerate(zip(slots.tolist(), lengths.tolist())):
        k = repeat_kv(row_positions(k_pool, slot, length, block_table), groups)  # (Hq, L, D)
        v = repeat_kv(row_positions(v_pool, slot, length, block_table), groups)  # (Hq, L, D)
        qb = q[b][:, None, :]  # (Hq, 1, D)
        scores = torch.matmul(qb, k.transpose(1, 2)) * scale  # (Hq, 1, L)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out[b] = torch.matmul(probs, v)[:, 0, :]  # (Hq, D)
    return out


def decode_attention_split_ref(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    split_size: int,
    block_table: torch.Tensor | None = None,
    block_n: int = 64,
    merge_tile: int = 16,  # triton_attention_split.MERGE_TILE
) -> torch.Tensor:
    """What the fixed-split decode attention computes (kernels/triton_attention_split.py), step by step in its order:
    each split of `split_size` positions from 0 an online softmax over `block_n`-position tiles in log2 units (P
    rounded to the KV dtype before @ V), its partial (acc / l, m + log2 l) in fp32; the partials merged in index
    order, `merge_tile` at a time. Shapes as `decode_attention_ref`. Only the sums inside a dot and a tile's
    reduction trees are torch's, so it matches the kernel within rounding, not bit for bit. Host sync."""
    log2e = 1.4426950408889634
    groups = q.shape[1] // k_pool.shape[1]
    out = torch.empty_like(q)
    for b, (slot, length) in enumerate(zip(slots.tolist(), lengths.tolist())):
        length = max(0, min(length, k_pool.shape[2] * (1 if block_table is None else block_table.shape[1])))
        k = repeat_kv(row_positions(k_pool, slot, length, block_table), groups)  # (Hq, L, D)
        v = repeat_kv(row_positions(v_pool, slot, length, block_table), groups)
        qb = q[b].float()[:, None, :]  # (Hq, 1, D)
        parts, lses = [], []
        for start in range(0, length, split_size):
            m = torch.full((q.shape[1], 1), float("-inf"), device=q.device)
            l_i = torch.zeros(q.shape[1], 1, device=q.device)
            acc = torch.zeros(q.shape[1], 1, q.shape[2], device=q.device)
            for n0 in range(start, min(start + split_size, length), block_n):
                n1 = min(n0 + block_n, start + split_size, length)
                s = torch.matmul(qb, k[:, n0:n1].float().transpose(1, 2))[:, 0] * (scale * log2e)  # (Hq, n)
                m_new = torch.maximum(m, s.max(-1, keepdim=True).values)
                alpha = torch.exp2(m - m_new)
                p = torch.exp2(s - m_new)
                pv = torch.matmul(p.to(v.dtype).float()[:, None, :], v[:, n0:n1].float())  # (Hq, 1, D)
                acc = acc * alpha[:, :, None] + pv
                l_i = l_i * alpha + p.sum(-1, keepdim=True)
                m = m_new
            parts.append(acc[:, 0] / l_i)  # (Hq, D)
            lses.append((m + torch.log2(l_i))[:, 0])  # (Hq,)
        m = torch.full((q.shape[1],), float("-inf"), device=q.device)
        acc = torch.zeros(q.shape[1], q.shape[2], device=q.device)
        denom = torch.zeros(q.shape[1], device=q.device)
        for t in range(0, len(parts), merge_tile):
            lse = torch.stack(lses[t:t + merge_tile], 1)  # (Hq, n)
            m_new = torch.maximum(m, lse.max(1).values)
            alpha = torch.exp2(m - m_new)
            w = torch.exp2(lse - m_new[:, None])
            acc = acc * alpha[:, None] + (w[:, :, None] * torch.stack(parts[t:t + merge_tile], 1)).sum(1)
            denom = denom * alpha + w.sum(1)
            m = m_new
        out[b] = (acc / denom.clamp_min(1e-30)[:, None]).to(q.dtype)
    return out


def chunk_attention_ref(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    pieces: torch.Tensor,
    scale: float,
    block_table: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of prompt-chunk rows over their slot (paged: table row), HF eager math.

    q: (R, Hq, D); pools: (S, Hkv, T, D); pieces: (P, 4) int32, one row per chunk: first row in q, rows, slot
    (negative: rows to zero), position of the first row -> out (R, Hq, D) in q.dtype: a new tensor zero outside
    the pieces, or `out` written on the pieces' rows only. Row r of a chunk at position start + r attends over
    positions 0..start + r of its slot: what `decode_attention_ref` gives that row alone with length start + r + 1.
    Host sync: reads pieces on the host (CPU reference).
    """
    groups = q.shape[1] // k_pool.shape[1]
    out = torch.zeros_like(q) if out is None else out
    for row0, rows, slot, start in pieces.tolist():
        if rows <= 0:
            continue
        if slot < 0:  # a step's padding rows
            out[row0:row0 + rows] = 0
            continue
        end = start + rows
        k = repeat_kv(row_positions(k_pool, slot, end, block_table), groups)  # (Hq, end, D)
        v = repeat_kv(row_positions(v_pool, slot, end, block_table), groups)
        qc = q[row0:row0 + rows].transpose(0, 1)  # (Hq, rows, D)
        scores = torch.matmul(qc, k.transpose(1, 2)) * scale  # (Hq, rows, end)
        future = torch.arange(end, device=q.device)[None, :] > torch.arange(start, end, device=q.device)[:, None]
        scores = scores.masked_fill(future, float("-inf"))  # (rows, end): key after the row's position
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out[row0:row0 + rows] = torch.matmul(probs, v).transpose(0, 1)  # (rows, Hq, D)
    return out


def apply_rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's apply_rotary_pos_emb for one tensor: x (B, H, D), cos/sin (B, D) -> (B, H, D).

    cos/sin are cast to x.dtype first, as HF's rotary embedding returns them in x's dtype.
    """
    cos = cos.to(x.dtype)[:, None, :]  # (B, 1, D)
    sin = sin.to(x.dtype)[:, None, :]
    return (x * cos) + (rotate_half(x) * sin)


def rope_store_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """RoPE on q and k, then k (rotated) and v (plain) into the pools at (slots[b], :, positions[b]) (paged: at
    (block_table[slots[b], positions[b] // T], :, positions[b] % T)).

    q: (B, Hq, D), k/v: (B, Hkv, D), cos/sin: (B, D); returns a new rotated q (B, Hq, D).
    The pools are written in place; nothing else in them is touched.
    """
    q_rot = apply_rope_ref(q, cos, sin)
    k_rot = apply_rope_ref(k, cos, sin)
    slot_idx = slots.long()
    pos_idx = positions.long()
    if block_table is not None:
        page = k_pool.shape[2]
        slot_idx, pos_idx = block_table.long()[slot_idx, pos_idx // page], pos_idx % page
    # Advanced indices on dims 0 and 2 around a slice: the result dims are (B, Hkv, D).
    k_pool[slot_idx, :, pos_idx] = k_rot.to(k_pool.dtype)
    v_pool[slot_idx, :, pos_idx] = v.to(v_pool.dtype)
    return q_rot


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: x (B, H), weight (H,) -> weight * normalize(x.float()).to(x.dtype)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual_out = residual + x (input dtype, as HF adds); normed = rms_norm(residual_out)."""
    residual_out = residual + x
    return rms_norm_ref(residual_out, weight, eps), residual_out


def invariant_linear_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What the batch-invariant GEMM computes: x (M, K) @ w (N, K)^T (+ bias) summed in fp32, rounded once to x's
    dtype -> (M, N). Row by row (one (1, K) @ (K, N) call each): torch's CPU GEMM takes another kernel, and another
    sum order, for one row than for several (a row's bits moved with M), so each row gets the one-row call whatever
    M is, and is the same bits alone or in any batch (the engine's --batch-invariant on CPU). The Triton kernel
    sums in its own fixed order: this gives its values, not its bits (docs/batch-invariance.md)."""
    wf, bf = w.float(), None if bias is None else bias.float()
    out = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)  # (M, N)
    for i in range(x.shape[0]):
        out[i] = F.linear(x[i:i + 1].float(), wf, bf)[0].to(x.dtype)
    return out


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """(B, 2I) fused gate|up projection -> silu(gate) * up, (B, I), in the input dtype.

    The gate half is made contiguous first: torch's CPU silu takes a different (vectorized vs
    strided) path for a strided view and differs in the last bit, and HF applies it to the
    contiguous output of gate_proj.
    """
    inter = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :inter].contiguous()) * gate_up[..., inter:]
