"""Prefill chunks that ride in a decode step (Sarathi-Serve's piggybacking): one forward for both.

Why: with ~1k-token prompts and 128 output tokens, a separate prefill forward and a separate
decode step each read all the weights; at concurrency 32 that caps one H200 at ~13x the
one-at-a-time baseline (README, "What bounds this"). A chunk of c prompt tokens and the B decode
rows share every GEMM instead: the step costs max(compute of c + B rows, one read of the
weights), so the decode rows ride nearly free while a prefill is in progress.

A chunk needs nothing new from the step: c prompt tokens at positions start..start + c - 1 of one
slot are c more rows of it. The step writes every row's K/V before any row attends, and each row
attends over positions 0..its own of its slot, which for the chunk's rows is exactly causal
attention after the chunk's past. `mixed_forward` runs the step over the B decode rows plus the
chunk's c rows and keeps only the decode rows and the chunk's last row for the final norm and
lm_head. Being the step, it is captured as a CUDA graph per batch bucket with the chunk padded to
--prefill-chunk rows (graphs.py): eagerly, the host's launches, not the GPU, would set its pace.
`MixedPrefill` is one prompt's progress through its chunks.

What it equals: decode rows within the batching tolerance of the plain step; a prompt's cache
and first logits within the chunked-prefill tolerance of a whole prefill (tests/test_mixed.py).
A prompt that fits one chunk while nothing decodes takes the plain fused prefill instead, so a
request alone stays bit-identical between colocated and disaggregated.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from .pool import Lease
from .runner import StepRunner


@dataclass
class Chunk:
    ids: torch.Tensor  # (c,) int64 on the device
    slot: int
    start: int  # positions start .. start + c - 1
    last: bool  # the prompt's final chunk: its last row's logits give the first token


@torch.inference_mode()
def mixed_forward(r: StepRunner, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                  chunk: Chunk) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens/positions/slots: (B,) decode rows (B may be 0); chunk: c prompt tokens into chunk.slot. Eager.
    Returns (decode logits (B, vocab), the chunk's last-row logits (vocab,))."""
    b, c, dev = tokens.shape[0], chunk.ids.shape[0], chunk.ids.device
    keep = torch.arange(b + 1, device=dev)
    keep[b] = b + c - 1  # decode rows + the chunk's last row
    logits = r.forward(torch.cat([tokens, chunk.ids]),  # (B + c,)
                       torch.cat([positions, torch.arange(chunk.start, chunk.start + c, device=dev)]),
                       torch.cat([slots, torch.full((c,), chunk.slot, dtype=torch.long, device=dev)]),
                       keep)  # (B + 1, vocab)
    return logits[:b], logits[b]


@dataclass
class MixedPrefill:
    """One prompt's chunks, handed out one per step; the future resolves with LocalPrefill after the last."""

    ids: torch.Tensor  # (n,) int64 on the device
    lease: Lease
    chunk: int
    want_digest: bool
    future: Future = field(default_factory=Future)
    start: int = 0
    t0: float = field(default_factory=time.perf_counter)  # reset when its first chunk goes (scheduler)

    def next_chunk(self) -> Chunk:
        end = min(self.ids.shape[0], self.start + self.chunk)
        c = Chunk(self.ids[self.start:end], self.lease.slot, self.start, end == self.ids.shape[0])
        self.start = end
        return c

    @property
    def handed_out(self) -> bool:
        return self.start >= self.ids.shape[0]
