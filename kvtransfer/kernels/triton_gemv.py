"""Triton GEMV for the batch-1 decode step: y = x @ W^T (+ bias), optionally gated (SiLU(gate) * up).

Why: at batch 1 a decode step is a chain of matrix-vector products that must stream each
weight once at full HBM speed. cuBLAS picks split-K kernels for the narrow projections
(q/k/v and o on Qwen2.5-7B) that run well below the HBM speed the wide MLP ones reach, plus a
separate reduce kernel. Here each
program owns BLOCK_N output columns over the whole K: no split, no reduce, and enough
programs (N / BLOCK_N) to keep every SM streaming. The gated form reads the gate row and
the up row of each output column in the same program and writes silu(g) * u, so the MLP's
activation costs no kernel and no round trip of the (B, 2I) intermediate.

Rounding mirrors the unfused path: the fp32 sum is rounded to the output dtype (as cuBLAS
does), then, gated, SiLU(g) is rounded before the multiply by the rounded u (silu_mul).
The fp32 summation order differs from cuBLAS's, so results agree within bf16 rounding,
not bit for bit (tests/test_kernels_gpu.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _configs():
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
            for bn, bk, w, st in ((4, 512, 4, 3), (8, 512, 4, 3), (8, 256, 4, 4), (16, 256, 4, 3), (16, 512, 8, 3),
                                  (32, 256, 8, 3), (2, 1024, 4, 3), (4, 1024, 8, 2))]


@triton.autotune(configs=_configs(), key=["N", "K", "GATED"])
@triton.jit
def _gemv_kernel(
    X, W, Bias, Y,
    N, K, stride_wn,
    HAS_BIAS: tl.constexpr, GATED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # grid (cdiv(N, BLOCK_N),). x (K,), W (N, K) [gated: (2N, K), gate rows then up rows] -> y (N,).
    # 2-D accumulators (BLOCK_N, BLOCK_K), reduced once after the loop: every load is a contiguous,
    # vectorized run along K and no layout changes inside the loop.
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    w_rows = W + rn.to(tl.int64)[:, None] * stride_wn
    u_rows = W + (rn.to(tl.int64) + N)[:, None] * stride_wn
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + rk
        k_ok = cols < K
        x = tl.load(X + cols, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_rows + cols[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
        if GATED:
            u = tl.load(u_rows + cols[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc_u += u.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)  # (BLOCK_N,) fp32
    out_ty = Y.dtype.element_ty
    if HAS_BIAS:
        y += tl.load(Bias + rn, mask=n_ok, other=0.0).to(tl.float32)
    if GATED:
        g = y.to(out_ty).to(tl.float32)
        up = tl.sum(acc_u, axis=1).to(out_ty).to(tl.float32)
        y = (g * tl.sigmoid(g)).to(out_ty).to(tl.float32) * up  # F.silu in the model dtype, as silu_mul
    tl.store(Y + rn, y.to(out_ty), mask=n_ok)


def gemv_triton(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, gated: bool = False) -> torch.Tensor:
    """x (1, K) contiguous; w (N, K) [gated: (2N, K)] contiguous -> (1, N) in x.dtype. Checked by the caller."""
    k = x.shape[1]
    n = w.shape[0] // 2 if gated else w.shape[0]
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    _gemv_kernel[grid](x, w, bias if bias is not None else w, y, n, k, w.stride(0),
                       HAS_BIAS=bias is not None, GATED=gated)
    return y
