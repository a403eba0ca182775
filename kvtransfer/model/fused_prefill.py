"""Prefill with the decode engine's fused ops: a quarter of the kernels per layer that HF's forward launches.

Why: a served prefill runs on a thread that shares the GIL with the gRPC event loop, and HF's
eager forward is launch-heavy, so its wall time is set by the host, and more so next to a busy
thread. This path launches fused q/k/v and gate/up GEMMs, fused RoPE + cache write and fused
add + RMSNorm (the measurement: bench/results/probe-h200-2026-12-01). Both servers call it through
`kvtransfer.model.prefill.prefill`, so a colocated and a disaggregated request still see byte-identical caches
and logits.

A chunked prefill's pieces run it too (`chunk_cache`, `fused_chunk`): one block for the whole prompt, each
piece's K/V written into it at its positions and attended over as a view, where the HF forward's cache copies
everything so far into a new tensor per layer for every chunk.

What it equals: on CPU (reference ops, which mirror HF's eager math) it is bit-identical to the HF
forward, cache and logits, whole or chunk by chunk (tests/test_fused_prefill.py). On CUDA the Triton norm/RoPE
kernels and SDPA's GQA path round differently from HF's ops: equal within bf16 tolerance, not bit for bit.
Only Llama/Qwen2/Mistral-style decoders take it (anything else runs the HF forward, whole or chunked).

Below CUDNN_MIN_TOKENS, attention never runs on SDPA's cuDNN backend (which SDPA prefers on an
H200): cuDNN builds a graph for every new sequence length, and served prompts rarely repeat one, so
a short prompt at a new length paid several times its prefill for the build
(bench/results/serve-h200-2026-12-01-mixed-graphs). Warm, cuDNN is faster, and more so the longer the
prompt (the ttft runs ...-fused-prefill and ...-flash-prefill): long prompts, whose attention saving
outweighs one build, keep SDPA's own choice. The
threshold is where a two-point model (attention ~ n^2, the 32k saving) breaks even with one build,
not a measured crossover. Both servers run this function, so the choice (a function of n) never
splits colocated from disaggregated.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right
from transformers.cache_utils import DynamicLayer

from kvtransfer.geometry import CacheGeometry
from kvtransfer.kernels import ops as kernels
from kvtransfer.model.decoder_stack import run_layers
from kvtransfer.model.fused import UnsupportedModel, check_supported, fused_layers
from kvtransfer.model.streaming import LayerCallback, StreamingCache

# Below CUDNN_MIN_TOKENS SDPA may pick among these, in this order (None: SDPA's own choice, cuDNN included;
# bench.probes.probe_round compares); from it on, SDPA's own choice.
SDPA_BACKENDS: list | None = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
CUDNN_MIN_TOKENS = 16384


def sdpa_backends(kv_len: int) -> list | None:
    """The SDPA backends attention over `kv_len` keys may use (None: any)."""
    return SDPA_BACKENDS if kv_len < CUDNN_MIN_TOKENS else None


def prompt_attention(kv_len: int):
    """Context for a prompt's SDPA: no cuDNN backend (no per-length graph build) when `kv_len` is short."""
    backends = sdpa_backends(kv_len)
    return sdpa_kernel(backends) if backends else nullcontext()


def supports(model, seq_len: int) -> bool:
    """True when `fused_prefill` can run this model over a prompt of `seq_len` tokens."""
    try:
        check_supported(model.config, seq_len)
    except UnsupportedModel:
        return False
    inner = getattr(model, "model", None)
    return inner is not None and hasattr(inner, "rotary_emb") and hasattr(inner.layers[0], "self_attn")


def _can_run(model, cache: StreamingCache, seq_len: int) -> bool:
    """The fused ops run this model over `seq_len` positions, and its cache layers are plain DynamicLayers."""
    return supports(model, seq_len) and all(type(layer) is DynamicLayer for layer in cache.layers)


@torch.inference_mode()
def fused_prefill(model, input_ids: torch.Tensor, on_layer: LayerCallback | None = None
                  ) -> tuple[StreamingCache, torch.Tensor] | None:
    """input_ids (1, n) -> (cache of the prompt, last position's logits (vocab,)), or None when the fused ops cannot
    run the model (`_can_run`: the caller then runs HF). on_layer(i, k, v) sees layer i's finished K/V,
    each (1, kv_heads, n, head_dim), before layer i's attention runs, as StreamingCache's hook does."""
    cache = StreamingCache(config=model.config)
    if not _can_run(model, cache, input_ids.shape[1]):
        return None
    cache.block = _block(model, input_ids.shape[1], input_ids.device)
    return cache, _forward(model, input_ids[0], cache, 0, -1, on_layer)


def chunk_cache(model, positions: int, past: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                device: torch.device | None = None) -> StreamingCache | None:
    """A cache for a prompt prefilled piece by piece on the fused ops (`fused_chunk`): one block of `positions`
    for every layer, holding `past` (per layer (k, v), each (1, kv_heads, p, head_dim): a reused prefix) at 0..p-1.
    None where the fused ops cannot run the model (the caller then runs the HF forward, which concatenates).

    Why: on the HF forward every later chunk of a long prompt launches ~4x the fused path's kernels (the chunk
    path was launch-bound) and copies the whole cache so far into a new tensor per layer (`torch.cat` in
    DynamicLayer.update). Here each chunk writes its K/V into the block at its positions, and attends over a view.
    `positions` must hold the prompt and the pads of its last chunk (engine.pad_chunk): n + chunk - 1."""
    cache = StreamingCache(config=model.config)
    if not _can_run(model, cache, positions):
        return None
    device = device if device is not None else model.lm_head.weight.device
    cache.block = _block(model, positions, device)
    cache.fused = True
    p = 0 if not past else past[0][0].shape[-2]
    for i, (k, v) in enumerate(past or []):
        cache.block[i, 0, :, :, :p].copy_(k)
        cache.block[i, 1, :, :, :p].copy_(v)
    _publish(cache, p)
    return cache


