"""Torch-only views of a KV layer's memory: the K/V-adjacent pair, contiguous runs, byte views.

Why a module of its own: every transport (and the bench's host tiers) look at the
same physical layout, (layers, 2, batch, kv_heads, seq, head_dim) with layer i's K and V
adjacent, and none of them should pay for importing transformers to do so.
"""

from __future__ import annotations

import numpy as np
import torch


def kv_pair_view(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """(2, *k.shape) view over K and V when V directly follows K in one storage, else None."""
    if (k.is_contiguous() and v.is_contiguous() and k.dtype == v.dtype and k.shape == v.shape
            and k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
            and v.data_ptr() == k.data_ptr() + k.nbytes):
        return torch.empty(0, dtype=k.dtype, device=k.device).set_(
            k.untyped_storage(), k.storage_offset(), (2, *k.shape))
    return None


def contiguous_run(kvs: list[torch.Tensor]) -> torch.Tensor | None:
    """One (n, 2, b, h, s, d) view over n consecutive (2, b, h, s, d) tensors that follow each other in
    one storage, else None."""
    first = kvs[0]
    if all(t.is_contiguous() and t.shape == first.shape and t.dtype == first.dtype
           and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
           and t.data_ptr() == first.data_ptr() + i * first.nbytes for i, t in enumerate(kvs)):
        return torch.empty(0, dtype=first.dtype, device=first.device).set_(
            first.untyped_storage(), first.storage_offset(), (len(kvs), *first.shape))
    return None


def run_or_stack(kvs: list[torch.Tensor]) -> torch.Tensor:
    """`contiguous_run`, or a stacked copy when the tensors are not adjacent."""
    run = contiguous_run(kvs)
    return run if run is not None else torch.stack(kvs)


def kv_block(num_layers: int, layer_shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A fresh (layers, 2, batch, kv_heads, seq, head_dim) block: layer i's K, V are block[i, 0], block[i, 1]."""
    return torch.empty((num_layers, 2, *layer_shape), dtype=dtype, device=device)


def byte_array(t: torch.Tensor) -> np.ndarray:
    """Zero-copy flat uint8 array over a CPU tensor (any dtype, bfloat16 included); copies only if strided."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8).numpy()


def byte_view(t: torch.Tensor) -> memoryview:
    return memoryview(byte_array(t))
