"""The row-wise norms of a step: HF's RMSNorm, alone or after the residual add, by Triton or the torch reference.

Why apart from ops.py (the ops over the KV pool): a norm reads one row of the hidden state and nothing else, so its
backend is the one choice `use_triton` makes (None: Triton on CUDA tensors with triton importable, backend.py), and it
has no pool, slots or lengths to check. Shapes: x, residual (B, H); weight (H,) -> (B, H). ops.py re-exports every
name here, as it does projections.py's.
"""

from __future__ import annotations

import torch

from kvtransfer.kernels._checks import check_float, last_dim_unit, require
from kvtransfer.kernels.backend import pick_triton as _use_triton
from kvtransfer.kernels.reference import add_rms_norm_ref, rms_norm_ref


def _check_norm(x: torch.Tensor, weight: torch.Tensor) -> None:
    check_float("x", x, 2)
    check_float("weight", weight, 1)
    require(weight.shape[0] == x.shape[1], f"weight has {weight.shape[0]} elements, x rows {x.shape[1]}")
    require(weight.device == x.device, f"weight is on {weight.device}, x on {x.device}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, use_triton: bool | None = None) -> torch.Tensor:
    """HF LlamaRMSNorm: x (B, H), weight (H,) -> (B, H) in promote(weight.dtype, x.dtype)."""
    _check_norm(x, weight)
    if not _use_triton(use_triton, x.device):
        return rms_norm_ref(x, weight, eps)
    from kvtransfer.kernels.triton_norm import rms_norm_triton

    return rms_norm_triton(last_dim_unit(x), last_dim_unit(weight), eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *, use_triton: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual_out = residual + x (x's dtype); returns (rms_norm(residual_out), residual_out).

    x, residual: (B, H) of one dtype; both outputs are new tensors (inputs untouched).
    """
    _check_norm(x, weight)
    check_float("residual", residual, 2)
    require(residual.shape == x.shape and residual.dtype == x.dtype, "residual must match x in shape and dtype")
    require(residual.device == x.device, f"residual is on {residual.device}, x on {x.device}")
    if not _use_triton(use_triton, x.device):
        return add_rms_norm_ref(x, residual, weight, eps)
    from kvtransfer.kernels.triton_norm import rms_norm_triton

    return rms_norm_triton(last_dim_unit(x), last_dim_unit(weight), eps, residual=last_dim_unit(residual))