@torch.inference_mode()
def fused_chunk(model, input_ids: torch.Tensor, cache: StreamingCache, on_layer: LayerCallback | None = None,
                row: int = -1) -> torch.Tensor:
    """The next piece of a prompt, input_ids (1, m), after the cache's positions (chunk_cache's cache) ->
    its last real row's logits (vocab,): row `row`'s when the piece is padded after its last real token (each pad
    then at that token's RoPE position, its K/V after the prompt in the block, and the cache's length ends at the
    real token). on_layer(i, k, v) sees layer i's K/V so far, pads included, each (1, kv_heads, p + m, head_dim)."""
    start = cache.get_seq_length()
    logits = _forward(model, input_ids[0], cache, start, row, on_layer)
    _publish(cache, start + (row + 1 if row != -1 else input_ids.shape[1]))
    return logits


def _block(model, positions: int, device: torch.device) -> torch.Tensor:
    """(layers, 2, 1, kv_heads, positions, head_dim): StreamingCache's layout, one tensor for every layer."""
    geo = CacheGeometry.from_config(model.config, model.model.embed_tokens.weight.dtype)
    return torch.empty((geo.num_layers, 2, *geo.layer_shape(positions)), dtype=geo.dtype, device=device)


def _bind(layer: DynamicLayer, k: torch.Tensor, v: torch.Tensor) -> None:
    """Point a cache layer at K/V views of the block. Its lazy_initialization runs once per layer only: it builds
    two empty tensors on the device from Python lists (`torch.tensor([], device=...)`), host work that, run for
    every layer of every chunk, came to ~100 tensor constructions per chunk."""
    if not layer.is_initialized:
        layer.lazy_initialization(k, v)
    layer.keys, layer.values = k, v


def _publish(cache: StreamingCache, length: int) -> None:
    """Each cache layer's K/V: the block's positions 0..length - 1 (views)."""
    for i, layer in enumerate(cache.layers):
        _bind(layer, cache.block[i, 0, :, :, :length], cache.block[i, 1, :, :, :length])


def _forward(model, ids: torch.Tensor, cache: StreamingCache, start: int, row: int,
             on_layer: LayerCallback | None) -> torch.Tensor:
    """ids (m,) at positions start..start + m - 1 of cache.block (whose 0..start - 1 hold the past) -> the logits
    (vocab,) of row `row` (-1: the last). Rows after `row` are pads: RoPE at row's position, K/V at their own."""
    cfg, inner = model.config, model.model
    m, dev, end = ids.shape[0], ids.device, start + ids.shape[0]
    if end > cache.block.shape[4]:
        raise ValueError(f"a piece at positions {start}..{end - 1} passes the prefill block's {cache.block.shape[4]}")
    hq, hkv, d = cfg.num_attention_heads, cache.block.shape[3], cache.block.shape[5]  # the block's: _block
    eps, layers = cfg.rms_norm_eps, fused_layers(model)
    scale = float(getattr(inner.layers[0].self_attn, "scaling", d ** -0.5))
    h = inner.embed_tokens(ids)  # (m, H)
    pos = torch.arange(start, end, device=dev)  # where each row's K/V go
    rope = pos if row == -1 else pos.clamp(max=start + row)  # each pad at the last real token's position
    cos, sin = inner.rotary_emb(h, rope[None])  # (1, m, D) each, in h's dtype as HF's attention sees them
    cos, sin = cos[0], sin[0]
    to_slot0 = torch.zeros(m, dtype=torch.long, device=dev)
    mask = causal_lower_right(m, end) if start else None  # after a past: causal, aligned to the last key
    block = cache.block

    def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kl, vl = block[i, 0], block[i, 1]  # (1, Hkv, positions, D): a one-slot pool
        q = kernels.rope_store(q, k, v, cos, sin, kl, vl, to_slot0, pos)  # rotated q (m, Hq, D); K/V into the block
        kl, vl = kl[:, :, :end], vl[:, :, :end]  # (1, Hkv, end, D)
        if start == 0:  # a whole prompt: the cache as a prefill leaves it (fused_chunk sets its own after the piece)
            _bind(cache.layers[i], kl, vl)
        if on_layer is not None:
            on_layer(i, kl, vl)
        with prompt_attention(end):
            o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kl, vl, attn_mask=mask, is_causal=mask is None,
                                               scale=scale, enable_gqa=hq != hkv)  # (1, Hq, m, D)
        return o[0].transpose(0, 1)  # (m, Hq, D)

    h, residual = run_layers(layers, h, eps, (hq, hkv, d), attend)  # (m, H) each
    last = m - 1 if row == -1 else row
    x, _ = kernels.add_rms_norm(h[last:last + 1], residual[last:last + 1], inner.norm.weight, eps)  # one row only
    return F.linear(x, model.lm_head.weight)[0]  # (vocab,)
