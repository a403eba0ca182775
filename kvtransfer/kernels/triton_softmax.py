"""The flash-attention tile step that every attention kernel here shares: the dot, and one K/V tile of the online
softmax.

Why its own file: the decode kernel (triton_attention.py), the chunk kernel (triton_chunk_attention.py) and the fused
mixed launch (triton_mixed_attention.py, through the other two's programs) must round the same way, so a prompt row
read by either kernel gives the same bits as a decode row of its length would; one definition keeps them so. The
kernels tile different axes (one row's query heads over a split; 64 rows of one head), never the step itself.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot(a, b, UPCAST_DOT: tl.constexpr):
    """a @ b in fp32: IEEE dots on fp32 copies when UPCAST_DOT (triton_attention._upcast_dots: fp32 pools, and CPU
    tensors under the interpreter), else tensor cores."""
    if UPCAST_DOT:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def online_softmax_step(acc, l_i, m_i, s, v, UPCAST_DOT: tl.constexpr):
    """One K/V tile of flash attention's online softmax, shared by the decode and the chunk kernel.

    acc (M, D), l_i (M,), m_i (M,) fp32: the running output, sum and max; s (M, N) scores in log2 units, masked
    to -inf (each row with >= 1 finite score, so the new max is finite); v (N, D). P is rounded to the KV
    dtype before @ V, as flash attention does and as HF rounds the softmax. Returns the updated (acc, l_i, m_i).
    """
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])  # (M, N)
    pv = dot(p.to(v.dtype), v, UPCAST_DOT)  # (M, D)
    acc = acc * alpha[:, None] + pv
    l_i = l_i * alpha + tl.sum(p, 1)
    return acc, l_i, m_new
