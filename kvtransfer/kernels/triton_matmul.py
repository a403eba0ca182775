"""Triton GEMM whose result for a row does not depend on how many rows come with it: y = x @ W^T (+ bias).

Why: cuBLAS picks its kernel by shape, and at small row counts a split-K kernel whose reduction
order differs from the one it picks at large ones, so a request's logits change with the batch
it shares (docs/batch-invariance.md). Here every output element is one program's fp32 sum over
the whole of K, in BLOCK_K steps from k = 0 upwards, each step one tile dot of the same shape:
no split-K, one tile config per input dtype whatever M (no autotune, no choice by rows), and M
is not specialized on (`do_not_specialize`), so every M runs the same compiled kernel. A row's
tile position changes with M (row 0 alone, row 37 of a batch), and the dot of a tile computes
each of its rows by the same sequence of fp32 operations, so the row's bits stay the same.

Rounding: the fp32 sum (plus the bias in fp32) is rounded once to x's dtype, as cuBLAS's
epilogue does; the sum's order differs from cuBLAS's, so the two agree within that rounding, not
bit for bit. fp32 inputs use IEEE dots (no TF32, as `--deterministic` sets for torch). Under the
Triton interpreter (CPU tensors) a tile's dot is a product-and-sum in fp32 in k order, not
tl.dot (`_dot_kind`), so the interpreter checks the kernel's tiling and K loop; that a tensor-core
dot computes each row of a tile alike is a hardware property, checked on a GPU
(tests/test_invariant_gpu.py). Not wired into the engine yet: ops.invariant_linear exposes it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) by input element size; fixed whatever M. 2-byte inputs:
# 128 x 128 output tiles, 64-deep steps, 3 stages (96 KiB of shared memory on sm_90); fp32 halves the step.
CONFIGS = {2: (128, 128, 64, 8, 3), 4: (128, 128, 32, 8, 3)}
GROUP_M = 8  # program order only (L2 reuse of W across row tiles): it never changes a sum


def _dot_kind(x: torch.Tensor) -> int:
    """0: tl.dot on tensor cores (bf16, fp16 on a GPU); 1: IEEE fp32 dots (fp32 on a GPU); 2: CPU tensors, which run
    only under the Triton interpreter: there tl.dot is numpy's matmul, whose BLAS sums a row in an order that
    depends on the row's place in the tile (an fp32 row came out different at row 31 than at row 0), and is wrong
    for bf16; the kernel sums the products itself instead."""
    if x.device.type != "cuda":
        return 2
    return 1 if x.dtype == torch.float32 else 0


def tile_config(dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """The one config for x's dtype: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)."""
    return CONFIGS[torch.empty((), dtype=dtype).element_size()]


@triton.jit(do_not_specialize=["M"])  # one compile for every row count: M = 1 must not get another kernel
def _matmul_kernel(
    X, W, Bias, Y,
    M, N, K,
    stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, DOT: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # grid (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N),); x (M, K), W (N, K), both unit stride on K -> y (M, N).
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    x_rows = X + rm.to(tl.int64)[:, None] * stride_xm
    w_rows = W + rn.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # the one order: k = 0 upwards, the same steps for every M
        cols = k0 + rk
        k_ok = cols < K
        a = tl.load(x_rows + cols[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_K)
        b = tl.load(w_rows + cols[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # (BLOCK_K, BLOCK_N)
        if DOT == 2:  # the interpreter: products summed over k in order, the same for every row of the tile
            acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
        elif DOT == 1:  # fp32 on a GPU: IEEE, no TF32
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    if HAS_BIAS:
        acc += tl.load(Bias + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y = Y + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    tl.store(y, acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def matmul_triton(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K), w (N, K), both with unit stride on K, bias (N,) or None -> (M, N) in x.dtype; checked by the
    caller (ops.invariant_linear)."""
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    block_m, block_n, block_k, warps, stages = tile_config(x.dtype)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _matmul_kernel[grid](
        x, w, bias if bias is not None else w, y,
        m, n, k,
        x.stride(0), w.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, DOT=_dot_kind(x), GROUP_M=GROUP_M,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages,
    )
    return y
