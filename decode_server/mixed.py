"""Prefill chunks that ride in a decode step (Sarathi-Serve's piggybacking): one forward for both.

Why: with ~1k-token prompts and 128 output tokens, a separate prefill forward and a separate
decode step each read all the weights; at concurrency 32 that caps one H200 at ~13x the
one-at-a-time baseline (README, "What bounds this"). A chunk of c prompt tokens and the B decode
rows share every GEMM instead: the step costs max(compute of c + B rows, one read of the
weights), so the decode rows ride nearly free while a prefill is in progress.

A step has --prefill-chunk rows in all, its decode rows included (Sarathi-Serve's token budget): the
rows left carry the next chunk of the prompt in progress, and when that ends short of them, the first
chunk of the next prompt too (up to MAX_PIECES prompts a step), so no graph row is padding while
prompts wait.
A chunk needs nothing new from the step: c prompt tokens at positions start..start + c - 1 of one
slot are c more rows of it. The step writes every row's K/V before any row attends, and each row
attends over positions 0..its own of its slot, which for the chunk's rows is exactly causal
attention after the chunk's past. `mixed_forward` runs the step over the B decode rows plus the
chunks' rows and keeps only the decode rows and each chunk's last row for the final norm and
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

MAX_PIECES = 4  # prompt chunks in one step (each keeps one row for lm_head)


def check_mixed_rows(rows: int, max_batch: int) -> None:
    """A mixed step of `rows` rows must leave room for prompt rows beside a full batch."""
    if rows < 2 * max_batch:
        raise ValueError(f"--prefill-chunk {rows} with --mixed-prefill is the rows of a step, decode rows included: "
                         f"it must be >= 2 x --max-batch ({2 * max_batch})")


@dataclass
class Chunk:
    ids: torch.Tensor  # (c,) int64 on the device
    slot: int
    start: int  # positions start .. start + c - 1
    last: bool  # the prompt's final chunk: its last row's logits give the first token


@torch.inference_mode()
def mixed_forward(r: StepRunner, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                  chunks: list[Chunk]) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens/positions/slots: (B,) decode rows (B may be 0); chunks: P pieces of prompts, each c_j tokens into its
    slot. Eager. Returns (decode logits (B, vocab), each chunk's last-row logits (P, vocab))."""
    b, dev = tokens.shape[0], tokens.device
    ends = torch.tensor([c.ids.shape[0] for c in chunks]).cumsum(0) + b - 1  # each chunk's last row
    keep = torch.cat([torch.arange(b), ends]).to(dev, non_blocking=True)  # (B + P,)
    logits = r.forward(torch.cat([tokens, *(c.ids for c in chunks)]),  # (B + sum c_j,)
                       torch.cat([positions, *(torch.arange(c.start, c.start + c.ids.shape[0], device=dev)
                                               for c in chunks)]),
                       torch.cat([slots, *(torch.full((c.ids.shape[0],), c.slot, dtype=torch.long, device=dev)
                                           for c in chunks)]),
                       keep)  # (B + P, vocab)
    return logits[:b], logits[b:]


@dataclass
class MixedPrefill:
    """One prompt's chunks, handed out one per step; the future resolves with LocalPrefill after the last."""

    ids: torch.Tensor  # (n,) int64 on the device
    lease: Lease
    want_digest: bool
    future: Future = field(default_factory=Future)
    start: int = 0
    t0: float = field(default_factory=time.perf_counter)  # reset when its first chunk goes (scheduler)

    def next_chunk(self, budget: int) -> Chunk:
        """The next chunk: at most `budget` tokens (the step's prompt rows still free)."""
        end = min(self.ids.shape[0], self.start + budget)
        c = Chunk(self.ids[self.start:end], self.lease.slot, self.start, end == self.ids.shape[0])
        self.start = end
        return c

    @property
    def handed_out(self) -> bool:
        return self.start >= self.ids.shape[0]
