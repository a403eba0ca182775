"""The HF forward's greedy decode over a DynamicCache: the oracle a transferred or reloaded cache is checked against.

Why in the bench and not the core: no server decodes this way (the engine decodes in batches over its pool); the
offload bench and the tests decode a cache token by token with the plain HF forward, and compare tokens and logits
with the colocated run. The next token is the engine's own choice (kvtransfer/engine/sampler.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kvtransfer.engine.sampler import first_token as choose_first
from kvtransfer.model.prefill import logits_digest
from kvtransfer.model.streaming import cache_kwarg


@dataclass
class Generation:
    tokens: list[int]
    logits: torch.Tensor  # (steps, vocab), model dtype, on the model's device

    def logits_digests(self) -> list[str]:
        return [logits_digest(row) for row in self.logits]



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
        tok = choose_first(logits).view(1, 1)
        yield tok, logits


def decode(model, cache, first_logits: torch.Tensor, max_new_tokens: int,
           prompt_len: int | None = None) -> Generation:
    """Greedy decode from a cache covering exactly the prompt and the prompt's last logits.

    Token 0 comes from `first_logits`; each later token costs one forward step of one token.
    """
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    first = choose_first(first_logits).view(1, 1)  # (1, 1)
    toks, logits = [first], [first_logits]
    for tok, row in decode_steps(model, cache, first, max_new_tokens - 1, prompt_len):
        toks.append(tok)
        logits.append(row)
    return Generation(torch.cat(toks).view(-1).tolist(), torch.stack(logits))
