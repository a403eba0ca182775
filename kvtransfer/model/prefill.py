"""Colocated reference: prefill -> first token -> greedy decode, on one device.

Why: this is the baseline every disaggregated run is compared with, token for token and
logit for logit. The disaggregated path reuses the same two halves (`prefill` on one
worker, `decode` on the other) so the comparison is of the cache, not of two codes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kvtransfer.model import fused_prefill
from kvtransfer.model.streaming import LayerCallback, StreamingCache, cache_kwarg


@dataclass
class Generation:
    tokens: list[int]
    logits: torch.Tensor  # (steps, vocab), model dtype, on the model's device

    def logits_digests(self) -> list[str]:
        return [logits_digest(row) for row in self.logits]


def logits_digest(logits: torch.Tensor) -> str:
    """Digest of one step's logits, bit-exact (dtype and bytes)."""
    raw = logits.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(str(logits.dtype).encode() + raw).hexdigest()[:32]


@torch.inference_mode()
def prefill(model, input_ids: torch.Tensor, on_layer: LayerCallback | None = None,
            cache: StreamingCache | None = None, fused: bool = True) -> tuple[StreamingCache, torch.Tensor]:
    """Run the prompt once (or the next chunk of it, after `cache`). Returns the cache and the last position's
    logits (vocab,).

    input_ids: (1, seq). The layer callback sees each layer's K/V (the whole cache so far) during this call only.
    A whole prompt of a Llama/Qwen2/Mistral-style model runs the fused ops (fused_prefill.py: the same kernels
    on every server, so caches stay byte-identical across them); `fused=False`, other models and later chunks
    run the HF forward.
    """
    if cache is None and fused and fused_prefill.supports(model, input_ids.shape[1]):
        out = fused_prefill.fused_prefill(model, input_ids, on_layer)
        if out is not None:
            return out
    cache = cache if cache is not None else StreamingCache(config=model.config)
    cache.on_layer = on_layer
    try:
        out = model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **{cache_kwarg(model): cache})
    finally:
        cache.on_layer = None  # decode steps must never reach the transport
    return cache, out.logits[0, -1]  # (vocab,)


@torch.inference_mode()
def decode_steps(model, cache, first_token: torch.Tensor, steps: int,
                 prompt_len: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Feed `first_token` (1, 1) and greedily continue: yields (token (1, 1), logits (vocab,)) per step.

    The cache must cover exactly the prompt. Its length is checked on entry (when
    `prompt_len` is given) and after every step, so a cache that silently re-ran prefill
    (or lost tokens) fails loudly. Tokens stay on the device: no host sync per step.
    """
    if prompt_len is not None and cache.get_seq_length() != prompt_len:
        raise RuntimeError(f"cache holds {cache.get_seq_length()} tokens, the prompt has {prompt_len}")
    base = cache.get_seq_length()
    kw = cache_kwarg(model)
    tok = first_token
    for step in range(1, steps + 1):
        out = model(input_ids=tok, use_cache=True, **{kw: cache})
        if cache.get_seq_length() != base + step:
            raise RuntimeError(f"cache holds {cache.get_seq_length()} tokens after decode step {step}, "
                               f"expected {base + step}")
        logits = out.logits[0, -1]  # (vocab,)
        tok = logits.argmax().view(1, 1)
        yield tok, logits


def decode(model, cache, first_logits: torch.Tensor, max_new_tokens: int,
           prompt_len: int | None = None) -> Generation:
    """Greedy decode from a cache covering exactly the prompt and the prompt's last logits.

    Token 0 comes from `first_logits`; each later token costs one forward step of one token.
    """
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    first = first_logits.argmax().view(1, 1)  # (1, 1)
    toks, logits = [first], [first_logits]
    for tok, row in decode_steps(model, cache, first, max_new_tokens - 1, prompt_len):
        toks.append(tok)
        logits.append(row)
    return Generation(torch.cat(toks).view(-1).tolist(), torch.stack(logits))


def random_prompt(vocab_size: int, length: int, seed: int = 0, device="cpu") -> torch.Tensor:
    """(1, length) token ids, reproducible; avoids id 0..2 (often special)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (1, length), generator=g).to(device)
