"""The prefill both servers run: the prompt once (or the next chunk after a past), its cache and last logits.

Why one function: the prefill worker, the decode server's colocated and recompute paths and the bench all call
it, so a colocated and a disaggregated request see byte-identical caches and logits; the comparison is of the
cache, not of two codes. `logits_digest` is how both sides report logits, bit for bit.
"""

from __future__ import annotations

import hashlib

import torch

from kvtransfer.model import fused_prefill
from kvtransfer.model.streaming import LayerCallback, StreamingCache, cache_kwarg


def logits_digest(logits: torch.Tensor) -> str:
    """Digest of one step's logits, bit-exact (dtype and bytes)."""
    raw = logits.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(str(logits.dtype).encode() + raw).hexdigest()[:32]


@torch.inference_mode()
def prefill(model, input_ids: torch.Tensor, on_layer: LayerCallback | None = None,
            cache: StreamingCache | None = None, fused: bool = True, row: int = -1
            ) -> tuple[StreamingCache, torch.Tensor]:
    """Run the prompt once (or the next chunk of it, after `cache`). Returns the cache and the last position's
    logits (vocab,), or row `row`'s of a chunk padded after its last real token.

    input_ids: (1, seq). The layer callback sees each layer's K/V (the whole cache so far) during this call only.
    A whole prompt of a Llama/Qwen2/Mistral-style model runs the fused ops (fused_prefill.py: the same kernels
    on every server, so caches stay byte-identical across them), and so does every piece after a cache from
    `fused_prefill.chunk_cache`; `fused=False`, other models and pieces after any other cache run the HF forward.
    """
    if fused and cache is not None and cache.fused:  # a piece after a past, into the block chunk_cache allocated
        return cache, fused_prefill.fused_chunk(model, input_ids, cache, on_layer, row)
    if cache is None and fused and row == -1 and fused_prefill.supports(model, input_ids.shape[1]):
        out = fused_prefill.fused_prefill(model, input_ids, on_layer)
        if out is not None:
            return out
    cache = cache if cache is not None else StreamingCache(config=model.config)
    cache.on_layer = on_layer
    try:
        keep, extra = 1, {}
        if row != -1:  # padded: logits of row `row` only; each pad at the last real token's position, so no position
            # passes the prompt's (RoPE's range; a dynamic RoPE would rescale for the real rows too). No host copy.
            keep = torch.arange(row, row + 1, device=input_ids.device)
            extra["position_ids"] = (torch.arange(input_ids.shape[1], device=input_ids.device).clamp(max=row)
                                     + cache.get_seq_length())[None]  # (1, seq)
        out = model(input_ids=input_ids, use_cache=True, logits_to_keep=keep, **{cache_kwarg(model): cache}, **extra)
    finally:
        cache.on_layer = None  # decode steps must never reach the transport
    return cache, out.logits[0, -1]  # (vocab,)


def random_prompt(vocab_size: int, length: int, seed: int = 0, device="cpu") -> torch.Tensor:
    """(1, length) token ids, reproducible; avoids id 0..2 (often special)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (1, length), generator=g).to(device)
