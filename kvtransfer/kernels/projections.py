"""The projections of a step: x @ W^T by cuBLAS, the Triton GEMV at batch 1, or the batch-invariant Triton GEMM.

Why apart from ops.py (the ops over the KV pool): a projection's backend is chosen by its row count and the
engine's mode, not by the pool's layout. At batch <= GEMV_MAX_ROWS a Triton GEMV reads the weights once at the
memory rate (the engine times it against cuBLAS at start, `--gemv`); above it cuBLAS's GEMM; and in
`--batch-invariant` every projection runs the fixed-tile GEMM (triton_matmul.py), whose row results do not depend on
how many rows come with them (docs/batch-invariance.md). The MLP's gate_up runs as one gated GEMV, or the GEMM then
silu_mul (the same roundings). Shapes: x (B, K), w (N, K) -> (B, N). ops.py re-exports every name here.
"""

from __future__ import annotations

import torch

from kvtransfer.kernels._checks import check_float, last_dim_unit, require
from kvtransfer.kernels.backend import pick_triton as _use_triton
from kvtransfer.kernels.reference import invariant_linear_ref, silu_mul_ref


def silu_mul(gate_up: torch.Tensor, *, use_triton: bool | None = None) -> torch.Tensor:
    """gate_up (B, 2I), gate first then up -> silu(gate) * up, (B, I) in the input dtype."""
    check_float("gate_up", gate_up, 2)
    require(gate_up.shape[1] % 2 == 0, f"gate_up last dim must be even, got {gate_up.shape[1]}")
    if not _use_triton(use_triton, gate_up.device):
        return silu_mul_ref(gate_up)
    from kvtransfer.kernels.triton_norm import silu_mul_triton

    return silu_mul_triton(last_dim_unit(gate_up))


GEMV_MAX_ROWS = 1  # Triton GEMV for batch 1 only; cuBLAS above (bench/results/probe-h200-2026-12-01)


def _check_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out_rows: int) -> None:
    check_float("x", x, 2)
    check_float("w", w, 2)
    require(w.shape[1] == x.shape[1], f"w has {w.shape[1]} columns, x rows {x.shape[1]}")
    require(w.dtype == x.dtype and w.device == x.device, f"w is {w.dtype} on {w.device}, x {x.dtype} on {x.device}")
    if bias is not None:
        check_float("bias", bias, 1)
        require(bias.shape[0] == out_rows and bias.dtype == x.dtype, f"bias must be ({out_rows},) of {x.dtype}")


def _gemv_ok(x: torch.Tensor, w: torch.Tensor, use_triton: bool | None, max_rows: int | None) -> bool:
    rows = GEMV_MAX_ROWS if max_rows is None else min(max_rows, GEMV_MAX_ROWS)
    if x.shape[0] > rows or not w.is_contiguous():
        return False
    return _use_triton(use_triton, x.device)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
           use_triton: bool | None = None, max_rows: int | None = None) -> torch.Tensor:
    """F.linear: x (B, K), w (N, K) -> (B, N). Triton GEMV when B <= max_rows (<= GEMV_MAX_ROWS), else torch."""
    _check_linear(x, w, bias, w.shape[0])
    if not _gemv_ok(x, w, use_triton, max_rows):
        return torch.nn.functional.linear(x, w, bias)
    from kvtransfer.kernels.triton_gemv import gemv_triton

    return gemv_triton(x.contiguous(), w, bias)


def gate_up_silu(x: torch.Tensor, gate_up: torch.Tensor, *, use_triton: bool | None = None,
                 max_rows: int | None = None) -> torch.Tensor:
    """silu(x @ gate^T) * (x @ up^T): x (B, H), gate_up (2I, H), gate rows first -> (B, I).

    One gated GEMV when B <= max_rows on Triton; else the GEMM, then silu_mul (same roundings).
    """
    _check_linear(x, gate_up, None, gate_up.shape[0])
    require(gate_up.shape[0] % 2 == 0, f"gate_up must have an even row count, got {gate_up.shape[0]}")
    if not _gemv_ok(x, gate_up, use_triton, max_rows):
        return silu_mul(torch.nn.functional.linear(x, gate_up), use_triton=use_triton)
    from kvtransfer.kernels.triton_gemv import gemv_triton

    return gemv_triton(x.contiguous(), gate_up, gated=True)


def invariant_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
                     use_triton: bool | None = None) -> torch.Tensor:
    """x (M, K) @ w (N, K)^T (+ bias) -> (M, N) in x.dtype, each row's bits independent of M and of the other rows
    (Triton: one tile config, no split-K; docs/batch-invariance.md). The reference sums in fp32 and rounds once,
    as the kernel does, in torch's order. The projections and lm_head of StepRunner(invariant=True)."""
    _check_linear(x, w, bias, w.shape[0])
    if not _use_triton(use_triton, x.device):
        return invariant_linear_ref(x, w, bias)
    from kvtransfer.kernels.triton_matmul import matmul_triton

    return matmul_triton(last_dim_unit(x), last_dim_unit(w), None if bias is None else bias.contiguous())
