"""Cheap shape/dtype checks for the kernels' Python API.

Why: a wrong shape reaching a Triton kernel reads or writes the wrong memory silently; these
checks look only at metadata (no host sync), so they are safe inside CUDA-graph capture.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def check_float(name: str, t: torch.Tensor, ndim: int) -> None:
    require(isinstance(t, torch.Tensor), f"{name} must be a tensor")
    require(t.dim() == ndim, f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    require(t.dtype in FLOAT_DTYPES, f"{name} must be fp16/bf16/fp32, got {t.dtype}")


def check_index(name: str, t: torch.Tensor, batch: int, device: torch.device) -> None:
    require(isinstance(t, torch.Tensor), f"{name} must be a tensor")
    require(t.dtype in INDEX_DTYPES, f"{name} must be int32/int64, got {t.dtype}")
    require(tuple(t.shape) == (batch,), f"{name} must have shape ({batch},), got {tuple(t.shape)}")
    require(t.device == device, f"{name} is on {t.device}, expected {device}")


def check_table(table: torch.Tensor | None, device: torch.device) -> None:
    """A block table: None (the slot layout) or (rows, width) int32 on the device, unit stride on its width."""
    if table is None:
        return
    require(isinstance(table, torch.Tensor), "block_table must be a tensor")
    require(table.dtype == torch.int32 and table.dim() == 2, f"block_table must be a 2-D int32 tensor, got "
            f"{table.dtype} {tuple(table.shape)}")
    require(table.shape[1] >= 1 and table.stride(1) == 1, "block_table needs >= 1 column and unit stride on it")
    require(table.device == device, f"block_table is on {table.device}, expected {device}")


def check_pools(k_pool: torch.Tensor, v_pool: torch.Tensor, head_dim: int, dtype: torch.dtype) -> None:
    check_float("k_pool", k_pool, 4)
    require(v_pool.shape == k_pool.shape, f"v_pool shape {tuple(v_pool.shape)} != k_pool {tuple(k_pool.shape)}")
    require(k_pool.dtype == v_pool.dtype == dtype, f"pool dtypes {k_pool.dtype}/{v_pool.dtype} must equal {dtype}")
    require(k_pool.is_contiguous() and v_pool.is_contiguous(), "k_pool and v_pool must be contiguous")
    require(k_pool.device == v_pool.device, "k_pool and v_pool must be on one device")
    require(k_pool.shape[3] == head_dim, f"pool head_dim {k_pool.shape[3]} != {head_dim}")


def check_groups(q_heads: int, kv_heads: int) -> None:
    require(kv_heads > 0 and q_heads % kv_heads == 0, f"q heads {q_heads} not a multiple of kv heads {kv_heads}")


def check_out(out: torch.Tensor | None, like: torch.Tensor) -> None:
    """An output written in place: None, or `like`'s shape, dtype and device with unit stride on its last dim."""
    if out is None:
        return
    require(isinstance(out, torch.Tensor), "out must be a tensor")
    require(out.shape == like.shape and out.dtype == like.dtype and out.device == like.device,
            f"out must be {tuple(like.shape)} {like.dtype} on {like.device}, got {tuple(out.shape)} {out.dtype} "
            f"on {out.device}")
    require(out.stride(-1) == 1, "out needs unit stride on its last dim")


def last_dim_unit(t: torch.Tensor) -> torch.Tensor:
    """The tensor itself if its last dim has unit stride (and dims > 0), else a contiguous copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def check_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> tuple[int, int, int]:
    """An attention op's q (rows, Hq, D) and pools (S, Hkv, T, D) in q's dtype, on q's device, Hq a multiple of
    Hkv -> q's shape."""
    check_float("q", q, 3)
    rows, q_heads, head_dim = q.shape
    check_pools(k_pool, v_pool, head_dim, q.dtype)
    check_groups(q_heads, k_pool.shape[1])
    require(q.device == k_pool.device, f"q is on {q.device}, pools on {k_pool.device}")
    return rows, q_heads, head_dim


def check_pieces(pieces: torch.Tensor, device: torch.device) -> None:
    """A mixed step's prompt pieces: (P, 4) int32 on the device (first row, rows, slot, start)."""
    require(isinstance(pieces, torch.Tensor) and pieces.dtype == torch.int32 and pieces.dim() == 2
            and pieces.shape[1] == 4, "pieces must be a (P, 4) int32 tensor: first row, rows, slot, start")
    require(pieces.device == device, f"pieces is on {pieces.device}, expected {device}")
