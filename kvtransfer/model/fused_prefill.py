"""Prefill with the decode engine's fused ops: a quarter of the kernels per layer that HF's forward launches.

Why: a served prefill runs on a thread that shares the GIL with the gRPC event loop, and HF's
eager forward is launch-heavy, so its wall time is set by the host, and more so next to a busy
thread. This path launches fused q/k/v and gate/up GEMMs, fused RoPE + cache write and fused
add + RMSNorm (the measurement: bench/results/probe-h200-2026-12-01). Both servers call it through `kvtransfer.model.prefill.prefill`, so a colocated
and a disaggregated request still see byte-identical caches and logits.

What it equals: on CPU (reference ops, which mirror HF's eager math) it is bit-identical to the HF
forward, cache and logits (tests/test_fused_prefill.py). On CUDA the Triton norm/RoPE kernels and
SDPA's GQA path round differently from HF's ops: equal within bf16 tolerance, not bit for bit.
Only whole prompts of Llama/Qwen2/Mistral-style decoders take it (anything else, and the later
chunks of a chunked prefill, run the HF forward).

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
from transformers.cache_utils import DynamicLayer

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


@torch.inference_mode()
def fused_prefill(model, input_ids: torch.Tensor, on_layer: LayerCallback | None = None
                  ) -> tuple[StreamingCache, torch.Tensor] | None:
    """input_ids (1, n) -> (cache of the prompt, last position's logits (vocab,)), or None when the model's cache
    layers are not plain DynamicLayers (the caller then runs HF). on_layer(i, k, v) sees layer i's finished K/V,
    each (1, kv_heads, n, head_dim), before layer i's attention runs, as StreamingCache's hook does."""
    cfg, inner = model.config, model.model
    cache = StreamingCache(config=cfg)
    if any(type(layer) is not DynamicLayer for layer in cache.layers):
        return None
    ids = input_ids[0]
    n, dev = ids.shape[0], ids.device
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    eps, layers = cfg.rms_norm_eps, fused_layers(model)
    scale = float(getattr(inner.layers[0].self_attn, "scaling", d ** -0.5))
    h = inner.embed_tokens(ids)  # (n, H)
    pos = torch.arange(n, device=dev)
    cos, sin = inner.rotary_emb(h, pos[None])  # (1, n, D) each, in h's dtype as HF's attention sees them
    cos, sin = cos[0], sin[0]
    block = torch.empty((len(layers), 2, 1, hkv, n, d), dtype=h.dtype, device=dev)  # StreamingCache's layout
    cache.block = block
    to_slot0 = torch.zeros(n, dtype=torch.long, device=dev)

    def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kl, vl = block[i, 0], block[i, 1]  # (1, Hkv, n, D): a one-slot pool
        q = kernels.rope_store(q, k, v, cos, sin, kl, vl, to_slot0, pos)  # rotated q (n, Hq, D); K/V into the block
        cache.layers[i].lazy_initialization(kl, vl)
        cache.layers[i].keys, cache.layers[i].values = kl, vl
        if on_layer is not None:
            on_layer(i, kl, vl)
        with prompt_attention(n):
            o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kl, vl, is_causal=True, scale=scale,
                                               enable_gqa=hq != hkv)  # (1, Hq, n, D)
        return o[0].transpose(0, 1)  # (n, Hq, D)

    h, residual = run_layers(layers, h, eps, (hq, hkv, d), attend)  # (n, H) each
    x, _ = kernels.add_rms_norm(h[-1:], residual[-1:], inner.norm.weight, eps)  # the last position only
    return cache, F.linear(x, model.lm_head.weight)[0]  # (vocab,)
