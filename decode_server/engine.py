"""The decode worker's device work: assemble a received cache (or prefill locally) and decode.

Why apart from the servicer: one thread owns the device; the servicer only awaits. Tokens
are handed back one by one through a callback so the client sees each as it is made.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from kvtransfer.determinism import sync
from kvtransfer.reference import decode_steps, logits_digest, prefill
from kvtransfer.serving import LoadedModel
from kvtransfer.streaming import assemble_cache

# emit(index, token_id, logits_digest, perf_counter_time)
Emit = Callable[[int, int, str, float], None]


class Cancelled(Exception):
    """The client went away; decoding stopped early."""


class DecodeEngine:
    def __init__(self, loaded: LoadedModel):
        self.m = loaded

    def local_prefill(self, token_ids: list[int], want_digest: bool):
        """Colocated baseline / recompute: returns (cache, first_token, digest, prefill_ms)."""
        ids = torch.tensor([token_ids], dtype=torch.long).to(self.m.device)  # (1, seq)
        sync(self.m.device)
        t0 = time.perf_counter()
        cache, logits = prefill(self.m.model, ids)
        first = int(logits.argmax())
        ms = (time.perf_counter() - t0) * 1e3
        return cache, first, (logits_digest(logits) if want_digest else ""), ms

    def assemble(self, layers):
        return assemble_cache(self.m.model.config, layers)

    def decode(self, cache, first_token: int, steps: int, prompt_len: int, want_digest: bool,
               emit: Emit, cancelled: threading.Event) -> None:
        """Emit tokens 1..steps (token 0 came from prefill)."""
        tok = torch.tensor([[first_token]], dtype=torch.long, device=self.m.device)  # (1, 1)
        for i, (tok, logits) in enumerate(decode_steps(self.m.model, cache, tok, steps, prompt_len), start=1):
            if cancelled.is_set():
                raise Cancelled()
            emit(i, int(tok), logits_digest(logits) if want_digest else "", time.perf_counter())
