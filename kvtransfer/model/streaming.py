"""Streaming cache: see each layer's K/V the moment attention writes them; assemble on arrival.

Why here: `DynamicCache.update` is the one place that sees the post-RoPE K/V that are
cached (forward hooks see pre-RoPE keys). The prefill side hands what `update` *returns*
(contiguous, physical layout) to a callback; the callback is switched off after prefill
so decode steps never send unmatched tensors. The receive side fills the layer tensors
of a fresh `DynamicCache` in place, without the concatenation copy `update` would make.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

# (layer_idx, keys, values), keys/values: (batch, kv_heads, seq, head_dim)
LayerCallback = Callable[[int, torch.Tensor, torch.Tensor], None]


class StreamingCache(DynamicCache):
    """A DynamicCache that calls `on_layer(i, k, v)` right after layer i's prefill update.

    On the first update of each layer, K and V are written into one block allocated for
    all layers, (layers, 2, batch, kv_heads, seq, head_dim), instead of `torch.cat` with an
    empty tensor: the same one copy, but layer i's K and V are then adjacent in memory (one
    message per layer) and consecutive layers are adjacent too (one message per group).
    """

    def __init__(self, *args, on_layer: LayerCallback | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.on_layer = on_layer
        self.block: torch.Tensor | None = None  # (layers, 2, batch, kv_heads, seq, head_dim)
        self.fused = False  # the next pieces run on the fused ops, into `block` (fused_prefill.chunk_cache)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        if type(layer) is DynamicLayer and not layer.is_initialized:
            if self.block is None or self.block.shape[2:] != key_states.shape:
                self.block = torch.empty((len(self.layers), 2, *key_states.shape),
                                         dtype=key_states.dtype, device=key_states.device)
            kv = self.block[layer_idx]  # (2, batch, kv_heads, seq, head_dim)
            kv[0].copy_(key_states)
            kv[1].copy_(value_states)
            layer.lazy_initialization(key_states, value_states)
            layer.keys, layer.values = kv[0], kv[1]
            keys, values = kv[0], kv[1]
        else:
            keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if self.on_layer is not None:
            self.on_layer(layer_idx, keys, values)
        return keys, values


def cache_kwarg(model) -> str:
    """Name of the forward() argument that takes the cache: `cache` (5.2x+) or `past_key_values`."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def assemble_cache(config, layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """A DynamicCache whose layer i holds exactly `layers[i]` (no copy, no concatenation)."""
    cache = DynamicCache(config=config)
    if len(cache.layers) != len(layers):
        raise ValueError(f"model has {len(cache.layers)} cache layers, got {len(layers)}")
    for layer, (k, v) in zip(cache.layers, layers):
        if type(layer) is not DynamicLayer:
            raise NotImplementedError(f"cache layer type {type(layer).__name__} is not supported "
                                      "(sliding-window and linear-attention layers cannot be assembled yet)")
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k, v
    return cache


def cache_layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def same_bytes(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Shape, dtype and every byte equal (NaN == NaN, -0.0 != +0.0), across devices."""
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    y = y.to(x.device)
    return torch.equal(x.contiguous().reshape(-1).view(torch.uint8), y.contiguous().reshape(-1).view(torch.uint8))


def caches_equal(a: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 b: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Byte-for-byte equality of two caches given as per-layer (K, V)."""
    return len(a) == len(b) and all(
        same_bytes(ka, kb) and same_bytes(va, vb) for (ka, va), (kb, vb) in zip(a, b))


def cache_digest(layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> str:
    """Digest of every byte, shape and dtype of a cache (debug: compare caches across processes)."""
    import hashlib
    h = hashlib.sha256()
    for k, v in layers:
        for t in (k, v):
            h.update(f"{tuple(t.shape)}{t.dtype};".encode())
            h.update(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:32]
